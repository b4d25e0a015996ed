"""Trigger (push connectors such as the layer-wise Mooncake one): D is called first with
``do_remote_prefill`` and a metaserver callback URL (``metaserver.py``); the callback's arrival
picks P and starts its prefill with ``do_remote_decode``; P pushes the KV and D decodes.

The run returns once D's leg (its answer, or its open stream when the attempt streams) *and* P
answered, with the registration and both legs' tasks over, so only D's stream and holds outlive
the run (on the attempt's stack).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack
from typing import (
    Any,
    Mapping,
)

from serving.pipeline.engine.client import engine_request_id
from serving.pipeline.engine.leg import GenerateContext, Opened
from serving.pipeline.engine.requests import decode_request, leg_ids, prefill_request
from serving.pipeline.errors import EngineError
from serving.pipeline.placement.scheduler import Placement
from serving.pipeline.snapshot import InstanceView
from serving.pipeline.topologies.metaserver import Registration
from serving.pipeline.topologies.pd import (
    PDContext,
    PDPlacement,
    _final_leg,
    _leg,
    _prefill_tokens,
    _settle,
    _sides,
    pd_context,
)

logger = logging.getLogger(__name__)

def push_prefill_params(callback: Mapping[str, Any]) -> dict[str, Any]:
    """P's ``kv_transfer_params`` in Trigger: D's callback body whole, plus ``do_remote_decode``.

    The layer-wise connector's P reads D's fields straight from this dict (some indexed, such as
    ``remote_cached_tokens``: a missing key crashes its scheduler), and vllm-ascend's reference
    proxy forwards the body as it came (docs/ascend-connectors.md, "Push"). So nothing is picked,
    renamed or dropped; a new field a later connector adds reaches P too.
    """
    params = dict(callback)
    params["do_remote_decode"] = True
    return params


def _trigger_decode_request(engine_request: dict[str, Any], d_id: str, reg: Registration) -> dict[str, Any]:
    """D's leg in Trigger: remote prefill, with the registration's callback URL."""
    d_params = {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": reg.url}
    return decode_request(engine_request, request_id=d_id, kv_transfer_params=d_params)


def _start_push_prefill(
    ctx: PDContext, engine_request: dict[str, Any], p_id: str, callback: Mapping[str, Any],
) -> asyncio.Task[dict[str, Any]]:
    """D called back: pick P (``ctx.pick_prefill``: the placed one unless its breaker opened since)
    and start its prefill leg, pushing to where the callback says."""
    prefill = ctx.pick_prefill()
    p_request = prefill_request(engine_request, request_id=p_id, kv_transfer_params=push_prefill_params(callback))
    return asyncio.create_task(_leg(ctx, "prefill", prefill, p_request, _prefill_tokens(engine_request)))




async def _await_callback(
    ctx: PDContext, reg: Registration, d_task: asyncio.Task[Any], decode: InstanceView
) -> dict[str, Any]:
    """Wait for D's callback; the timeout counts from the request to D.

    D's task may end first: with a failure, that failure is raised (it is the cause, whether or
    not the callback arrived meanwhile: P would push to nowhere); with success, that is normal
    when the task only opens D's stream (a real D answers 200 at once) and a protocol error when
    it is D's whole answer and no callback came (D answered without one).
    """
    wait = asyncio.create_task(reg.wait(ctx.callback_timeout_s))
    try:
        pending: set[asyncio.Task[Any]] = {wait, d_task}
        while wait in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if d_task in done:
                d_task.result()  # D's own failure, as it raised
                if not ctx.stream and wait in pending:
                    raise EngineError(f"{decode.name} answered a Trigger request without calling back",
                                      instance=decode.name)
    finally:
        if not wait.done():
            wait.cancel()
            await asyncio.wait([wait])
    if wait.exception() is not None:
        if not ctx.stream and d_task.done():
            raise EngineError(f"{decode.name} answered a Trigger request without calling back", instance=decode.name)
        raise EngineError(
            f"{decode.name} did not call the metaserver back within {ctx.callback_timeout_s:g}s", instance=decode.name
        )
    return wait.result()


async def open_trigger(
    ctx: PDContext, placement: PDPlacement, engine_request: dict[str, Any], stack: AsyncExitStack
) -> Opened:
    """Decode on D first (``do_remote_prefill`` + metaserver callback), in the run's mode; the
    prefill is dispatched on P when the callback arrives.

    Returns once D's leg (its whole answer, or its open stream) *and* P's prefill leg answered: a
    decode engine may answer 200 before the KV arrived, and a prefill failure must still be
    retryable with a proper status, so the registration and both legs' tasks are over when this
    returns (released or aborted exactly once on every exit path, cancellation included). Only
    D's stream and holds outlive it, on ``stack``. Raises ``EngineError`` naming D when D fails
    or never calls back within ``ctx.callback_timeout_s``, naming P when the prefill fails (D's
    request is then aborted); ``NoCapacity`` when no P is left.
    """
    metaserver = ctx.metaserver
    _, decode = _sides(placement)
    _, d_id = leg_ids(engine_request["request_id"])
    # P's leg carries D's request id, as vllm-ascend's layer-wise proxy sends it: P tells D that
    # the last layer arrived by its own external request id, and D looks that id up among its
    # waiting requests (mooncake_layerwise_connector.py, ``request_map``). Aborts still hit only
    # one leg: each goes to its own instance, and P and D are never the same one.
    p_id = d_id
    # The directory must know this process before D gets a URL whose callback may land on another replica.
    await metaserver.advertise()
    with metaserver.register(ctx.request_id, engine_request_id=engine_request_id(d_id)) as reg:
        d_request = _trigger_decode_request(engine_request, d_id, reg)
        # D's holds and stream live on their own stack until the run succeeded; then ``stack`` owns them.
        d_stack = AsyncExitStack()
        d_task = asyncio.create_task(_final_leg(ctx, decode, d_request, d_stack))
        p_task: asyncio.Task[dict[str, Any]] | None = None
        ok = False
        try:
            callback = await _await_callback(ctx, reg, d_task, decode)
            p_task = _start_push_prefill(ctx, engine_request, p_id, callback)
            pending: set[asyncio.Task[Any]] = {p_task, d_task}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                # D first: when D gave up, P's push had nowhere to go and D's failure is the cause.
                for finished in sorted(done, key=lambda t: t is not d_task):
                    finished.result()
            opened = d_task.result()
            ok = True
        finally:
            try:
                await _settle(p_task, d_task)
            finally:
                if not ok and ctx.stream:
                    # D may hold the request waiting for a push that will never come: free its
                    # slot (a non-streaming D leg aborts itself in ``_leg``).
                    await asyncio.shield(_close_failed_decode(ctx, decode, d_id, d_stack))
    stack.push_async_callback(d_stack.aclose)
    return opened


async def _close_failed_decode(ctx: PDContext, decode: InstanceView, d_id: str, d_stack: AsyncExitStack) -> None:
    try:
        await d_stack.aclose()
    finally:
        await ctx.engines.abort(decode, [d_id])


async def trigger(
    ctx: GenerateContext, placement: Placement, engine_request: dict[str, Any], stack: AsyncExitStack
) -> Opened:
    """The registry's Trigger opener: ``open_trigger`` with the router's legs and this process's metaserver."""
    return await open_trigger(pd_context(ctx, placement), placement, engine_request, stack)
