"""Durable control data of the engine fleet.

Machine-owned fields (probe verdicts, breaker state, reported versions) change only through
the methods here and ``fleet.services``: each is a compare-and-set update
(``filter(id=..., state=old).update(...)``) so two workers cannot both flip one state, and each
flip writes a history row (``InstanceEvent``, ``BreakerFlip``), like healthchecks' ``Flip``.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models, transaction
from django.db.models import F
from django.utils import timezone

from catalog.models import Health, ServedModel
from fleet.ascend import ASCEND_GENERATIONS

MAX_PORT = 65535


def _with_domain(url: str) -> str:
    """``url`` with a single-label host (a container's or service's name) given a domain."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return url
    if not host or "." in host or ":" in host or host == "localhost":
        return url
    return parts._replace(netloc=parts.netloc.replace(host, host + ".internal", 1)).geturl()


class EngineInstance(models.Model):
    """One token engine (real vLLM or the simulator) the coordinator may place requests on."""

    class Role(models.TextChoices):
        UNION = "union", "union"  # prefills and decodes
        PREFILL = "prefill", "prefill"
        DECODE = "decode", "decode"

    class State(models.TextChoices):
        ACTIVE = "active", "active"  # takes new requests
        DRAINING = "draining", "draining"  # finishes what it has, takes nothing new
        QUARANTINED = "quarantined", "quarantined"  # kept out by an operator or a probe
        DISABLED = "disabled", "disabled"

    class KVConnector(models.TextChoices):
        NONE = "", "none"
        NIXL = "NixlConnector", "NixlConnector"  # pull (Handoff)
        MOONCAKE = "MooncakeConnector", "MooncakeConnector"  # pull (Handoff)
        MOONCAKE_LAYERWISE = "MooncakeLayerwiseConnector", "MooncakeLayerwiseConnector"  # push (Trigger)
        EXAMPLE = "ExampleConnector", "ExampleConnector"  # vLLM's shared-storage example, tests only

    class Hardware(models.TextChoices):
        # The generations vllm-ascend tells apart (vllm_ascend/utils.py AscendDeviceType, 0.23.0.post1);
        # KV moves only between engines of one generation (the P/D seed's limits).
        CPU = "cpu", "CPU"
        CUDA = "cuda", "NVIDIA GPU (CUDA)"
        A2 = "A2", "Ascend A2 (Atlas 800I/800T A2, 910B)"
        A3 = "A3", "Ascend A3 (Atlas A3 SuperPoD, 910C)"
        A5 = "A5", "Ascend A5"
        ATLAS_310P = "310P", "Ascend 310P"

    class KVTransfer(models.TextChoices):
        NONE = "", "none"
        PULL = "pull", "pull"  # D pulls the KV P computed (Handoff)
        PUSH = "push", "push"  # P pushes KV layer by layer to D (Trigger)

    name = models.CharField(max_length=100, unique=True)
    url = models.URLField(help_text="Base URL, e.g. http://127.0.0.1:8201")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.UNION)
    served_model = models.ForeignKey(ServedModel, models.CASCADE, related_name="instances")
    weight = models.PositiveIntegerField(default=1)
    token_capacity = models.PositiveIntegerField(default=65536, help_text="Prompt + output tokens in flight.")
    max_model_len = models.PositiveIntegerField(null=True, blank=True, help_text="Empty: the served model's.")
    cap_token_generate = models.BooleanField("token-only generate", default=True)
    cap_native_openai = models.BooleanField("native OpenAI API", default=False)
    cap_tokenizer = models.BooleanField("tokenizer loaded", default=False)
    kind = models.CharField(max_length=20, default="vllm", help_text="vllm or sim")
    hardware_kind = models.CharField(
        "hardware generation", max_length=10, choices=Hardware.choices, default=Hardware.CPU,
        help_text="P and D of one served model must be of the same generation.",
    )
    kv_connector = models.CharField(max_length=40, choices=KVConnector.choices, default="", blank=True)
    kv_transfer = models.CharField(max_length=4, choices=KVTransfer.choices, default="", blank=True)
    kv_port = models.PositiveIntegerField(
        "KV port", null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(MAX_PORT)],
        help_text="Base of the KV connector's handshake ports (Mooncake kv_port); the engine holds "
        "kv_port .. kv_port + DP×TP − 1 on its host.",
    )
    kv_events_endpoint = models.CharField(max_length=200, blank=True, help_text="ZMQ endpoint of KV cache events.")
    tp = models.PositiveIntegerField("TP", default=1)
    dp = models.PositiveIntegerField("DP", default=1)
    ep = models.PositiveIntegerField("EP", default=1)
    model_dir = models.CharField(max_length=500, blank=True, help_text="Model directory the engine loads (fingerprints).")
    obfuscation_key_id = models.CharField(max_length=100, blank=True)
    state = models.CharField(max_length=12, choices=State.choices, default=State.ACTIVE)
    created = models.DateTimeField(auto_now_add=True)
    # Machine-owned: the version probe.
    reported_version = models.CharField(max_length=50, blank=True)
    reported_root = models.CharField(max_length=500, blank=True)
    reported_name = models.CharField(
        max_length=200, blank=True, help_text="The model name the engine serves (its /v1/models card)."
    )
    reported_max_model_len = models.PositiveIntegerField(null=True, blank=True)
    # Machine-owned: the LoRA probe (fleet/lora_probes.py), from the engine's /v1/models.
    lora_adapters = models.JSONField(
        "LoRA adapters", default=list, blank=True,
        help_text="The LoRA adapters the engine has loaded (its /v1/models cards with this model as parent): "
        "requests for an adapter's served model are placed only on engines that list it.",
    )
    reported_fingerprint = models.JSONField(default=dict, blank=True)
    version_drift = models.BooleanField(default=False)
    drift_reason = models.CharField(max_length=500, blank=True)
    model_mismatch = models.CharField(
        max_length=500, blank=True,
        help_text="How the served model's record (name, model_path) differs from what the engine reports.",
    )
    # Machine-owned: the capability probe (fleet.engine_probes; what it means: fleet.engine_capabilities).
    capabilities = models.JSONField(
        default=dict, blank=True,
        help_text="What the engine reports it serves: vLLM version, routes, tokenizer, LoRA. Empty: not probed yet.",
    )
    # Machine-owned: the health probe.
    health = models.CharField(max_length=10, choices=Health.choices, default=Health.UNKNOWN)
    consecutive_successes = models.PositiveIntegerField(default=0)
    consecutive_failures = models.PositiveIntegerField(default=0)
    last_probe_at = models.DateTimeField(null=True, blank=True)
    last_probe_ok = models.BooleanField(null=True, blank=True)
    last_probe_error = models.TextField(blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_ascend(self) -> bool:
        return self.hardware_kind in ASCEND_GENERATIONS

    def clean_fields(self, exclude: list[str] | None = None) -> None:
        # Compose and Kubernetes reach an engine by its service's name (http://engine-1:8201), a
        # host Django's URLValidator refuses for want of a top-level domain: check such a URL as
        # if the name had one, and keep it as written.
        skip = set(exclude or ())
        errors: dict[str, list[ValidationError]] = {}
        try:
            super().clean_fields(exclude=[*skip, "url"])
        except ValidationError as e:
            errors = e.error_dict
        if "url" not in skip:
            try:
                self._meta.get_field("url").clean(_with_domain(self.url), self)
            except ValidationError as e:
                errors["url"] = e.error_list
        if errors:
            raise ValidationError(errors)

    def endpoint(self) -> tuple[str, int]:
        """Host and HTTP port of ``url`` (the scheme's default port when it names none)."""
        parts = urlsplit(self.url)
        default = 443 if parts.scheme == "https" else 80
        try:
            port = parts.port or default
        except ValueError:  # a port out of range: full_clean's URL check reports it
            port = default
        return parts.hostname or "", port

    def bound_ports(self) -> dict[int, str]:
        """The ports this engine binds on its host, each with what it is for (HTTP, KV handshake)."""
        _, http = self.endpoint()
        ports = {http: "HTTP"}
        if self.kv_port is not None:
            # Mooncake binds kv_port + dp_rank*tp + tp_rank: one port per device of the engine.
            # None past 65535 exists (``validate_ports`` refuses such a range): a fuzzed TP x DP of
            # 2**62 must not become a loop that holds a request thread for hours.
            for offset in range(min(self.dp * self.tp, max(0, MAX_PORT + 1 - self.kv_port))):
                ports.setdefault(self.kv_port + offset, "KV handshake")
        return ports

    def _transition(self, allowed_from: tuple[str, ...], new: str, *, actor: str, reason: str = "") -> bool:
        """Compare-and-set ``state`` from one of ``allowed_from`` to ``new``; True if this call flipped it."""
        with transaction.atomic():
            old = EngineInstance.objects.filter(id=self.id).values_list("state", flat=True).first()
            if old is None or old not in allowed_from:
                return False
            if not EngineInstance.objects.filter(id=self.id, state=old).update(state=new):
                return False  # another worker flipped it between our read and write
            InstanceEvent.objects.create(instance=self, kind="state", old=old, new=new, actor=actor, reason=reason)
        self.state = new
        return True

    def drain(self, actor: str = "") -> bool:
        return self._transition((self.State.ACTIVE,), self.State.DRAINING, actor=actor)

    def undrain(self, actor: str = "") -> bool:
        return self._transition((self.State.DRAINING,), self.State.ACTIVE, actor=actor)

    def quarantine(self, reason: str = "", actor: str = "") -> bool:
        return self._transition(
            (self.State.ACTIVE, self.State.DRAINING), self.State.QUARANTINED, actor=actor, reason=reason
        )

    def disable(self, actor: str = "") -> bool:
        return self._transition(
            (self.State.ACTIVE, self.State.DRAINING, self.State.QUARANTINED), self.State.DISABLED, actor=actor
        )

    def activate(self, actor: str = "") -> bool:
        return self._transition(
            (self.State.DRAINING, self.State.QUARANTINED, self.State.DISABLED), self.State.ACTIVE, actor=actor
        )


class InstanceEvent(models.Model):
    """History of an instance's operator state (and other recorded changes), newest first."""

    instance = models.ForeignKey(EngineInstance, models.CASCADE, related_name="events")
    created = models.DateTimeField(auto_now_add=True)
    kind = models.CharField(max_length=20)  # state | health | drift | model | ...
    old = models.CharField(max_length=30, blank=True)
    new = models.CharField(max_length=30, blank=True)
    actor = models.CharField(max_length=100, blank=True)
    reason = models.CharField(max_length=500, blank=True)

    class Meta:
        ordering = ["-created", "-id"]


class BreakerState(models.Model):
    """The request-path circuit breaker of one instance, as last written back to the database."""

    class State(models.TextChoices):
        CLOSED = "closed", "closed"  # traffic flows
        OPEN = "open", "open"  # no traffic until open_until
        HALF_OPEN = "half_open", "half-open"  # one trial request decides

    instance = models.OneToOneField(EngineInstance, models.CASCADE, related_name="breaker")
    state = models.CharField(max_length=10, choices=State.choices, default=State.CLOSED)
    consecutive_failures = models.PositiveIntegerField(default=0)
    open_until = models.DateTimeField(null=True, blank=True)
    open_seconds = models.FloatField(default=0.0, help_text="Current backoff.")
    # Bumped by operator actions only: a coordinator whose in-memory breaker has an older epoch
    # adopts the database's state instead of overwriting it with its own.
    epoch = models.PositiveIntegerField(default=0)
    updated = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.instance_id}: {self.state}"

    @classmethod
    def for_instance(cls, instance_id: int) -> BreakerState:
        obj, _ = cls.objects.get_or_create(instance_id=instance_id)
        return obj

    def _flip(
        self, new_state: str, *, reason: str, actor: str, bump_epoch: bool, epoch: int | None = None, **fields: object
    ) -> bool:
        """Compare-and-set the state (and, when ``epoch`` is given, the operator epoch); True if written."""
        with transaction.atomic():
            row = BreakerState.objects.filter(id=self.id).values_list("state", "epoch").first()
            if row is None:
                return False
            old, current_epoch = row
            if epoch is not None and epoch != current_epoch:
                return False  # decided before an operator's reset or force-open: theirs stands
            updates: dict[str, object] = {"state": new_state, "updated": timezone.now(), **fields}
            if bump_epoch:
                updates["epoch"] = F("epoch") + 1
            # The epoch in the filter too: an operator action that lands between the read and this
            # write bumps it, and then this write matches no row.
            expected = {"epoch": epoch} if epoch is not None else {}
            if not BreakerState.objects.filter(id=self.id, state=old, **expected).update(**updates):
                return False
            if old != new_state or bump_epoch:
                BreakerFlip.objects.create(
                    instance_id=self.instance_id, old_state=old, new_state=new_state, reason=reason, actor=actor
                )
        self.refresh_from_db()
        return True

    def reset(self, actor: str = "") -> bool:
        return self._flip(
            self.State.CLOSED, reason="operator reset", actor=actor, bump_epoch=True,
            consecutive_failures=0, open_until=None, open_seconds=0.0,
        )

    def force_open(self, actor: str = "", seconds: float = 60.0) -> bool:
        return self._flip(
            self.State.OPEN, reason=f"operator forced open for {seconds:g}s", actor=actor, bump_epoch=True,
            open_until=timezone.now() + timedelta(seconds=seconds), open_seconds=seconds,
        )

    def record(
        self, new_state: str, *, reason: str, actor: str = "request path", epoch: int, consecutive_failures: int,
        open_until: datetime | None, open_seconds: float,
    ) -> bool:
        """The request path's write-back of a transition it already made in memory (no epoch bump).

        ``epoch`` is the operator epoch the deciding breaker had adopted. The write-back is
        asynchronous, so it may arrive after an operator reset or force-open (which bump the
        epoch): it is then dropped (False) rather than undoing the operator's action.
        """
        return self._flip(
            new_state, reason=reason, actor=actor, bump_epoch=False, epoch=epoch,
            consecutive_failures=consecutive_failures, open_until=open_until, open_seconds=open_seconds,
        )


class BreakerFlip(models.Model):
    instance = models.ForeignKey(EngineInstance, models.CASCADE, related_name="breaker_flips")
    created = models.DateTimeField(auto_now_add=True)
    old_state = models.CharField(max_length=10)
    new_state = models.CharField(max_length=10)
    reason = models.CharField(max_length=500, blank=True)
    actor = models.CharField(max_length=100, blank=True)

    class Meta:
        ordering = ["-created", "-id"]


class ProbeResult(models.Model):
    """One health or version probe; pruned after ``MOTOR_PROBE_RETENTION_DAYS``."""

    instance = models.ForeignKey(
        EngineInstance, models.CASCADE, null=True, blank=True, related_name="probes",
        help_text="Empty: the render sidecar.",
    )
    kind = models.CharField(max_length=10)  # health | version
    ok = models.BooleanField()
    latency_ms = models.FloatField(null=True, blank=True)
    detail = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    created = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created", "-id"]


class AuditReport(models.Model):
    created = models.DateTimeField(auto_now_add=True)
    summary = models.JSONField(default=dict)

    class Meta:
        ordering = ["-created"]


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class ApiKey(models.Model):
    """A bearer key; only its sha256 is stored, the key itself is shown once at creation."""

    class Scope(models.TextChoices):
        CLIENT = "client", "client (/v1)"
        ADMIN = "admin", "admin (/api)"

    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=8, editable=False)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    scope = models.CharField(max_length=6, choices=Scope.choices, default=Scope.CLIENT)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True, help_text="Empty: unlimited.")
    allow_priority = models.BooleanField(
        default=False, help_text="May send a non-zero `priority` (engines schedule it ahead of others)."
    )
    revoked = models.BooleanField(default=False)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @staticmethod
    def generate(scope: str) -> str:
        return ("sk-motor-" if scope == ApiKey.Scope.CLIENT else "mk-admin-") + secrets.token_urlsafe(24)

    def set_key(self, key: str) -> None:
        self.prefix = key[:8]
        self.key_hash = hash_key(key)


class ControlVersion(models.Model):
    """One row: bumped on every change of control data; each coordinator polls it."""

    value = models.BigIntegerField(default=0)


class ManagedProcess(models.Model):
    """A process that the launcher (``make run``) supervises, as the launcher last reported it.

    Written only by the launcher through ``motorsite.launcher.records``; engines are linked to their instance
    (by URL) so the admin and the dashboard can show restarts next to health and breaker.
    """

    class State(models.TextChoices):
        # Mirrors motorsite.supervisor.ChildState, plus the launcher's own stop.
        STARTING = "starting", "starting"
        RUNNING = "running", "running"
        BACKOFF = "backoff", "restarting"
        FAILED = "failed", "crash loop"
        STOPPED = "stopped", "stopped"

    name = models.CharField(max_length=100, unique=True)
    instance = models.OneToOneField(
        EngineInstance, models.SET_NULL, null=True, blank=True, related_name="process"
    )
    state = models.CharField(max_length=10, choices=State.choices, default=State.RUNNING)
    pid = models.PositiveIntegerField(null=True, blank=True)
    restarts = models.PositiveIntegerField(default=0)
    last_exit_reason = models.CharField(max_length=500, blank=True)
    last_exit_at = models.DateTimeField(null=True, blank=True)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ("name",)

    def __str__(self) -> str:
        return self.name


def process_of(instance: EngineInstance) -> ManagedProcess | None:
    """The launcher's process of ``instance``, or None when no launcher supervises it."""
    try:
        return instance.process  # type: ignore[no-any-return]
    except ManagedProcess.DoesNotExist:
        return None


class CoordinatorReport(models.Model):
    """One coordinator process's recent engine-request buckets and tokens in flight (machine-owned).

    Written by that process (``serving.stream_reports.ReportWriter`` via ``fleet.reports``) a few
    seconds after its traffic changes, read by the fleet dashboard of any process, so every replica
    draws the same fleet. With ``REDIS_URL`` set the same reports live in Redis instead.
    """

    host = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    payload = models.JSONField(default=dict, blank=True, help_text='{"series": buckets per instance, "in_flight": tokens per instance}')
    updated = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["host", "pid"], name="coordinator_report_process")]

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}"


class CoordinatorAddress(models.Model):
    """Where one coordinator process can be reached by the others (machine-owned).

    Written by that process (``fleet.replicas``) before it hands out a Trigger callback URL and
    renewed while it does; another replica that receives one of its callbacks forwards it only
    to the ``url`` recorded here under the token's ``owner``, never to an address the token
    names. Rows not renewed for ``fleet.replicas.STALE_S`` are ignored and deleted.
    """

    owner = models.CharField(max_length=64, unique=True, help_text="The process's metaserver id, fresh per start.")
    url = models.CharField(max_length=300, help_text="MOTOR_METASERVER_OWNER_URL of that process.")
    host = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    seen = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.owner} at {self.url}"
