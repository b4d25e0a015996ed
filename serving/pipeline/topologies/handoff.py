"""Handoff (pull connectors such as NixlConnector): prefill on P (non-streaming, one token,
``do_remote_decode``), then decode on D with the same prompt ids, the real budget and the
``kv_transfer_params`` P returned, verbatim. Streaming opens D's leg as a stream once P answered.
"""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack
from typing import (
    TYPE_CHECKING,
    Any,
)

from serving.pipeline.errors import EngineError
from serving.pipeline.placement.scheduler import Placement
from serving.pipeline.snapshot import InstanceView

if TYPE_CHECKING:
    from serving.pipeline.engine.leg import GenerateContext

from serving.pipeline.topologies.pd import (
    PREFILL_KV_PARAMS,
    OpenedStream,
    PDContext,
    PDPlacement,
    _leg,
    _prefill_tokens,
    _sides,
    _stream_leg,
    decode_request,
    leg_ids,
    pd_context,
    prefill_request,
)

logger = logging.getLogger(__name__)

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



async def handoff(ctx: GenerateContext, placement: Placement, engine_request: dict[str, Any]) -> dict[str, Any]:
    """The registry's Handoff runner: ``run_handoff`` with the router's legs."""
    return await run_handoff(pd_context(ctx, placement), placement, engine_request)



async def handoff_stream(
    ctx: GenerateContext, placement: Placement, engine_request: dict[str, Any], stack: AsyncExitStack
) -> OpenedStream:
    """The registry's Handoff opener: ``open_handoff_stream`` with the router's legs."""
    return await open_handoff_stream(pd_context(ctx, placement), placement, engine_request, stack)


