"""Builds the data plane's ``FleetSnapshot`` from the database and keeps it fresh.

Requests never query the database per request: they read the current snapshot. At most once
per ``MOTOR_SNAPSHOT_POLL_S`` one request reads ``fleet.ControlVersion`` (one tiny query, in a
worker thread) and, if the version moved, rebuilds the snapshot; every service that changes
control data bumps that version, so an admin or API edit reaches every coordinator process
within one poll interval. Requests arriving while that check runs use the snapshot they have.
A full rebuild also happens every ``MOTOR_SNAPSHOT_TTL_S`` as a safety net for rows written
without a bump (fixtures, manual SQL).

A database error during that check keeps the current snapshot serving: the outage is logged
once (and its end once), and the check is tried again one poll interval later. Only a process
that never had a snapshot answers ``ControlDataUnavailable`` (503) until the database is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import Error as DatabaseError

from catalog.fingerprints import config_vocab_size
from catalog.models import Health, RenderConfig, ServedModel
from catalog.render_versions import probed_capabilities
from fleet.ascend import ASCEND_CONNECTORS, ASCEND_GENERATIONS
from fleet.engine_capabilities import engine_flags
from fleet.models import ApiKey, BreakerState, EngineInstance
from motorsite.core import current_render_config, read_control_version, render_configs_by_model
from serving import obfuscation_keys
from serving.pipeline.errors import ControlDataUnavailable
from serving.pipeline.snapshot import (
    ClientKeyView,
    FleetSnapshot,
    InstanceView,
    ModelView,
    RenderMember,
    RenderView,
    ScorerWeights,
)

# The clock the freshness checks use; tests replace it to drive time without sleeping.
clock: Callable[[], float] = time.monotonic

_current: FleetSnapshot | None = None
_built_at = 0.0
_checked_at = 0.0
_checking: asyncio.Future[None] | None = None
# Whether the last check failed on the database: one warning per outage, not one per poll.
_db_down = False

logger = logging.getLogger(__name__)


def build_snapshot(version: int | None = None) -> FleetSnapshot:
    if version is None:
        version = read_control_version()
    every = list(ServedModel.objects.select_related("active_revision", "base__active_revision").order_by("id"))
    models = {m.name: _model_view(m) for m in every}
    # LoRA adapters have no render config: they are rendered by their base's (FleetSnapshot.render_of).
    rows = [m for m in every if m.base is None]
    configs = render_configs_by_model(rows)
    renders: dict[str, RenderView] = {}
    for m in rows:
        cfg = configs[m.id]
        if cfg is None:
            renders[m.name] = NO_RENDER  # no sidecar of its own: never another model's
            continue
        # The key stays out of the snapshot; its mapping is registered with the data plane by key id.
        obfuscation_keys.load_for(cfg, [models[m.name]])
        renders[m.name] = render_view(cfg)
    # The first model's (or the defaults without any): what code reading one render view sees.
    render = next(iter(renders.values()), None) or render_view(current_render_config() or RenderConfig())
    instances = tuple(_instance_view(i) for i in EngineInstance.objects.select_related("served_model", "breaker"))
    keys = list(ApiKey.objects.filter(scope=ApiKey.Scope.CLIENT).values_list(
        "key_hash", "name", "tokens_per_minute", "allow_priority", "revoked",
    ))
    client_keys = {h: ClientKeyView(name, tpm, prio) for h, name, tpm, prio, revoked in keys if not revoked}
    admin_keys = frozenset(ApiKey.objects.filter(scope=ApiKey.Scope.ADMIN, revoked=False).values_list("key_hash", flat=True))
    return FleetSnapshot(
        version=version, models=models, render=render, renders=renders, instances=instances,
        client_keys=client_keys, client_keys_managed=bool(keys), admin_keys=admin_keys,
    )


def _model_view(m: ServedModel) -> ModelView:
    # A LoRA adapter is rendered as its base: the base's tokenizer files (the local fallback),
    # vocabulary, context length and parsers; its own name, state and base.
    of = m.base or m
    return ModelView(
        m.name, of.model_path, of.max_model_len, of.vocab_size or config_vocab_size(of.model_path),
        reasoning_parser=of.active_revision.reasoning_parser if of.active_revision else "",
        tool_parser=of.active_revision.tool_parser if of.active_revision else "",
        state=_adapter_state(m),
        scorer_weights=ScorerWeights(prefix=m.prefix_weight, queue=m.queue_weight, tokens=m.tokens_weight),
        base=m.base.name if m.base else "",
    )


_STATE_ORDER = (ServedModel.State.ACTIVE, ServedModel.State.DRAINING, ServedModel.State.RETIRED)


def _adapter_state(m: ServedModel) -> str:
    # An adapter is served no longer than its base: draining or retiring the base takes its
    # adapters with it (their engines and sidecars are the base's), whatever their own state.
    if m.base is None:
        return str(m.state)
    return str(max(m.state, m.base.state, key=_STATE_ORDER.index))


# A model whose render config rows all belong to other models: native path on its own engines.
NO_RENDER = RenderView(enable=False, base_url="", timeout_s=5.0)


def render_view(cfg: RenderConfig) -> RenderView:
    """The data plane's view of one model's render config and its pool."""
    members = render_members(cfg)
    return RenderView(
        enable=cfg.enable,
        base_url=members[0].base_url,
        timeout_s=cfg.timeout_ms / 1000,
        context_budget=cfg.context_budget,
        obfuscation=cfg.obfuscation,
        obfuscation_key_id=cfg.obfuscation_key_id,
        # The path choice reads what some member can do; the pool picks a member that can.
        token_in=any(m.token_in for m in members),
        derender=any(m.derender for m in members),
        streaming_derender=cfg.streaming_derender and any(m.streaming_derender for m in members),
        derender_coalesce=cfg.derender_coalesce,
        stream_interval=cfg.stream_interval,
        stream_interval_ms=cfg.stream_interval_ms,
        local_stream_detokenize=cfg.local_stream_detokenize,
        members=members,
    )


def render_members(cfg: RenderConfig) -> tuple[RenderMember, ...]:
    """The config's pool as the data plane sees it: each member's version floors (what its probe
    recorded; nothing recorded yet: the deployment's word) and health. A config without member
    rows (not saved yet, or every member removed) is one sidecar at its own host and port."""
    rows = list(cfg.sidecars.all()) if cfg.pk else []
    if not rows:
        caps = probed_capabilities(cfg.sidecar_version)
        return (RenderMember(cfg.base_url, cfg.sidecar_version, caps.token_in, caps.derender, caps.streaming_derender,
                             healthy=cfg.health != Health.FAILING),)
    members = []
    for row in rows:
        caps = probed_capabilities(row.sidecar_version)
        # The probe's record of the routes it serves can only take away what the version gives.
        found = row.capabilities or {}
        members.append(RenderMember(
            row.base_url, row.sidecar_version, caps.token_in and found.get("token_in", True) is not False,
            caps.derender and found.get("derender", True) is not False,
            caps.streaming_derender and found.get("streaming_derender", True) is not False,
            healthy=row.health != Health.FAILING,
            render_routes=_routes(found, "render"), derender_routes=_routes(found, "derender"),
        ))
    return tuple(members)


def _routes(capabilities: dict[str, Any], which: str) -> frozenset[str] | None:
    """The API kinds a member's probe found ``which`` routes for; None when it found no route list."""
    routes = capabilities.get("routes")
    if not isinstance(routes, dict) or not isinstance(routes.get(which), list):
        return None
    return frozenset(str(k) for k in routes[which])


def wire_connector(kv_connector: str, hardware: str) -> str:
    """The connector name an engine's ``--kv-transfer-config`` carries, which is what its
    ``kv_transfer_params`` follow. The record's "MooncakeConnector" means Mooncake pull: on an
    Ascend generation motorsite launches it as vllm-ascend's ``MooncakeConnectorV1``
    (``fleet.ascend``: P returns D's params), elsewhere it is upstream vLLM's ``MooncakeConnector``
    (the router supplies both legs' params); docs/ascend-connectors.md has the naming trap."""
    if hardware in ASCEND_GENERATIONS:
        return ASCEND_CONNECTORS.get(kv_connector, kv_connector)
    return kv_connector


def _instance_view(i: EngineInstance) -> InstanceView:
    try:
        breaker: BreakerState | None = i.breaker
    except BreakerState.DoesNotExist:
        breaker = None
    flags = engine_flags(
        i.capabilities, token_generate=i.cap_token_generate, native_openai=i.cap_native_openai, tokenizer=i.cap_tokenizer,
    )
    return InstanceView(
        id=i.id,
        name=i.name,
        url=i.url.rstrip("/"),
        role=i.role,
        model=i.served_model.name,
        weight=i.weight,
        token_capacity=i.token_capacity,
        max_model_len=i.max_model_len or i.served_model.max_model_len,
        token_generate=flags.token_generate,
        native_openai=flags.native_openai,
        tokenizer=flags.tokenizer,
        native_routes=flags.native_routes,
        state=i.state,
        kind=i.kind,
        hardware=i.hardware_kind,
        kv_connector=wire_connector(i.kv_connector, i.hardware_kind),
        kv_port=i.kv_port,
        kv_transfer=i.kv_transfer,
        kv_events_endpoint=i.kv_events_endpoint,
        tp=i.tp,
        # Unknown counts as healthy: a fresh fleet must take traffic before its first probe.
        healthy=i.health != Health.FAILING,
        breaker_state=breaker.state if breaker else "closed",
        breaker_epoch=breaker.epoch if breaker else 0,
        obfuscation_key_id=i.obfuscation_key_id,
        lora_adapters=frozenset(str(name) for name in i.lora_adapters or ()),
    )


def fresh_snapshot() -> FleetSnapshot | None:
    """The snapshot ``current_snapshot`` would return now without a query, or None when it would
    check the database first (for callers that cannot await: Daphne's request hook)."""
    if _current is not None and clock() - _checked_at < settings.MOTOR_SNAPSHOT_POLL_S:
        return _current
    return None


async def current_snapshot() -> FleetSnapshot:
    """The snapshot to serve a request with; makes no query unless a poll interval has passed."""
    global _current, _built_at, _checked_at, _checking, _db_down
    now = clock()
    if _current is not None:
        if now - _checked_at < settings.MOTOR_SNAPSHOT_POLL_S:
            return _current
        if _checking is not None and not _checking.done():
            return _current  # another request is checking; one poll interval of staleness at most
    loop = asyncio.get_running_loop()
    _checking = mine = loop.create_future()
    try:
        stale = _current is None or now - _built_at >= settings.MOTOR_SNAPSHOT_TTL_S
        try:
            version = await sync_to_async(read_control_version, thread_sensitive=False)()
            if stale or _current is None or version != _current.version:
                _current = await sync_to_async(build_snapshot, thread_sensitive=False)(version)
                _built_at = now
        except DatabaseError as exc:
            # django.db.Error: OperationalError (server gone, "database is locked"), InterfaceError
            # (connection closed) and the rest. The last snapshot is still a consistent view of
            # the fleet; serving it beats refusing every request while the database is away.
            if not _db_down:
                logger.warning("snapshot poll failed, serving the last snapshot version=%s: %r",
                               _current.version if _current is not None else None, exc)
            _db_down = True
            if _current is None:
                raise ControlDataUnavailable(f"no snapshot yet and the database failed: {exc!r}") from exc
            _checked_at = now  # retry one poll interval later, not on every request meanwhile
            return _current
        if _db_down:
            logger.warning("snapshot poll recovered version=%s", _current.version)
            _db_down = False
        _checked_at = now
        return _current
    finally:
        mine.set_result(None)
        if _checking is mine:
            _checking = None


def invalidate() -> None:
    """Forget the cached snapshot (tests, and commands that just changed the fleet)."""
    global _current, _checked_at, _built_at, _checking, _db_down
    _current = None
    _checked_at = _built_at = 0.0
    _checking = None
    _db_down = False
