"""What the P/D topologies share: the run's context, one leg (the legs' requests and ids are
``engine/requests.py``'s).

Each leg is its own engine request with its own id, run through the router's guarded leg
(``GenerateContext.leg`` / ``stream_leg``: breaker, admission, load, boundary, validation), and
aborted on the engine if the run leaves before its answer. The prefill leg is JSON in both modes;
the decode leg streams when the attempt does (``PDContext.stream``). Handoff (``handoff.py``) and
Trigger (``trigger.py``) only sequence legs and release their P/D state exactly once on every exit
path; Handoff reserves D's holds before P prefills (``ReserveFn``).
They make one attempt: a failure raises ``EngineError`` naming the failed instance, and the
attempt policy (``resilience/attempts.py``) decides what the next attempt excludes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import (
    Any,
    Awaitable,
    Callable,
    Mapping,
    Protocol,
)

from serving.pipeline.engine.client import EngineClient
from serving.pipeline.engine.leg import GenerateContext, Opened, Reservation
from serving.pipeline.errors import NoCapacity
from serving.pipeline.protocol import EventBatches
from serving.pipeline.snapshot import InstanceView
from serving.pipeline.topologies.hybrid import pd_instances
from serving.pipeline.topologies.metaserver import MetaServer, process_metaserver

logger = logging.getLogger(__name__)

# What the prefill leg asks for: vLLM's NIXL pattern (vllm-protocol.md section 6.3).
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}

# -- running ------------------------------------------------------------------------------


class PDPlacement(Protocol):
    """What the openers read from the scheduler's ``Placement``: ``instances == (prefill, decode)``
    (in Trigger the prefill is the best candidate at placement time; ``pick_prefill`` may replace it)."""

    @property
    def instances(self) -> tuple[InstanceView, ...]: ...


# The router's per-leg work (breaker, token admission, load, boundary, validation):
# ``GenerateContext.leg`` bound to one attempt; (instance, request, phase, admission tokens, the
# instance's reservation when one was taken).
LegFn = Callable[[InstanceView, dict[str, Any], str, int, Reservation | None], Awaitable[dict[str, Any]]]
# The streaming leg: ``GenerateContext.stream_leg`` bound to one attempt; (instance, request, phase,
# admission tokens, the attempt's stack that takes the leg's holds and HTTP stream, reservation) -> events.
StreamLegFn = Callable[
    [InstanceView, dict[str, Any], str, int, AsyncExitStack, Reservation | None],
    Awaitable[EventBatches],
]
# Takes an instance's breaker slot, admission lease and load hold ahead of its leg.
ReserveFn = Callable[[InstanceView, int], Awaitable[Reservation]]


@dataclass
class PDContext:
    """What a P/D run needs from the router around it."""

    engines: EngineClient  # for aborts
    request_id: str  # the public request id, for logs
    # The router's work around each leg (``pd_context`` binds them to one attempt): every leg's
    # generate, the decode leg's stream, D's holds taken ahead of P's prefill (Handoff).
    leg_fn: LegFn
    stream_fn: StreamLegFn
    reserve_fn: ReserveFn
    metaserver: MetaServer  # Trigger: where D calls back
    # Trigger: picks P when the callback arrives (the placement's P unless its breaker opened).
    pick_prefill: Callable[[], InstanceView]
    prompt_index: int = 0
    # Admission tokens of the decode leg (prompt + resolved output); the prefill leg holds prompt + 1.
    tokens: int = 0
    # Trigger: how long D's callback may take to arrive once D accepted the request.
    callback_timeout_s: float = 30.0
    # The run's mode: whether D's leg streams (through ``stream_fn``) or answers whole.
    stream: bool = False


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


async def _leg(
    ctx: PDContext, phase: str, instance: InstanceView, request: dict[str, Any], tokens: int,
    reserved: Reservation | None = None,
) -> dict[str, Any]:
    """Run one leg; abort it on the engine if we leave before its answer (cancelled, timed out)."""
    rid = request["request_id"]
    start = time.perf_counter()
    done = False
    try:
        response = await ctx.leg_fn(instance, request, phase, tokens, reserved)
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



async def _settle(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel the legs still running and wait for them: each leg's own finally aborts its engine
    request. Their outcomes are retrieved, not taken on (raised already, or superseded by ours).

    A second cancellation (the client's disconnect landing on a deadline's, say) does not cut
    the wait short: leaving early would let the run release its registration and holds while a
    leg still runs, so the legs are awaited to the end and the cancellation is raised after.
    """
    live = [t for t in tasks if t is not None]
    for task in live:
        if not task.done():
            task.cancel()
    interrupted = False
    while not all(t.done() for t in live):
        try:
            await asyncio.wait(live)
        except asyncio.CancelledError:
            interrupted = True
    for task in live:
        if not task.cancelled():
            task.exception()
    if interrupted:
        raise asyncio.CancelledError


# -- the attempt's last leg ---------------------------------------------------------------


async def _final_leg(
    ctx: PDContext, instance: InstanceView, request: dict[str, Any], stack: AsyncExitStack,
    reserved: Reservation | None = None,
) -> Opened:
    """D's leg in the run's mode: its stream (holds and HTTP stream on ``stack``), or its answer
    (through ``_leg``, so D is aborted if the run leaves before it answered)."""
    rid = request["request_id"]
    if not ctx.stream:
        return Opened(instance, rid, response=await _leg(ctx, "decode", instance, request, ctx.tokens, reserved))
    return Opened(instance, rid, events=await ctx.stream_fn(instance, request, "decode", ctx.tokens, stack, reserved))


# -- the router's seam ----------------------------------------------------------------------


def pd_context(ctx: GenerateContext, placement: PDPlacement, *, callback_timeout_s: float = 30.0) -> PDContext:
    """A ``PDContext`` whose legs go through the router's guarded leg (``GenerateContext``)."""
    scheduler = ctx.scheduler
    placed = placement.instances[0]

    async def leg(
        instance: InstanceView, request: dict[str, Any], phase: str, tokens: int, reserved: Reservation | None
    ) -> dict[str, Any]:
        return await ctx.leg(instance, request, phase=phase, tokens=tokens, reserved=reserved)

    async def stream_leg(
        instance: InstanceView, request: dict[str, Any], phase: str, tokens: int, stack: AsyncExitStack,
        reserved: Reservation | None,
    ) -> EventBatches:
        return await ctx.stream_leg(instance, request, phase=phase, tokens=tokens, stack=stack, reserved=reserved)

    async def reserve(instance: InstanceView, tokens: int) -> Reservation:
        return await ctx.guard.reserve(instance, tokens, ctx.phases, ctx.leases)

    def pick_prefill() -> InstanceView:
        # Trigger, at callback time: the P placed earlier, unless its breaker opened meanwhile.
        if scheduler.eligible(placed):
            return placed
        others = [
            i for i in pd_instances(ctx.snapshot, placed.model, "prefill", live=scheduler.eligible, exclude={placed.name})
            if i.kv_transfer == placed.kv_transfer
        ]
        if not others:
            raise NoCapacity("no prefill instance is left to serve this Trigger request")
        return min(others, key=lambda i: (scheduler.load.inflight(i.name) / max(i.weight, 1), i.name))

    return PDContext(
        ctx.engines, ctx.request_id, leg, stream_leg, reserve, process_metaserver(), pick_prefill,
        ctx.prompt_index, tokens=ctx.tokens, callback_timeout_s=callback_timeout_s, stream=ctx.stream,
    )
