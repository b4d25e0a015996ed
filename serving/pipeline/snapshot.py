"""The immutable view of control data the data plane reads instead of the database.

Built from the database by ``serving.snapshots`` and swapped whole when control data changes,
so a request sees one consistent fleet from start to end and the hot path makes no queries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True, slots=True)
class ScorerWeights:
    """How much each placement scorer counts for one model (``placement/scorers.py``), >= 0 each.

    The defaults place as the fixed ranking did before scorers had weights: the prefix holder
    within the load margin, else the least loaded. ``ServedModel``'s ``*_weight`` fields in the
    database; an operator edits them in the admin or with ``PATCH /api/models/{name}``.
    """

    prefix: float = 1.0  # KV-cache prefix affinity: the share of the prompt's blocks an engine holds
    queue: float = 0.0  # requests in flight per instance weight, least scores 1
    tokens: float = 0.0  # admitted tokens in flight per token capacity, least scores 1

    @property
    def weighs_load(self) -> bool:
        return self.queue > 0 or self.tokens > 0

    def by_name(self) -> dict[str, float]:
        return {"prefix": self.prefix, "queue": self.queue, "tokens": self.tokens}


DEFAULT_SCORER_WEIGHTS = ScorerWeights()


@dataclass(frozen=True, slots=True)
class ModelView:
    name: str
    model_path: str
    max_model_len: int
    # Rows of the model's embedding (config.json ``vocab_size``), from the control plane; None
    # while unknown, and then the token-only path refuses traffic (request_checks.require_vocab).
    vocab_size: int | None = None
    # The parsers the render sidecar runs for this model (its active revision's
    # ``reasoning_parser`` and ``tool_parser``; empty: none). The local fallback has no vLLM
    # parser, so with either set it refuses chats rather than answer them differently.
    reasoning_parser: str = ""
    tool_parser: str = ""
    state: str = "active"  # active | draining | retired (ServedModel.State)
    scorer_weights: ScorerWeights = DEFAULT_SCORER_WEIGHTS  # how placement weighs its scorers
    # A LoRA adapter's base model (its render config, tokenizer and engines); "" for a model.
    # An adapter's view carries its base's path, vocabulary and parsers: it is rendered as the base.
    base: str = ""

    @property
    def serves_requests(self) -> bool:
        return self.state == "active"


@dataclass(frozen=True, slots=True)
class RenderMember:
    """One sidecar of a model's render pool, with what its probe found it can do.

    The flags are the RFC's version floors applied to the version the probe recorded
    (``catalog.render_versions``); a member not probed yet is taken at the deployment's word.
    ``healthy`` False (its probes fail) ranks it after every healthy member.
    """

    base_url: str
    version: str = ""
    token_in: bool = True
    derender: bool = True
    streaming_derender: bool = True
    healthy: bool = True
    # The API kinds its probe found render and derender routes for (its OpenAPI document): a call
    # of another kind goes to another member. None: not probed, every route taken as served.
    render_routes: frozenset[str] | None = None
    derender_routes: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class RenderView:
    enable: bool
    # The first member's address (what code written for one sidecar reads); ``members`` is the pool.
    base_url: str
    timeout_s: float  # per render/derender call and per streaming derender chunk
    context_budget: bool = False  # clamp max_tokens to the chosen engine's room left
    obfuscation: bool = False
    obfuscation_key_id: str = ""  # which key; the key itself never enters the snapshot
    # The RFC's version floors, from the probe's record of the sidecar's vLLM version
    # (``catalog.render_versions.probed_capabilities``): below 0.23 no render of token ids, below 0.24 no
    # derender, below 0.27 no streaming derender. What a floor removes takes the native path.
    token_in: bool = True
    derender: bool = True
    streaming_derender: bool = True
    # Merge engine chunks queued behind a streaming derender (derender/coalesce.py). On in the
    # database (RenderConfig); off for hand-built snapshots, whose tests count one call per event.
    derender_coalesce: bool = False
    # Tokens a streamed chunk waits for after a choice's first (vLLM's --stream-interval); 1: none.
    stream_interval: int = 1
    # Milliseconds a choice's derender calls are at least apart after its first (coalesce.py); 0: none.
    stream_interval_ms: int = 0
    # Plain streams derendered in the coordinator (derender/local_stream.py); off: every chunk a sidecar call.
    local_stream_detokenize: bool = False
    # The render pool (render/pool.py picks a member per call). Empty: one sidecar at ``base_url``
    # with the flags above. Built from the database, the flags above say what *some* member can
    # do (what the path choice reads); each member says what it can.
    members: tuple[RenderMember, ...] = ()


@dataclass(frozen=True, slots=True)
class ClientKeyView:
    name: str
    tokens_per_minute: int | None = None  # None: unlimited
    allow_priority: bool = False  # may send a non-zero ``priority`` (ApiKey.allow_priority)


@dataclass(frozen=True, slots=True)
class InstanceView:
    id: int
    name: str
    url: str
    role: str  # union | prefill | decode
    model: str
    weight: int
    token_capacity: int
    max_model_len: int
    # What placement may use of the engine: the operator's record less what its capability
    # probe found missing (fleet.engine_capabilities.engine_flags): token_generate needs the
    # 0.23 Token-In floor and /inference/v1/generate, native_openai and tokenizer a loaded tokenizer.
    token_generate: bool
    native_openai: bool
    tokenizer: bool
    state: str  # active | draining | quarantined | disabled
    kind: str = "vllm"  # vllm | sim
    hardware: str = "cpu"
    # The connector the engine's --kv-transfer-config names, which fixes the wire contract of its
    # kv_transfer_params: "" (none), NixlConnector, MooncakeConnector (upstream vLLM's: the router
    # supplies both legs' params), MooncakeConnectorV1 (vllm-ascend's pull: P returns D's params),
    # MooncakeLayerwiseConnector, ... (``serving.snapshots`` resolves the Ascend names).
    kv_connector: str = ""
    kv_transfer: str = ""  # "pull" (Handoff), "push" (Trigger, layer-wise) or "" (no KV transfer)
    kv_events_endpoint: str = ""  # ZMQ endpoint of the engine's KV cache events, "" if none
    # Base of the connector's ports on the engine's host (upstream Mooncake: its bootstrap server's
    # port, VLLM_MOONCAKE_BOOTSTRAP_PORT); None when the record has none.
    kv_port: int | None = None
    tp: int = 1
    healthy: bool = True  # the probes' verdict; False keeps traffic away like an open breaker
    breaker_state: str = "closed"  # closed | open | half_open, as last written to the database
    breaker_epoch: int = 0  # bumped by operator actions (reset, force open) the request path must adopt
    obfuscation_key_id: str = ""  # key the engine's weights are permuted with, "" for plain weights
    # The LoRA adapters the engine has loaded, by name (its /v1/models cards with a parent, as the
    # LoRA probe recorded them): it serves each of those models too.
    lora_adapters: frozenset[str] = frozenset()
    # The request kinds whose own OpenAI route the probe found in the engine's OpenAPI document
    # (chat, completions, messages, responses); None: not probed, every route taken as served.
    native_routes: frozenset[str] | None = None

    @property
    def takes_new_requests(self) -> bool:
        return self.state == "active"

    def serves(self, model: str) -> bool:
        """Whether a request for ``model`` may run here: the engine's own model, or an adapter it holds."""
        return self.model == model or model in self.lora_adapters

    def serves_native(self, kind: str | None = None) -> bool:
        """Whether the engine serves its own OpenAI API (for request kind ``kind``, when given)."""
        return self.native_openai and (kind is None or self.native_routes is None or kind in self.native_routes)


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    version: int
    models: Mapping[str, ModelView]
    # The render config of the first model (of every model in a hand-built snapshot without
    # ``renders``); a request's pipeline reads its own model's, from ``for_model``.
    render: RenderView
    instances: tuple[InstanceView, ...] = field(default_factory=tuple)
    # Each served model's render config by model name; a model missing here uses ``render``.
    renders: Mapping[str, RenderView] = field(default_factory=dict)
    # Active client keys for /v1 by sha256 hex of the key. ``client_keys_managed`` is True once any
    # client key record exists (even revoked): from then on only these keys open /v1.
    client_keys: Mapping[str, ClientKeyView] = field(default_factory=dict)
    client_keys_managed: bool = False
    # Active admin keys (/api) by sha256 hex: the front door refuses a body without one unread.
    admin_keys: frozenset[str] = frozenset()

    def render_of(self, model: str) -> RenderView:
        found = self.models.get(model)
        # A LoRA adapter is rendered and derendered by its base model's sidecars.
        return self.renders.get(found.base if found is not None and found.base else model, self.render)

    def for_model(self, model: str) -> FleetSnapshot:
        """The fleet as one model's request sees it: that model, its render config and only its
        instances, so nothing on its path (render, placement, generate, derender) can reach
        another model's tiers. For a LoRA adapter: its base's render config and only the base's
        engines that hold the adapter. Same version: it is a view of this snapshot, not a new one."""
        return FleetSnapshot(
            version=self.version,
            models={model: self.models[model]} if model in self.models else {},
            render=self.render_of(model),
            instances=tuple(i for i in self.instances if i.serves(model)),
            renders={},
            client_keys=self.client_keys,
            client_keys_managed=self.client_keys_managed,
            admin_keys=self.admin_keys,
        )
