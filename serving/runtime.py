"""The data plane's composition root: ``build()`` wires the process-wide objects explicitly.

The shared HTTP client's settings, the scheduler with its circuit breakers, token admission and
KV affinity, PD Hybrid (``hybrid.install``), the topology registry, live load counters and the
router's counters: one of each per coordinator process, built once at import (``RUNTIME``) and
handed to every request's pipeline by ``pipeline_for``. Nothing here probes for modules or
relies on another module registering itself.

``MOTOR_GLOBAL_TOKEN_BUDGET`` (tokens in flight across all instances), ``MOTOR_ADMISSION_QUEUE`` (waiters), ``MOTOR_ADMISSION_WAIT_MS`` (their deadline)
and the breaker knobs are read from settings when present, else from the environment. With
``REDIS_URL`` set, every coordinator process shares token admission (Redis leases), the
tokens-per-minute windows (``RedisTokenRateLimiter``, installed as ``rate_limit.LIMITER``) and the
circuit breakers (``SharedBreakerBoard``) through one Redis client, each call bounded by
``MOTOR_REDIS_TIMEOUT_MS``; without it each process keeps its own.

KV-cache affinity: one ``KVAffinityIndex`` per process feeds placement
(``MOTOR_AFFINITY_LOAD_MARGIN_TOKENS`` bounds how much busier than the least loaded instance a
prefix holder may be). Instances with a ``kv_events_endpoint`` are indexed from their KV cache
events (precise mode): ``pipeline_for`` syncs a ``KVEventHub`` with the snapshot's endpoints
whenever the snapshot version changes, started lazily on the running loop (one hub per loop, as
the shared HTTP client); ``aclose_kv_events`` stops it. The others are indexed from placement
decisions (approximate mode).

Render sidecar use: ``sidecar_holds`` counts the requests that may still call each sidecar, and
``render_report_writer`` writes those counts to the database when they change (``serving.stream_reports``),
so the launcher retires a replaced sidecar only once nothing uses it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from fleet.replicas import ReplicaDirectory
from serving import stream_reports
from serving.pipeline import http, metrics, tracing
from serving.pipeline.derender.session import StreamSettings
from serving.pipeline.engine.client import EngineClient, ReplyDeadline
from serving.pipeline.flow_control import rate_limit
from serving.pipeline.flow_control.admission import AdmissionSettings, TokenAdmission
from serving.pipeline.flow_control.redis_admission import RedisTokenAdmission
from serving.pipeline.metrics import RouterCounters
from serving.pipeline.obfuscation import keyring as obfuscation
from serving.pipeline.obfuscation.boundary import EngineBoundary
from serving.pipeline.obfuscation.mapping import TokenMapping
from serving.pipeline.phases import Histograms
from serving.pipeline.placement.kv_affinity import KVAffinityIndex
from serving.pipeline.placement.kv_events import KVEventHub
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import DEFAULT_AFFINITY_LOAD_MARGIN_TOKENS, Scheduler
from serving.pipeline.render.adapter_names import AdapterRenderPool
from serving.pipeline.render.pool import PoolState, RenderPool
from serving.pipeline.render.sidecar_holds import SidecarHolds
from serving.pipeline.render.tokenization import RenderHealth
from serving.pipeline.request_checks import RequestLimits
from serving.pipeline.resilience.breaker import BreakerBoard
from serving.pipeline.resilience.shared_breaker import SharedBreakerBoard
from serving.pipeline.service import ServingPipeline
from serving.pipeline.snapshot import FleetSnapshot, ModelView, RenderView
from serving.pipeline.topologies import hybrid
from serving.pipeline.topologies.metaserver import process_metaserver
from serving.pipeline.topologies.registry import TopologyRegistry

logger = logging.getLogger(__name__)

http.configure(
    http.HttpSettings(
        connect_timeout_s=settings.MOTOR_CONNECT_TIMEOUT_S,
        read_timeout_s=settings.MOTOR_ENGINE_READ_TIMEOUT_S,
        idle_per_upstream=settings.MOTOR_UPSTREAM_IDLE_CONNECTIONS,
        max_reply_bytes=settings.MOTOR_UPSTREAM_MAX_REPLY_BYTES,
    )
)


def _knob(name: str, default: float | None) -> float | None:
    value = getattr(settings, name, None)
    if value is None:
        raw = os.environ.get(name)
        value = float(raw) if raw not in (None, "") else default
    return value


def _admission_settings() -> AdmissionSettings:
    budget = _knob("MOTOR_GLOBAL_TOKEN_BUDGET", None)
    return AdmissionSettings(
        global_budget=int(budget) if budget else None,
        queue_size=int(_knob("MOTOR_ADMISSION_QUEUE", 256) or 256),
        wait_s=float(_knob("MOTOR_ADMISSION_WAIT_MS", 30000) or 30000) / 1000,  # bounds a request's wait for room
    )


def _redis() -> Any | None:
    """The process's Redis client for shared live state, or None without ``REDIS_URL``."""
    redis_url = getattr(settings, "REDIS_URL", "") or ""
    if not redis_url:
        return None
    import redis.asyncio

    # Bounds how long one admission, limit or breaker call waits for an unresponsive Redis before
    # the request gets 503 with Retry-After (admission, limit) or the breaker falls back to local.
    timeout_s = float(_knob("MOTOR_REDIS_TIMEOUT_MS", 2000) or 2000) / 1000
    return redis.asyncio.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


def _admission(redis: Any | None) -> TokenAdmission:
    if redis is not None:
        return RedisTokenAdmission(redis, _admission_settings())
    return TokenAdmission(_admission_settings())


def _rate_limiter(redis: Any | None) -> rate_limit.TokenRateLimiter:
    return rate_limit.RedisTokenRateLimiter(redis) if redis is not None else rate_limit.TokenRateLimiter()


def _breakers(redis: Any | None) -> BreakerBoard:
    knobs: dict[str, Any] = {
        "threshold": int(_knob("MOTOR_BREAKER_THRESHOLD", 3) or 3),
        "base_open_s": float(_knob("MOTOR_BREAKER_OPEN_S", 5.0) or 5.0),
        "max_open_s": float(_knob("MOTOR_BREAKER_MAX_OPEN_S", 120.0) or 120.0),
        "sink": submit_breaker_transition,
    }
    return SharedBreakerBoard(redis, **knobs) if redis is not None else BreakerBoard(**knobs)


def submit_breaker_transition(
    instance_id: int, new_state: str, reason: str, consecutive_failures: int,
    open_until: float | None, open_seconds: float, epoch: int,
) -> None:
    """The breakers' sink: hand a request-path transition to the control plane's write-back."""
    # Imported here: fleet's models load after this module (it is imported while URLs load).
    from fleet import writeback

    writeback.submit_breaker_transition(
        instance_id, new_state, reason, consecutive_failures, open_until, open_seconds, epoch=epoch
    )


def engine_ids(snapshot: FleetSnapshot, prompt_ids: Sequence[int]) -> Sequence[int]:
    """The ids the engines see: physical under the snapshot's obfuscation mapping, else as given."""
    mapping = obfuscation_mapping(snapshot)
    return mapping.to_physical(prompt_ids) if mapping is not None else prompt_ids


@dataclass(frozen=True)
class Runtime:
    """The process's data-plane objects, built once by ``build`` and shared by every request."""

    load: LoadTracker
    breakers: BreakerBoard
    admission: TokenAdmission
    rate_limiter: rate_limit.TokenRateLimiter
    affinity: KVAffinityIndex
    scheduler: Scheduler
    topologies: TopologyRegistry
    counters: RouterCounters
    # Where each /v1 request's time went, phase by phase (``/metrics``; the edge and the pipeline record).
    phases: Histograms
    # The render-down cooldown, one per sidecar base URL: a sidecar found down is skipped for a
    # few seconds by every request of the process, but its replacement (a graceful restart moves
    # the snapshot to a new URL) is tried at once.
    render_health: dict[str, RenderHealth]
    # Each render pool member's outstanding calls in this process (the pool's pick), and the
    # same render-down memory as ``render_health`` (one dict): members outlive snapshots.
    render_pool: PoolState
    # Requests per render sidecar, reported to the database for the launcher's graceful restart.
    sidecar_holds: SidecarHolds
    render_report_writer: stream_reports.ReportWriter
    # This process's engine-request buckets and tokens in flight, reported for the fleet dashboard.
    dashboard_reporter: stream_reports.ReportWriter
    # OpenTelemetry spans of each request's phases (MOTOR_TRACING); None: off, nothing imported.
    tracer: tracing.PhaseTracer | None = None


def build() -> Runtime:
    """The composition root: every process-wide data-plane object, wired explicitly.

    PD Hybrid is on in the scheduler (``hybrid.install``; a fleet without P/D instances is
    unaffected) and weighs prefix hits from the same KV affinity index placement uses.
    """
    load = LoadTracker()
    redis = _redis()
    breakers = _breakers(redis)
    admission = _admission(redis)
    rate_limiter = _rate_limiter(redis)
    rate_limit.install(rate_limiter)  # the views bind keys to it; the pipeline charges it
    affinity = KVAffinityIndex()
    scheduler = Scheduler(
        load, breakers=breakers, admission=admission, affinity=affinity, engine_ids=engine_ids,
        load_margin_tokens=int(_knob("MOTOR_AFFINITY_LOAD_MARGIN_TOKENS", DEFAULT_AFFINITY_LOAD_MARGIN_TOKENS) or 0),
    )
    hybrid.install(scheduler)
    # Trigger callbacks that land on another replica are routed by the control plane's record of
    # each process's address, never by an address in the callback's URL.
    process_metaserver().directory = ReplicaDirectory()
    render_health: dict[str, RenderHealth] = {}
    sidecar_holds = SidecarHolds()
    render_report_writer = stream_reports.ReportWriter(sidecar_holds.counts)
    sidecar_holds.on_change = render_report_writer.notify
    counters = RouterCounters()
    dashboard_reporter = stream_reports.dashboard_reporter(
        stream_reports.dashboard_payload(metrics.REGISTRY.export, admission.inflight_tokens, counters.route_decisions)
    )
    # The registry is the process's (the request path records into the module's REGISTRY).
    metrics.REGISTRY.on_record = dashboard_reporter.notify
    counters.on_inc = dashboard_reporter.notify
    return Runtime(
        load=load, breakers=breakers, admission=admission, rate_limiter=rate_limiter, affinity=affinity,
        scheduler=scheduler, topologies=TopologyRegistry(), counters=counters, phases=Histograms(),
        render_health=render_health, render_pool=PoolState(health=render_health),
        sidecar_holds=sidecar_holds, render_report_writer=render_report_writer, dashboard_reporter=dashboard_reporter,
        tracer=tracing.configure(replica=settings.MOTOR_REPLICA) if settings.MOTOR_TRACING else None,
    )


RUNTIME = build()
# The process's objects by name, for the views, the dashboard and tests.
load = RUNTIME.load
breakers = RUNTIME.breakers
admission = RUNTIME.admission
affinity = RUNTIME.affinity
scheduler = RUNTIME.scheduler
counters = RUNTIME.counters
phase_histograms = RUNTIME.phases
tracer = RUNTIME.tracer
sidecar_holds = RUNTIME.sidecar_holds
render_report_writer = RUNTIME.render_report_writer
dashboard_reporter = RUNTIME.dashboard_reporter


@dataclass
class _KVEvents:
    hub: KVEventHub
    version: int | None = None  # the snapshot version last synced
    names: frozenset[str] = frozenset()  # its instances


# One hub per event loop: its subscribers are tasks of that loop (Daphne runs one per process).
_kv_events: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _KVEvents]" = weakref.WeakKeyDictionary()


def kv_event_hub() -> KVEventHub | None:
    """The running loop's hub, if one was started."""
    try:
        state = _kv_events.get(asyncio.get_running_loop())
    except RuntimeError:
        return None
    return state.hub if state is not None else None


def sync_kv_events(snapshot: FleetSnapshot) -> None:
    """Subscribe to the KV events of the snapshot's instances that publish them (precise mode).

    Cheap when the version is unchanged; outside a running loop it does nothing (the first
    request on a loop starts the hub). ``KVEventHub.sync`` restarts moved endpoints and stops
    (and forgets) removed ones; instances gone from the fleet are forgotten in approximate mode
    too, so a new engine reusing a name inherits no guessed blocks.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    state = _kv_events.get(loop)
    if state is None:
        state = _kv_events[loop] = _KVEvents(KVEventHub(affinity))
    if state.version != snapshot.version:
        # Only instances that may take this deployment's traffic (their obfuscation key fits).
        state.hub.sync({
            i.name: i.kv_events_endpoint for i in snapshot.instances
            if i.kv_events_endpoint and obfuscation.eligible(i, snapshot.render_of(i.model))[0]
        })
        names = frozenset(i.name for i in snapshot.instances)
        for gone in state.names - names:
            affinity.forget(gone)
        state.version, state.names = snapshot.version, names


async def aclose_kv_events() -> None:
    """Stop the running loop's KV event subscribers (tests; a process exit closes them anyway)."""
    state = _kv_events.pop(asyncio.get_running_loop(), None)
    if state is not None:
        await state.hub.aclose()


def inflight_tokens() -> dict[str, int]:
    """Tokens held by admitted requests of this process, per instance name (metrics, dashboard)."""
    return admission.inflight_tokens()


def obfuscation_mapping(snapshot: FleetSnapshot) -> TokenMapping | None:
    """The token mapping for the snapshot's obfuscation key (None when obfuscation is off).

    Raises ``ObfuscationKeyError`` when obfuscation is on and the key is missing or not the
    render config's (``require_mapping``: traffic is refused, fail closed).
    """
    if not snapshot.render.obfuscation:
        return None
    return obfuscation.require_mapping(snapshot.render, obfuscation.mapping_for(snapshot))


# The render pools made for recent views (a view and the client it was made with, by the view's
# id): a pool holds no per-request state, so requests of one snapshot share one. Bounded: old
# snapshots' pools are dropped, and a pipeline still using one keeps it alive itself.
_render_pools: dict[tuple[int, str], tuple[RenderView, Any, RenderPool]] = {}
_RENDER_POOLS_KEPT = 16


def render_pool_for(view: RenderView, model: ModelView | None = None) -> RenderPool:
    """The pool of ``view`` (a snapshot's render view) on this loop's shared client; for a LoRA
    adapter's ``model``, its base's pool calling the sidecars under the base's name."""
    client = http.shared_client()
    adapter = model.name if model is not None and model.base else ""
    found = _render_pools.get((id(view), adapter))
    if found is not None and found[0] is view and found[1] is client:
        return found[2]
    if len(_render_pools) >= _RENDER_POOLS_KEPT:
        _render_pools.clear()
    if model is not None and adapter:
        pool: RenderPool = AdapterRenderPool(client, view, RUNTIME.render_pool, adapter=adapter, base=model.base)
    else:
        pool = RenderPool(client, view, RUNTIME.render_pool)
    _render_pools[id(view), adapter] = (view, client, pool)
    return pool


# The per-model views of the current snapshot (``FleetSnapshot.for_model``), made once per
# snapshot and model, so a request's path builds nothing and filters nothing per request.
_views_of: FleetSnapshot | None = None
_views: dict[str, FleetSnapshot] = {}


def model_snapshot(snapshot: FleetSnapshot, model: str) -> FleetSnapshot:
    """``snapshot`` as a request for ``model`` sees it (cached until the snapshot changes)."""
    global _views_of, _views
    if _views_of is not snapshot:
        _views_of, _views = snapshot, {}
    view = _views.get(model)
    if view is None:
        view = _views[model] = snapshot.for_model(model)
    return view


# The pipelines made for recent views: a pipeline holds no per-request state, so the requests of
# one snapshot version share one instead of building nine small objects each. The key is every
# object and setting a pipeline is built from, by identity (tests override settings and swap the
# process's objects); the value keeps those objects alive, so an id is never reused while cached.
_pipelines: dict[tuple[object, ...], tuple[tuple[object, ...], ServingPipeline]] = {}
_PIPELINES_KEPT = 32


def _pipeline_settings() -> tuple[object, ...]:
    return (
        settings.MOTOR_ENGINE_READ_TIMEOUT_S, settings.MOTOR_ENGINE_REPLY_S_PER_TOKEN,
        settings.MOTOR_STREAM_CHUNK_TIMEOUT_S, settings.MOTOR_STREAM_MAX_RELAYS, settings.MOTOR_DERENDER_CHUNK_RETRIES,
        settings.MOTOR_MAX_CHOICES, settings.MOTOR_MAX_PROMPTS,
    )


def pipeline_for(snapshot: FleetSnapshot, model: str | None = None) -> ServingPipeline:
    """The pipeline for a request; with ``model``, over that model's view of the fleet only.

    Cached per view and what it is built from (``_pipelines``)."""
    # KV events from the whole fleet, not one model's view (which would unsubscribe the others).
    sync_kv_events(snapshot)
    if model is not None:
        snapshot = model_snapshot(snapshot, model)
    client = http.shared_client()
    # The render pool of the snapshot's view: each call picks its member (render/pool.py).
    render = render_pool_for(snapshot.render, snapshot.models.get(model) if model is not None else None)
    mapping = obfuscation_mapping(snapshot)
    parts = (snapshot, client, render, mapping, scheduler, counters, sidecar_holds, RUNTIME.topologies)
    config = _pipeline_settings()
    key = (*map(id, parts), *config)
    cached = _pipelines.get(key)
    if cached is not None and all(a is b for a, b in zip(cached[0], parts, strict=True)):
        return cached[1]
    pipeline = _build_pipeline(snapshot, client, render, mapping)
    if len(_pipelines) >= _PIPELINES_KEPT:
        del _pipelines[next(iter(_pipelines))]  # the oldest: an old snapshot's
    _pipelines[key] = (parts, pipeline)
    return pipeline


def _build_pipeline(snapshot: FleetSnapshot, client: Any, render: RenderPool, mapping: TokenMapping | None) -> ServingPipeline:
    boundary = EngineBoundary(mapping)
    # Placement keeps instances whose declared key id does not fit the render config out of
    # traffic itself (placement/filters.py), so the pipeline gets the snapshot as it is.
    deadline = ReplyDeadline(settings.MOTOR_ENGINE_READ_TIMEOUT_S, settings.MOTOR_ENGINE_REPLY_S_PER_TOKEN)
    return ServingPipeline(
        snapshot, render, EngineClient(client, deadline=deadline), scheduler,
        counters=counters, boundary=boundary, stream_settings=StreamSettings(
            chunk_timeout_s=settings.MOTOR_STREAM_CHUNK_TIMEOUT_S, max_relays=settings.MOTOR_STREAM_MAX_RELAYS,
            derender_retries=settings.MOTOR_DERENDER_CHUNK_RETRIES,
        ),
        sidecar_holds=sidecar_holds, topologies=RUNTIME.topologies,
        render_health=render.health_view,
        limits=RequestLimits(max_choices=settings.MOTOR_MAX_CHOICES, max_prompts=settings.MOTOR_MAX_PROMPTS),
    )
