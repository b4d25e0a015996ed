"""Handoff (pull connectors such as NixlConnector): prefill on P (non-streaming, one token,
``do_remote_decode``), then decode on D with the same prompt ids, the real budget and the
``kv_transfer_params`` P returned, verbatim; D's leg streams when the attempt does.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from typing import (
    Any,
)

from serving.pipeline.engine.leg import GenerateContext, Opened
from serving.pipeline.errors import EngineError
from serving.pipeline.placement.scheduler import Placement
from serving.pipeline.topologies.pd import (
    PREFILL_KV_PARAMS,
    PDContext,
    PDPlacement,
    _final_leg,
    _leg,
    _prefill_tokens,
    _reserve,
    _sides,
    decode_request,
    leg_ids,
    pd_context,
    prefill_request,
)

logger = logging.getLogger(__name__)

async def open_handoff(
    ctx: PDContext, placement: PDPlacement, engine_request: dict[str, Any], stack: AsyncExitStack
) -> Opened:
    """Prefill on P, then decode on D (``placement.instances``) in the run's mode: D's answer,
    or D's stream opened with P's ``kv_transfer_params`` verbatim (holds and stream on ``stack``).

    ``engine_request`` is the GenerateRequest the router built (its ``request_id`` names the
    attempt; the legs get ids of their own). P's leg is non-streaming in both modes (stream events
    carry no ``kv_transfer_params``) and over when this returns. Raises ``EngineError`` naming P
    when P fails or answers without ``kv_transfer_params`` (D is then never called: invented
    params crash a real decode engine), and naming D when D fails; ``UpstreamRequestError`` for a
    leg's 4xx.
    """
    prefill, decode = _sides(placement)
    p_id, d_id = leg_ids(engine_request["request_id"])
    # D first: a decode side that is held off or full refuses the attempt before P prefills KV
    # that would stay pinned on P, waiting for a pull that never comes.
    reserved = await _reserve(ctx, decode)
    try:
        p_request = prefill_request(engine_request, request_id=p_id, kv_transfer_params=dict(PREFILL_KV_PARAMS))
        p_response = await _leg(ctx, "prefill", prefill, p_request, _prefill_tokens(engine_request))
        kv = p_response.get("kv_transfer_params")
        if not isinstance(kv, dict) or not kv:
            raise EngineError(
                f"{prefill.name} answered the prefill leg without kv_transfer_params (is it a KV producer?)",
                instance=prefill.name,
            )
        # Verbatim: the same dict object goes on the wire to D.
        d_request = decode_request(engine_request, request_id=d_id, kv_transfer_params=kv)
        return await _final_leg(ctx, decode, d_request, stack, reserved)
    finally:
        if reserved is not None:
            # Unused when P failed (D's breaker stays as it was); a no-op once D's leg took it.
            await reserved.aclose()


async def handoff(
    ctx: GenerateContext, placement: Placement, engine_request: dict[str, Any], stack: AsyncExitStack
) -> Opened:
    """The registry's Handoff opener: ``open_handoff`` with the router's legs."""
    return await open_handoff(pd_context(ctx, placement), placement, engine_request, stack)
