"""Prefill / decode topologies: which one a request takes, and how its two legs run.

Union (one instance prefills and decodes) is the router core's own path. This module adds:

- **Handoff** (pull connectors such as NixlConnector): prefill on P (non-streaming, one token,
  ``do_remote_decode``), then decode on D with the same prompt ids, the real budget and the
  ``kv_transfer_params`` P returned, verbatim.
- **Trigger** (push connectors such as the layer-wise Mooncake one): D is called first with
  ``do_remote_prefill`` and a metaserver callback URL (``metaserver.py``); the callback's arrival
  picks P and starts its prefill with ``do_remote_decode``; P pushes the KV and D decodes.
- **PD Hybrid**: ``choose_topology`` picks one of the three per request from prompt length,
  prefix-cache hits and load, and falls back to union when P or D is unavailable.

The choice functions are pure (the scheduler calls them with what it knows); ``run_handoff`` and
``run_trigger`` only sequence the legs, hold load per leg, and release the request's P/D state
(load holds, engine requests, metaserver registration) exactly once on every exit path. They make
one attempt: a failure raises ``EngineError`` naming the failed instance so the caller's breaker and
retry budget act on the right one. Each leg is its own engine request with its own id.

Streaming (``open_handoff_stream`` / ``open_trigger_stream``, the router's ``STREAM_OPENERS``):
the same legs, with D's decode leg opened as a stream on the attempt's exit stack; the prefill
leg stays non-streaming. They return once D's stream is established (Trigger: and P answered), with
every other piece of P/D state released, so the stream then only holds D (its abort names D's leg
id). A relay is placed like a new prompt with the replay ids, so P and D both get them.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import logging
import time
from contextlib import AbstractContextManager, AsyncExitStack, nullcontext
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Mapping,
    Protocol,
    Sequence,
)

from serving.pipeline import service
from serving.pipeline.errors import EngineError, NoCapacity
from serving.pipeline.router.engine_client import EngineClient, engine_request_id
from serving.pipeline.router.metaserver import MetaServer, Registration, process_metaserver
from serving.pipeline.router.scheduler import Placement
from serving.pipeline.snapshot import FleetSnapshot, InstanceView

if TYPE_CHECKING:
    from serving.pipeline.router.kv_affinity import KVAffinityIndex
    from serving.pipeline.router.scheduler import Scheduler
    from serving.pipeline.service import GenerateContext

logger = logging.getLogger(__name__)

# Prefix hits are reported in blocks of vLLM's default size.
_BLOCK_SIZE = 128

# What the prefill leg asks for: vLLM's NIXL pattern (vllm-protocol.md section 6.3).
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
# The keys of D's Trigger callback that P needs to push to it (enginesim/pd.py, push mode).
_PUSH_TARGET_KEYS = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids", "remote_num_tokens")


class Topology(enum.Enum):
    # One instance prefills and decodes.
    UNION = "union"
    # P first, D pulls P's KV with the params P returned.
    HANDOFF = "handoff"
    # D first, its metaserver callback starts P, which pushes the KV.
    TRIGGER = "trigger"


# The topology each KV transfer mode of a P/D pair runs.
TRANSFER_TOPOLOGY = {"pull": Topology.HANDOFF, "push": Topology.TRIGGER}


# -- choosing -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PDPolicy:
    """When a fleet with both P/D pairs and union instances sends a request to P/D."""

    # Below this many prompt tokens the prefill is cheap and the extra hop costs more than it saves.
    min_prompt_tokens: int = 256
    # Union wins when its best instance already caches at least this share of the prompt.
    union_cache_share: float = 0.5
    # Union wins when the P/D pair's load exceeds the best union's by more than this (load units
    # are the scheduler's: in-flight tokens or requests per capacity, 0..1 and beyond).
    load_slack: float = 0.25


@dataclass(frozen=True, slots=True)
class TopologyChoice:
    topology: Topology
    reason: str
    prefill: InstanceView | None = None  # Handoff: the P; Trigger: the best P at placement time
    decode: InstanceView | None = None
    # Trigger picks its P only when D's callback arrives; these are the candidates, best first.
    prefill_candidates: tuple[InstanceView, ...] = ()


def available(instance: InstanceView) -> bool:
    """Whether ``instance`` may take a new leg (active, healthy, token-only, breaker not open)."""
    return (
        instance.takes_new_requests
        and instance.healthy
        and instance.token_generate
        and instance.breaker_state != "open"
    )


def pd_instances(
    snapshot: FleetSnapshot, model: str, role: str, *, exclude: Iterable[str] = ()
) -> list[InstanceView]:
    """Available instances of ``role`` ("prefill" | "decode") for ``model`` that transfer KV."""
    skip = set(exclude)
    return [
        i
        for i in snapshot.instances
        if i.model == model and i.role == role and i.kv_transfer in TRANSFER_TOPOLOGY
        and i.name not in skip and available(i)
    ]


def pd_ineligible(engine_request: Mapping[str, Any]) -> str:
    """Why ``engine_request`` must run on one instance, or "" if P/D can serve it exactly.

    D computes no prompt tokens, so it cannot return prompt logprobs; several samples per prompt
    would each need their own KV handoff.
    """
    params = engine_request.get("sampling_params") or {}
    if params.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if int(params.get("n") or 1) > 1:
        return "n>1"
    if engine_request.get("kv_transfer_params"):
        # The client brought its own transfer params (render hoists them): not ours to orchestrate.
        return "client_kv_transfer_params"
    return ""


def _pairable(prefills: list[InstanceView], decodes: list[InstanceView]) -> tuple[str, list[InstanceView], list[InstanceView]]:
    """The transfer mode both sides share (pull first), with the instances that speak it."""
    for mode in ("pull", "push"):
        ps = [p for p in prefills if p.kv_transfer == mode]
        ds = [d for d in decodes if d.kv_transfer == mode]
        # A pair must speak one connector; an empty name on either side is taken as a match.
        ds = [d for d in ds if any(not p.kv_connector or not d.kv_connector or p.kv_connector == d.kv_connector for p in ps)]
        if ps and ds:
            return mode, ps, ds
    return "", [], []


def choose_topology(
    *,
    prompt_tokens: int,
    unions: list[InstanceView],
    prefills: list[InstanceView],
    decodes: list[InstanceView],
    load: Callable[[InstanceView], float],
    cached_tokens: Mapping[str, int] | None = None,
    ineligible: str = "",
    policy: PDPolicy = PDPolicy(),
) -> TopologyChoice:
    """Pick the topology of one prompt (PD Hybrid); pure, so the scheduler can table-test it.

    ``unions``/``prefills``/``decodes`` are the available instances of each role (see
    ``pd_instances``); ``load`` is the scheduler's load of an instance; ``cached_tokens`` maps
    instance names to the prompt tokens their prefix cache holds (KV affinity). Returns a union
    choice (with no instance: the scheduler picks it) whenever P or D is missing; raises
    ``NoCapacity`` only when nothing at all can serve the prompt.
    """
    cached = cached_tokens or {}
    mode, ps, ds = _pairable(prefills, decodes)
    if not mode:
        if not unions:
            raise NoCapacity("no union instance and no prefill/decode pair can serve this model right now")
        missing = "prefill instance" if not prefills else "decode instance" if not decodes else "matching prefill/decode pair"
        return TopologyChoice(Topology.UNION, f"no {missing}")
    if ineligible:
        if not unions:
            raise NoCapacity(f"this request needs a union instance ({ineligible}) and none is available")
        return TopologyChoice(Topology.UNION, ineligible)
    # P computes the prompt: prefer the one that caches most of it, then the least loaded.
    ps = sorted(ps, key=lambda i: (-cached.get(i.name, 0), load(i), i.name))
    ds = sorted(ds, key=lambda i: (load(i), i.name))
    choice = TopologyChoice(TRANSFER_TOPOLOGY[mode], "", ps[0], ds[0], tuple(ps))
    if not unions:
        return _with_reason(choice, "only prefill/decode instances")
    if prompt_tokens < policy.min_prompt_tokens:
        return TopologyChoice(Topology.UNION, f"short prompt ({prompt_tokens} < {policy.min_prompt_tokens} tokens)")
    best_union_cached = max((cached.get(u.name, 0) for u in unions), default=0)
    if prompt_tokens and best_union_cached >= policy.union_cache_share * prompt_tokens:
        return TopologyChoice(Topology.UNION, f"prefix cached on a union instance ({best_union_cached} tokens)")
    pd_load = max(load(ps[0]), load(ds[0]))
    union_load = min(load(u) for u in unions)
    if pd_load > union_load + policy.load_slack:
        return TopologyChoice(Topology.UNION, f"prefill/decode busier ({pd_load:.2f} vs {union_load:.2f})")
    return _with_reason(choice, "long prompt")


def _with_reason(choice: TopologyChoice, reason: str) -> TopologyChoice:
    return TopologyChoice(choice.topology, reason, choice.prefill, choice.decode, choice.prefill_candidates)


# -- the legs' requests -------------------------------------------------------------------


def prefill_request(
    engine_request: Mapping[str, Any], *, request_id: str, kv_transfer_params: dict[str, Any]
) -> dict[str, Any]:
    """The prefill leg of ``engine_request``: same prompt ids, one token, non-streaming.

    Stream events carry no ``kv_transfer_params``, so no stream and no stream options; vLLM's
    ``SamplingParams`` rejects ``min_tokens > max_tokens``, so both are 1.
    """
    req = copy.copy(dict(engine_request))
    params = dict(req.get("sampling_params") or {})
    params["max_tokens"] = 1
    params["min_tokens"] = 1
    req["sampling_params"] = params
    req["stream"] = False
    req.pop("stream_options", None)
    req["request_id"] = request_id
    req["kv_transfer_params"] = kv_transfer_params
    return req


def decode_request(
    engine_request: Mapping[str, Any], *, request_id: str, kv_transfer_params: dict[str, Any]
) -> dict[str, Any]:
    """The decode leg: ``engine_request`` as the client's budget made it, with the given params
    (in Handoff P's, the very object P returned: never rebuilt, trimmed or extended)."""
    req = copy.copy(dict(engine_request))
    req["request_id"] = request_id
    req["kv_transfer_params"] = kv_transfer_params
    return req


def leg_ids(request_id: str) -> tuple[str, str]:
    """Engine request ids of the prefill and decode legs: distinct, so aborting one never hits the other."""
    return f"{request_id}-prefill", f"{request_id}-decode"


# -- running ------------------------------------------------------------------------------


class PDPlacement(Protocol):
    """What the runners read from the scheduler's ``Placement``: ``instances == (prefill, decode)``
    (in Trigger the prefill is the best candidate at placement time; ``pick_prefill`` may replace it)."""

    @property
    def instances(self) -> tuple[InstanceView, ...]: ...


# The router's per-leg work (breaker, token admission, load, boundary, validation):
# ``GenerateContext.leg`` bound to one attempt; (instance, request, phase, admission tokens).
LegFn = Callable[[InstanceView, dict[str, Any], str, int], Awaitable[dict[str, Any]]]
# The streaming leg: ``GenerateContext.stream_leg`` bound to one attempt; (instance, request, phase,
# admission tokens, the attempt's stack that takes the leg's holds and HTTP stream) -> events.
StreamLegFn = Callable[
    [InstanceView, dict[str, Any], str, int, AsyncExitStack], Awaitable[AsyncIterator[dict[str, Any]]]
]


@dataclass
class PDContext:
    """What a P/D run needs from the router around it."""

    engines: EngineClient  # for aborts (and for the generate itself when ``leg_fn`` is None)
    request_id: str  # the public request id, for logs
    prompt_index: int = 0
    # Without ``leg_fn``: the per-instance hold around each leg's plain generate.
    hold: Callable[[InstanceView], AbstractContextManager[object]] = field(default=lambda _i: nullcontext())
    leg_fn: LegFn | None = None
    # Admission tokens of the decode leg (prompt + resolved output); the prefill leg holds prompt + 1.
    tokens: int = 0
    metaserver: MetaServer | None = None
    # Trigger: how long D's callback may take to arrive once D accepted the request.
    callback_timeout_s: float = 30.0
    # Trigger: picks P when the callback arrives (default: the placement's P).
    pick_prefill: Callable[[], InstanceView] | None = None
    # Streaming: opens the decode leg's stream (``open_handoff_stream`` / ``open_trigger_stream``).
    stream_fn: StreamLegFn | None = None


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


async def _leg(ctx: PDContext, phase: str, instance: InstanceView, request: dict[str, Any], tokens: int) -> dict[str, Any]:
    """Run one leg; abort it on the engine if we leave before its answer (cancelled, timed out)."""
    rid = request["request_id"]
    start = time.perf_counter()
    done = False
    try:
        if ctx.leg_fn is not None:
            response = await ctx.leg_fn(instance, request, phase, tokens)
        else:
            with ctx.hold(instance):
                response = await ctx.engines.generate(instance, request)
        done = True
    finally:
        if not done:
            logger.warning(
                "generate request_id=%s prompt=%d instance=%s phase=%s engine_request_id=%s result=failed latency_ms=%.1f",
                ctx.request_id, ctx.prompt_index, instance.name, phase, rid, _ms(start),
            )
            # The engine may still be working on it: free its slot now. Shielded, so a second
            # cancellation cannot interrupt the abort and leak the slot.
            await asyncio.shield(ctx.engines.abort(instance, [rid]))
    return response


def _prefill_tokens(engine_request: Mapping[str, Any]) -> int:
    """Admission tokens of a prefill leg: the prompt and its one sampled token."""
    return len(engine_request["token_ids"]) + 1


def _sides(placement: PDPlacement) -> tuple[InstanceView, InstanceView]:
    if len(placement.instances) != 2:
        raise NoCapacity("a prefill/decode placement needs a prefill and a decode instance")
    prefill, decode = placement.instances
    return prefill, decode


async def run_handoff(ctx: PDContext, placement: PDPlacement, engine_request: dict[str, Any]) -> dict[str, Any]:
    """Prefill on P, then decode on D (``placement.instances``); return D's GenerateResponse.

    ``engine_request`` is the non-streaming GenerateRequest the router built (its ``request_id``
    names the attempt; the legs get ids of their own). Raises ``EngineError`` naming P when P fails
    or answers without ``kv_transfer_params`` (D is then never called: invented params crash a real
    decode engine), and naming D when D fails; ``UpstreamRequestError`` for a leg's 4xx.
    """
    decode, d_request = await _handoff_prefill(ctx, placement, engine_request)
    return await _leg(ctx, "decode", decode, d_request, ctx.tokens)


async def _handoff_prefill(
    ctx: PDContext, placement: PDPlacement, engine_request: dict[str, Any]
) -> tuple[InstanceView, dict[str, Any]]:
    """Handoff's prefill leg on P (both the plain and the streaming run): D and its decode request."""
    prefill, decode = _sides(placement)
    p_id, d_id = leg_ids(engine_request["request_id"])
    p_request = prefill_request(engine_request, request_id=p_id, kv_transfer_params=dict(PREFILL_KV_PARAMS))
    p_response = await _leg(ctx, "prefill", prefill, p_request, _prefill_tokens(engine_request))
    kv = p_response.get("kv_transfer_params")
    if not isinstance(kv, dict) or not kv:
        raise EngineError(
            f"{prefill.name} answered the prefill leg without kv_transfer_params (is it a KV producer?)",
            instance=prefill.name,
        )
    # Verbatim: the same dict object goes on the wire to D.
    return decode, decode_request(engine_request, request_id=d_id, kv_transfer_params=kv)


def push_prefill_params(callback: Mapping[str, Any]) -> dict[str, Any]:
    """P's ``kv_transfer_params`` in Trigger, from D's callback: where to push, for which request."""
    params: dict[str, Any] = dict(PREFILL_KV_PARAMS)
    for key in _PUSH_TARGET_KEYS:
        if key in callback:
            params[key] = callback[key]
    params["remote_request_id"] = callback["request_id"]
    return params


async def run_trigger(ctx: PDContext, placement: PDPlacement, engine_request: dict[str, Any]) -> dict[str, Any]:
    """Decode on D first; its metaserver callback starts the prefill on P (``placement.instances``).

    Returns D's GenerateResponse. The registration is released, and a leg still running on an
    engine is aborted, on every exit path. Raises ``EngineError`` naming D when D fails or never
    calls back within ``ctx.callback_timeout_s``, naming P when the prefill fails (D's request is
    then aborted); ``NoCapacity`` without a metaserver or when no P is left at callback time.
    """
    metaserver, placed_prefill, decode = _trigger_sides(ctx, placement)
    p_id, d_id = leg_ids(engine_request["request_id"])
    with metaserver.register(ctx.request_id, engine_request_id=engine_request_id(d_id)) as reg:
        d_request = _trigger_decode_request(engine_request, d_id, reg)
        d_task = asyncio.create_task(_leg(ctx, "decode", decode, d_request, ctx.tokens))
        p_task: asyncio.Task[dict[str, Any]] | None = None
        try:
            callback = await _await_callback(ctx, reg, d_task, decode)
            p_task = _start_push_prefill(ctx, engine_request, placed_prefill, p_id, callback)
            await asyncio.wait([p_task, d_task], return_when=asyncio.FIRST_COMPLETED)
            if d_task.done() and d_task.exception() is not None:
                # D failed while P ran: P's push has nowhere to go, and D's failure is the cause.
                d_task.result()
            await p_task  # P's own failure, naming P
            return await d_task
        finally:
            await _settle(p_task, d_task)


def _trigger_sides(ctx: PDContext, placement: PDPlacement) -> tuple[MetaServer, InstanceView, InstanceView]:
    """The metaserver and the placed (P, D) of a Trigger run (plain or streaming)."""
    if ctx.metaserver is None:
        raise NoCapacity("Trigger needs this process's metaserver, and none is configured")
    placed_prefill, decode = _sides(placement)
    return ctx.metaserver, placed_prefill, decode


def _trigger_decode_request(engine_request: dict[str, Any], d_id: str, reg: Registration) -> dict[str, Any]:
    """D's leg in Trigger: remote prefill, with the registration's callback URL."""
    d_params = {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": reg.url}
    return decode_request(engine_request, request_id=d_id, kv_transfer_params=d_params)


def _start_push_prefill(
    ctx: PDContext, engine_request: dict[str, Any], placed_prefill: InstanceView, p_id: str,
    callback: Mapping[str, Any],
) -> asyncio.Task[dict[str, Any]]:
    """D called back: pick P (the placed one unless ``ctx.pick_prefill`` says otherwise) and start
    its prefill leg, pushing to where the callback says."""
    prefill = ctx.pick_prefill() if ctx.pick_prefill is not None else placed_prefill
    p_request = prefill_request(engine_request, request_id=p_id, kv_transfer_params=push_prefill_params(callback))
    return asyncio.create_task(_leg(ctx, "prefill", prefill, p_request, _prefill_tokens(engine_request)))


async def _settle(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel the legs still running and wait for them: each leg's own finally aborts its engine
    request. Their outcomes are retrieved, not taken on (raised already, or superseded by ours)."""
    for task in tasks:
        if task is not None and not task.done():
            task.cancel()
    await asyncio.wait([t for t in tasks if t is not None])
    for task in tasks:
        if task is not None and not task.cancelled():
            task.exception()


async def _await_callback(
    ctx: PDContext, reg: Registration, d_task: asyncio.Task[dict[str, Any]], decode: InstanceView
) -> dict[str, Any]:
    """Wait for D's callback, or for D's leg to end first (it failed, or answered without one)."""
    wait = asyncio.create_task(reg.wait(ctx.callback_timeout_s))
    try:
        await asyncio.wait([wait, d_task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not wait.done():
            wait.cancel()
            await asyncio.wait([wait])
    if wait.done() and not wait.cancelled() and wait.exception() is None:
        return wait.result()
    if d_task.done():
        d_task.result()  # D's own failure, as it raised
        raise EngineError(f"{decode.name} answered a Trigger request without calling back", instance=decode.name)
    raise EngineError(
        f"{decode.name} did not call the metaserver back within {ctx.callback_timeout_s:g}s", instance=decode.name
    )


# -- streaming ----------------------------------------------------------------------------

# What a stream opener returns: the decode instance, its leg's engine request id (what an abort
# names) and D's events. Everything else the run held is released before it returns.
OpenedStream = tuple[InstanceView, str, AsyncIterator[dict[str, Any]]]


async def _stream_leg(
    ctx: PDContext, instance: InstanceView, request: dict[str, Any], stack: AsyncExitStack
) -> AsyncIterator[dict[str, Any]]:
    if ctx.stream_fn is None:
        raise NoCapacity("a streaming prefill/decode run needs the router's streaming leg")
    return await ctx.stream_fn(instance, request, "decode", ctx.tokens, stack)


async def open_handoff_stream(
    ctx: PDContext, placement: PDPlacement, engine_request: dict[str, Any], stack: AsyncExitStack
) -> OpenedStream:
    """Streaming Handoff: the prefill leg on P as in ``run_handoff`` (non-streaming, one token),
    then D's decode leg opened as a stream with P's ``kv_transfer_params`` verbatim.

    Established once D answered 200; D's holds and HTTP stream go on ``stack`` (the attempt's),
    P's leg is over by then. Failures raise ``EngineError`` naming the failed instance.
    """
    decode, d_request = await _handoff_prefill(ctx, placement, engine_request)
    return decode, d_request["request_id"], await _stream_leg(ctx, decode, d_request, stack)


async def open_trigger_stream(
    ctx: PDContext, placement: PDPlacement, engine_request: dict[str, Any], stack: AsyncExitStack
) -> OpenedStream:
    """Streaming Trigger: D's stream opened first (``do_remote_prefill`` + metaserver callback),
    the prefill dispatched on P when the callback arrives, as in ``run_trigger``.

    Returns once D's stream is open *and* P's prefill leg answered: a decode engine may answer
    200 before the KV arrived, and a prefill failure must still be retryable with a proper
    status, so the registration and both legs' tasks are over when this returns (released or
    aborted exactly once on every exit path, cancellation included). Only D's stream and holds
    outlive it, on ``stack``.
    """
    metaserver, placed_prefill, decode = _trigger_sides(ctx, placement)
    p_id, d_id = leg_ids(engine_request["request_id"])
    with metaserver.register(ctx.request_id, engine_request_id=engine_request_id(d_id)) as reg:
        d_request = _trigger_decode_request(engine_request, d_id, reg)
        # D's holds and stream live on their own stack until the run succeeded; then ``stack`` owns them.
        d_stack = AsyncExitStack()
        d_task = asyncio.create_task(_stream_leg(ctx, decode, d_request, d_stack))
        p_task: asyncio.Task[dict[str, Any]] | None = None
        ok = False
        try:
            callback = await _await_stream_callback(ctx, reg, d_task, decode)
            p_task = _start_push_prefill(ctx, engine_request, placed_prefill, p_id, callback)
            pending: set[asyncio.Task[Any]] = {p_task, d_task}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                # D first: when D gave up, P's push had nowhere to go and D's failure is the cause.
                for finished in sorted(done, key=lambda t: t is not d_task):
                    finished.result()
            events = d_task.result()
            ok = True
        finally:
            await _settle(p_task, d_task)
            if not ok:
                # D may hold the request waiting for a push that will never come: free its slot.
                await asyncio.shield(_close_failed_decode(ctx, decode, d_id, d_stack))
    stack.push_async_callback(d_stack.aclose)
    return decode, d_id, events


async def _close_failed_decode(ctx: PDContext, decode: InstanceView, d_id: str, d_stack: AsyncExitStack) -> None:
    try:
        await d_stack.aclose()
    finally:
        await ctx.engines.abort(decode, [d_id])


async def _await_stream_callback(
    ctx: PDContext, reg: Registration, d_task: asyncio.Task[Any], decode: InstanceView
) -> dict[str, Any]:
    """Wait for D's callback; D's stream may open before it (a real D answers 200 at once) or
    fail first (its failure is raised). The timeout counts from the request to D."""
    wait = asyncio.create_task(reg.wait(ctx.callback_timeout_s))
    try:
        pending: set[asyncio.Task[Any]] = {wait, d_task}
        while wait in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if d_task in done and d_task.exception() is not None:
                d_task.result()
    finally:
        if not wait.done():
            wait.cancel()
            await asyncio.wait([wait])
    if wait.exception() is not None:
        raise EngineError(
            f"{decode.name} did not call the metaserver back within {ctx.callback_timeout_s:g}s", instance=decode.name
        )
    return wait.result()


# -- the router's seam ----------------------------------------------------------------------


def pd_context(ctx: GenerateContext, placement: Placement, *, callback_timeout_s: float = 30.0) -> PDContext:
    """A ``PDContext`` whose legs go through the router's ``GenerateContext.leg``."""
    pipeline = ctx.pipeline
    placed = placement.instances[0]

    async def leg(instance: InstanceView, request: dict[str, Any], phase: str, tokens: int) -> dict[str, Any]:
        return await ctx.leg(instance, request, phase=phase, tokens=tokens)

    async def stream_leg(
        instance: InstanceView, request: dict[str, Any], phase: str, tokens: int, stack: AsyncExitStack
    ) -> AsyncIterator[dict[str, Any]]:
        return await ctx.stream_leg(instance, request, phase=phase, tokens=tokens, stack=stack)

    def pick_prefill() -> InstanceView:
        # Trigger, at callback time: the P placed earlier, unless its breaker opened meanwhile.
        if pipeline.scheduler.eligible(placed):
            return placed
        others = [
            i for i in pd_instances(pipeline.snapshot, placed.model, "prefill", exclude={placed.name})
            if i.kv_transfer == placed.kv_transfer and pipeline.scheduler.eligible(i)
        ]
        if not others:
            raise NoCapacity("no prefill instance is left to serve this Trigger request")
        return min(others, key=lambda i: (pipeline.scheduler.load.inflight(i.name) / max(i.weight, 1), i.name))

    return PDContext(
        pipeline.engines, ctx.request_id, ctx.prompt_index, leg_fn=leg, tokens=ctx.tokens,
        metaserver=process_metaserver(), callback_timeout_s=callback_timeout_s, pick_prefill=pick_prefill,
        stream_fn=stream_leg,
    )


async def handoff(ctx: GenerateContext, placement: Placement, engine_request: dict[str, Any]) -> dict[str, Any]:
    """``TOPOLOGY_RUNNERS["handoff"]``: ``run_handoff`` with the router's legs."""
    return await run_handoff(pd_context(ctx, placement), placement, engine_request)


async def trigger(ctx: GenerateContext, placement: Placement, engine_request: dict[str, Any]) -> dict[str, Any]:
    """``TOPOLOGY_RUNNERS["trigger"]``: ``run_trigger`` with the router's legs and this process's metaserver."""
    return await run_trigger(pd_context(ctx, placement), placement, engine_request)


async def handoff_stream(
    ctx: GenerateContext, placement: Placement, engine_request: dict[str, Any], stack: AsyncExitStack
) -> OpenedStream:
    """``STREAM_OPENERS["handoff"]``: ``open_handoff_stream`` with the router's legs."""
    return await open_handoff_stream(pd_context(ctx, placement), placement, engine_request, stack)


async def trigger_stream(
    ctx: GenerateContext, placement: Placement, engine_request: dict[str, Any], stack: AsyncExitStack
) -> OpenedStream:
    """``STREAM_OPENERS["trigger"]``: ``open_trigger_stream`` with the router's legs and metaserver."""
    return await open_trigger_stream(pd_context(ctx, placement), placement, engine_request, stack)


# One signature for every topology: registered in the router's table when this module is imported.
RUNNERS = {Topology.HANDOFF.value: handoff, Topology.TRIGGER.value: trigger}
STREAM_RUNNERS = {Topology.HANDOFF.value: handoff_stream, Topology.TRIGGER.value: trigger_stream}
service.TOPOLOGY_RUNNERS.update(RUNNERS)
service.STREAM_OPENERS.update(STREAM_RUNNERS)
service.PD_INELIGIBLE = pd_ineligible


def pd_topology_policy(
    load: Callable[[InstanceView], float],
    *,
    eligible: Callable[[InstanceView], bool] = lambda _i: True,
    cached_tokens: Callable[[FleetSnapshot, str, Sequence[int]], Mapping[str, int]] | None = None,
    policy: PDPolicy = PDPolicy(),
    block_size: Callable[[str], int] = lambda _name: _BLOCK_SIZE,
) -> Callable[[FleetSnapshot, str, Sequence[int], list[InstanceView], Collection[str]], Placement | None]:
    """A ``Scheduler(topology_policy=...)`` for PD Hybrid: a P/D ``Placement``, or None for union.

    ``load`` and ``eligible`` are the scheduler's (load per instance, breaker and probe verdict);
    ``cached_tokens`` is KV affinity's prefix-hit lookup (tokens cached per instance name) and
    ``block_size`` each instance's KV block size (prefix hits are reported in P's blocks).
    Requests P/D cannot serve exactly (``pd_ineligible``) never reach it: the scheduler keeps
    them on union (``Scheduler.place(pd_ineligible=...)``).
    """

    def place(
        snapshot: FleetSnapshot, model: str, prompt_ids: Sequence[int], unions: list[InstanceView],
        exclude: Collection[str],
    ) -> Placement | None:
        prefills = [i for i in pd_instances(snapshot, model, "prefill", exclude=exclude) if eligible(i)]
        decodes = [i for i in pd_instances(snapshot, model, "decode", exclude=exclude) if eligible(i)]
        if not prefills and not decodes:
            return None  # a union-only fleet: the scheduler's own path, no log noise
        cached = cached_tokens(snapshot, model, prompt_ids) if cached_tokens is not None else {}
        try:
            choice = choose_topology(
                prompt_tokens=len(prompt_ids), unions=unions, prefills=prefills, decodes=decodes,
                load=load, cached_tokens=cached, policy=policy,
            )
        except NoCapacity:
            return None  # the scheduler raises its own NoCapacity for an empty union list
        logger.debug("topology model=%s prompt_tokens=%d topology=%s reason=%s",
                     model, len(prompt_ids), choice.topology.value, choice.reason)
        if choice.topology is Topology.UNION or choice.prefill is None or choice.decode is None:
            return None
        hit = cached.get(choice.prefill.name, 0) // max(1, block_size(choice.prefill.name))
        return Placement(choice.topology.value, (choice.prefill, choice.decode), prefix_hit_blocks=hit)

    return place


def install(scheduler: Scheduler, *, index: KVAffinityIndex | None = None, policy: PDPolicy = PDPolicy()) -> None:
    """Turn PD Hybrid on in ``scheduler`` (``serving.runtime`` calls this once per process).

    A fleet without P/D instances is unaffected: the policy then leaves every request to union.
    ``index`` (KV affinity, the scheduler's own by default) adds prefix hits to the choice, in
    each instance's own block size.
    """
    index = index if index is not None else scheduler.affinity
    cached: Callable[[FleetSnapshot, str, Sequence[int]], Mapping[str, int]] | None = None
    if index is not None and index is scheduler.affinity:
        cached = scheduler.cached_tokens  # the runtime's case: one index for placement and policy
    elif index is not None:
        def cached(snapshot: FleetSnapshot, model: str, prompt_ids: Sequence[int]) -> Mapping[str, int]:
            names = [i.name for i in snapshot.instances if i.model == model]
            return {name: n * index.block_size(name) for name, n in index.scores(names, prompt_ids).items() if n}

    scheduler.topology_policy = pd_topology_policy(
        lambda i: scheduler.load.inflight(i.name) / max(i.weight, 1),
        eligible=scheduler.eligible,
        cached_tokens=cached,
        policy=policy,
        block_size=index.block_size if index is not None else (lambda _name: _BLOCK_SIZE),
    )
