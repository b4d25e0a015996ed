"""Durable control data of what is served: models, their revisions and the render sidecar's configuration."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from catalog import sidecar_addresses

# The largest RenderConfig.stream_interval: coalescing buffers at most 64 events a stream
# (serving/pipeline/derender/coalesce.py, MAX_PENDING), so a larger interval could never fill.
STREAM_INTERVAL_MAX = 64
# The largest RenderConfig.stream_interval_ms: a chunk may wait that long for the next derender,
# and past a second a stream no longer reads as one (64 held events flush earlier anyway).
STREAM_INTERVAL_MS_MAX = 1000
# The largest placement scorer weight: scores are in [0, 1], so 100 already lets one scorer
# outweigh another a hundredfold; a larger number only hides a typo.
SCORER_WEIGHT_MAX = 100.0

_SCORER_WEIGHT = [MinValueValidator(0.0), MaxValueValidator(SCORER_WEIGHT_MAX)]


class Health(models.TextChoices):
    """The probes' verdict, shared by engines and the render sidecar."""

    UNKNOWN = "unknown", "unknown"  # never probed, or not enough probes to decide
    HEALTHY = "healthy", "healthy"
    FAILING = "failing", "failing"


class ServedModel(models.Model):
    """A model clients name in ``model``; engines and the render sidecar serve it under that name.

    One fleet serves several: each model has its own render config (``RenderConfig.served_model``)
    and its own engines, and a request is served only by its model's tiers.
    """

    class State(models.TextChoices):
        ACTIVE = "active", "active"  # listed in /v1/models, takes requests
        # Takes no new requests (503, retry elsewhere); requests already admitted finish.
        DRAINING = "draining", "draining"
        RETIRED = "retired", "retired"  # as if unknown: not listed, 404 model_not_found

    name = models.CharField(max_length=200, unique=True, help_text="The name clients send as `model`.")
    model_path = models.CharField(max_length=500, help_text="Model directory the tiers load.")
    max_model_len = models.PositiveIntegerField(default=2048)
    vocab_size = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Rows of the model's embedding (config.json `vocab_size`); written by the version probe. "
        "Empty: unknown, and token-only traffic is refused (503) until it is known.",
    )
    active_revision = models.ForeignKey(
        "serving.ModelRevision", models.SET_NULL, null=True, blank=True, related_name="+",
        help_text="The revision render and engines must agree on.",
    )
    state = models.CharField(
        max_length=10, choices=State.choices, default=State.ACTIVE,
        help_text="active: served; draining: no new requests (503), those in flight finish; retired: unknown to clients (404).",
    )
    # Placement's scorer weights (serving/pipeline/placement/scorers.py, docs/request-path.md, Placement): each
    # scorer gives every candidate engine a score in [0, 1]; the highest weighted sum wins.
    prefix_weight = models.FloatField(
        default=1.0, validators=_SCORER_WEIGHT,
        help_text="Placement: how much an engine already holding the prompt's leading KV blocks counts "
        "(score: the share of the prompt cached there). 0: ignore the KV cache.",
    )
    queue_weight = models.FloatField(
        default=0.0, validators=_SCORER_WEIGHT,
        help_text="Placement: how much few requests in flight per engine weight count (the least loaded "
        "engine scores 1, the busiest 0). Above 0 it trades against prefix_weight.",
    )
    tokens_weight = models.FloatField(
        default=0.0, validators=_SCORER_WEIGHT,
        help_text="Placement: how much few admitted tokens in flight per engine token capacity count "
        "(the least loaded engine scores 1, the busiest 0).",
    )
    # A LoRA adapter engines load (--lora-modules NAME=DIR) is a served model of its own: rendered
    # and derendered as its base (same tokenizer and template), generated under its own name on
    # the base's engines that hold it (EngineInstance.lora_adapters).
    base = models.ForeignKey(
        "self", models.PROTECT, null=True, blank=True, related_name="adapters",
        help_text="Set for a LoRA adapter: the served model whose engines load it and whose render config renders it. "
        "Its name is the adapter's --lora-modules name; model_path the adapter's directory.",
    )
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(prefix_weight__gte=0, prefix_weight__lte=SCORER_WEIGHT_MAX)
                & models.Q(queue_weight__gte=0, queue_weight__lte=SCORER_WEIGHT_MAX)
                & models.Q(tokens_weight__gte=0, tokens_weight__lte=SCORER_WEIGHT_MAX),
                name="served_model_scorer_weights_in_range",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class ModelRevision(models.Model):
    """Fingerprints deciding whether two tiers serve the same model (see ``catalog.fingerprints``)."""

    served_model = models.ForeignKey(ServedModel, models.CASCADE, related_name="revisions")
    label = models.CharField(max_length=100, blank=True)
    tokenizer_hash = models.CharField(max_length=64, blank=True)
    chat_template_hash = models.CharField(max_length=64, blank=True)
    config_hash = models.CharField(max_length=64, blank=True)
    generation_config_hash = models.CharField(max_length=64, blank=True)
    special_tokens = models.JSONField(default=dict, blank=True)
    reasoning_parser = models.CharField(
        max_length=100, blank=True,
        help_text="The sidecar's --reasoning-parser. Set: while render is down, chats are refused (503) rather "
        "than answered by the local fallback with the reasoning inside the content.",
    )
    tool_parser = models.CharField(
        max_length=100, blank=True,
        help_text="The sidecar's --tool-call-parser. Set: while render is down, chats are refused (503) too: "
        "the sidecar's parser changes how every chat is decoded.",
    )
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.served_model_id}:{self.label or self.pk}"

    def fingerprint(self) -> dict[str, str]:
        """The hashes in the shape ``fingerprint_model_dir`` returns, for comparison."""
        return {
            "config": self.config_hash,
            "tokenizer": self.tokenizer_hash,
            "chat_template": self.chat_template_hash,
            "generation_config": self.generation_config_hash,
        }


class RenderConfig(models.Model):
    """The RFC's ``render_config``: where the render sidecar is and how it is called."""

    name = models.CharField(max_length=100, unique=True, default="default")
    served_model = models.OneToOneField(
        ServedModel, models.SET_NULL, null=True, blank=True, related_name="render_config",
        help_text="The model this sidecar renders for. Empty: the default config, used by every model that has "
        "none of its own (the oldest such row).",
    )
    enable = models.BooleanField(default=True, help_text="Off: requests take the engines' native path.")
    image_name = models.CharField(max_length=200, blank=True, help_text="Empty: reuse the coordinator image.")
    host = models.CharField(max_length=200, default="127.0.0.1")
    port = models.PositiveIntegerField(default=8100)
    timeout_ms = models.PositiveIntegerField(
        default=5000,
        help_text=(
            "Bounds each render call, each non-streaming derender call and each streaming chunk's derender, "
            "its retries included (MOTOR_DERENDER_CHUNK_RETRIES, 0 by default); not the whole stream."
        ),
    )
    renderer_num_workers = models.PositiveIntegerField(default=4)
    context_budget = models.BooleanField(default=False, help_text="Clamp max_tokens to the engine's room left.")
    derender_coalesce = models.BooleanField(
        default=True,
        help_text="Merge engine chunks that queue up behind a streaming derender call into one call.",
    )
    stream_interval = models.PositiveIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(STREAM_INTERVAL_MAX)],
        help_text=(
            "Tokens per streamed chunk after a choice's first, as vLLM's --stream-interval: 1 sends each "
            "token as it comes; N makes one derender call per N tokens (less sidecar CPU, coarser chunks). "
            "The first token is never held back."
        ),
    )
    stream_interval_ms = models.PositiveIntegerField(
        default=0,
        validators=[MaxValueValidator(STREAM_INTERVAL_MS_MAX)],
        help_text=(
            "Milliseconds between a choice's derender calls after its first token (never held back): at most one "
            "call per interval per choice however fast the engine decodes; flushed at once on finish, error and "
            "the end. Applies together with stream_interval (a call waits for both). 0: off."
        ),
    )
    local_stream_detokenize = models.BooleanField(
        default=False,
        help_text=(
            "Derender plain streams (chat or completions; no tool or reasoning parser, no logprobs, no echo, no "
            "obfuscation) in the coordinator with the model's tokenizer files and vLLM's incremental detokenization, instead of one sidecar call per chunk. Off: the RFC puts derender in the sidecar."
        ),
    )
    obfuscation = models.BooleanField(default=False, help_text="Token obfuscation (fails closed).")
    obfuscation_key_ref = models.CharField(
        max_length=300, blank=True, help_text="Where the key is: `setting:NAME` or `file:/path`; never the key."
    )
    obfuscation_key_id = models.CharField(max_length=100, blank=True)
    # Machine-owned: written by the version and health probes only.
    sidecar_version = models.CharField(max_length=50, blank=True)
    streaming_derender = models.BooleanField(
        default=True, help_text="False when the sidecar is older than vLLM 0.27 (streams take the native path)."
    )
    model_mismatch = models.CharField(
        max_length=500, blank=True,
        help_text="How the served models' records (name, model_path) differ from what the sidecar's /v1/models reports.",
    )
    health = models.CharField(max_length=10, choices=Health.choices, default=Health.UNKNOWN)
    last_probe_at = models.DateTimeField(null=True, blank=True)
    last_probe_error = models.TextField(blank=True)
    pool_size = models.PositiveIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(16)],
        help_text="Sidecars `make run` started for this config (MOTOR_RENDER_POOL_SIZE: on `port` and the ports "
        "after it); sidecars added by address are members too.",
    )
    # Set by render_config_publish when a change needs the managed sidecar restarted; cleared by
    # whatever restarts it (the launcher), so an operator can see a restart is still owed.
    restart_required = models.BooleanField(default=False)

    # Keys an imported render config may carry (the RFC's names); anything else is an error.
    IMPORT_KEYS = (
        "enable", "image_name", "host", "port", "timeout_ms", "renderer_num_workers",
        "context_budget", "derender_coalesce", "stream_interval", "stream_interval_ms", "local_stream_detokenize", "obfuscation",
        "obfuscation_key_ref",
        "obfuscation_key_id",
    )
    # Changing any of these means the running sidecar no longer matches its config.
    RESTART_KEYS = ("host", "port", "renderer_num_workers", "obfuscation_key_ref", "obfuscation_key_id", "image_name")

    def __str__(self) -> str:
        return self.name

    @property
    def base_url(self) -> str:
        # A unix socket's config ignores ``port`` (``sidecar_addresses``).
        return sidecar_addresses.base_url(self.host, self.port)

    @property
    def address(self) -> str:
        return sidecar_addresses.address(self.host, self.port)


class RenderSidecar(models.Model):
    """One member of a render config's pool: a sidecar's address and what its probes found.

    The snapshot gives the data plane every member (``RenderView.members``); the pool picks one
    per call (``serving/pipeline/render/pool.py``). The probe fields are machine-owned.
    """

    render_config = models.ForeignKey(RenderConfig, models.CASCADE, related_name="sidecars")
    host = models.CharField(
        max_length=200, default="127.0.0.1",
        help_text="A host name or IP address, or a unix socket on the coordinators' machine: unix:/path/to.sock.",
    )
    # 0 for a unix socket, which has none (``sidecar_addresses``).
    port = models.PositiveIntegerField(blank=True, default=0, help_text="The TCP port; blank for a unix socket.")
    # Machine-owned: written by the version and health probes only.
    sidecar_version = models.CharField(max_length=50, blank=True)
    capabilities = models.JSONField(
        default=dict, blank=True,
        help_text="What the probe found: vLLM version, the render/derender routes served, token_in, derender, "
        "streaming_derender (the version floors), tokenizer_loaded.",
    )
    health = models.CharField(max_length=10, choices=Health.choices, default=Health.UNKNOWN)
    consecutive_successes = models.PositiveIntegerField(default=0)
    consecutive_failures = models.PositiveIntegerField(default=0)
    last_probe_at = models.DateTimeField(null=True, blank=True)
    last_probe_error = models.TextField(blank=True)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        constraints = [models.UniqueConstraint(fields=["render_config", "host", "port"], name="render_sidecar_address")]

    def __str__(self) -> str:
        return self.address

    def clean(self) -> None:
        if self.port is None:  # the admin form's blank port: a unix socket's
            self.port = 0
        if (error := sidecar_addresses.address_error(self.host, self.port)) is not None:
            field, sentence = error
            raise ValidationError({field: sentence})

    @property
    def base_url(self) -> str:
        return sidecar_addresses.base_url(self.host, self.port)

    @property
    def address(self) -> str:
        """``host:port`` or ``unix:/path/to.sock``: how an operator writes it."""
        return sidecar_addresses.address(self.host, self.port)


class RenderStreamReport(models.Model):
    """Requests one coordinator process still holds on each render sidecar (machine-owned).

    Written by that process (``serving.stream_reports``) when its counts change, read by the
    launcher's graceful restart, which retires a replaced sidecar only once no live process
    reports a request on it (``catalog.services.render_live_streams``).
    """

    host = models.CharField(max_length=255, help_text="The machine the process runs on.")
    pid = models.PositiveIntegerField()
    counts = models.JSONField(default=dict, blank=True, help_text="Sidecar base URL -> live requests on it.")
    updated = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["host", "pid"], name="render_stream_report_process")]

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}"
