"""Handoff (pull connectors): prefill on P (non-streaming, one token, ``do_remote_decode``), then
decode on D with the same prompt ids and the real budget; D's leg streams when the attempt does.

Who writes D's ``kv_transfer_params`` depends on the pair's connector (``InstanceView.kv_connector``):

- P does (NixlConnector, vllm-ascend's MooncakeConnectorV1, and any other pull connector): P's
  answer carries them and D gets that very object, verbatim; an answer without them is P's fault.
- The router does (upstream vLLM's MooncakeConnector, ``ROUTER_SUPPLIED``): P answers
  ``kv_transfer_params: null``; both legs get a transfer id of ours, and D also P's engine id and
  the address of P's bootstrap server (vllm-protocol.md section 6.3;
  ``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py`` in vLLM 0.33.0,
  ``update_state_after_alloc`` and ``request_finished``).
"""

from __future__ import annotations

import logging
import secrets
from contextlib import AsyncExitStack
from typing import (
    Any,
)
from urllib.parse import urlsplit

from serving.pipeline.engine.leg import GenerateContext, Opened
from serving.pipeline.engine.requests import decode_request, leg_ids, prefill_request
from serving.pipeline.errors import EngineError
from serving.pipeline.placement.scheduler import Placement
from serving.pipeline.snapshot import InstanceView
from serving.pipeline.topologies.pd import (
    PREFILL_KV_PARAMS,
    PDContext,
    PDPlacement,
    _final_leg,
    _leg,
    _prefill_tokens,
    _sides,
    pd_context,
)

logger = logging.getLogger(__name__)

# Pull connectors whose router writes both legs' params, and P answers none.
ROUTER_SUPPLIED = frozenset({"MooncakeConnector"})
# Where upstream Mooncake's P serves its bootstrap registry without a port of its own in the
# record: vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT default (vllm/envs.py, 0.33.0).
MOONCAKE_BOOTSTRAP_PORT = 8998


def router_supplies_params(prefill: InstanceView, decode: InstanceView) -> bool:
    """Whether the pair's connector wants the router to write D's params (a pair shares one
    connector; the placement pairs a blank one with any)."""
    return (prefill.kv_connector or decode.kv_connector) in ROUTER_SUPPLIED


def bootstrap_addr(prefill: InstanceView) -> str:
    """Upstream Mooncake's ``remote_bootstrap_addr`` for P: a base URL, since D GETs
    ``remote_bootstrap_addr + "/query"`` (``_connect_to_prefiller_bootstrap``); P's host and the
    bootstrap port, which is the record's KV port when it has one."""
    host = urlsplit(prefill.url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{prefill.kv_port or MOONCAKE_BOOTSTRAP_PORT}"


def router_pull_params(prefill: InstanceView, transfer_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(P's, D's) ``kv_transfer_params`` for upstream Mooncake. P's engine id is its instance
    name: such a P is launched with ``"engine_id": "<instance name>"`` in its
    ``--kv-transfer-config`` (D looks that id up in P's bootstrap registry)."""
    p_params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    d_params = {
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer_id,
        "remote_engine_id": prefill.name, "remote_bootstrap_addr": bootstrap_addr(prefill),
    }
    return p_params, d_params


async def open_handoff(
    ctx: PDContext, placement: PDPlacement, engine_request: dict[str, Any], stack: AsyncExitStack
) -> Opened:
    """Prefill on P, then decode on D (``placement.instances``) in the run's mode: D's answer,
    or D's stream opened with P's ``kv_transfer_params`` verbatim (holds and stream on ``stack``).

    ``engine_request`` is the GenerateRequest the router built (its ``request_id`` names the
    attempt; the legs get ids of their own). P's leg is non-streaming in both modes (stream events
    carry no ``kv_transfer_params``) and over when this returns. Raises ``EngineError`` naming P
    when P fails or, where P writes D's params, answers without them (D is then never called:
    invented params crash a real decode engine), and naming D when D fails;
    ``UpstreamRequestError`` for a leg's 4xx. Where the router writes them, P's answer is not
    read for them, and D's leg starts after P answered (upstream Mooncake would also take both at
    once; in sequence, a failed P never costs D a slot).
    """
    prefill, decode = _sides(placement)
    p_id, d_id = leg_ids(engine_request["request_id"])
    # D first: a decode side that is held off or full refuses the attempt before P prefills KV
    # that would stay pinned on P, waiting for a pull that never comes.
    reserved = await ctx.reserve_fn(decode, ctx.tokens)
    try:
        if router_supplies_params(prefill, decode):
            # Unique per attempt and unguessable: P keeps the blocks under it until a D pulls them,
            # so another request's id must never match.
            transfer_id = f"{engine_request['request_id']}-{secrets.token_hex(8)}"
            p_params, kv = router_pull_params(prefill, transfer_id)
        else:
            p_params, kv = dict(PREFILL_KV_PARAMS), None
        p_request = prefill_request(engine_request, request_id=p_id, kv_transfer_params=p_params)
        p_response = await _leg(ctx, "prefill", prefill, p_request, _prefill_tokens(engine_request))
        if kv is None:
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
        # Unused when P failed (D's breaker stays as it was); a no-op once D's leg took it.
        await reserved.aclose()


async def handoff(
    ctx: GenerateContext, placement: Placement, engine_request: dict[str, Any], stack: AsyncExitStack
) -> Opened:
    """The registry's Handoff opener: ``open_handoff`` with the router's legs."""
    return await open_handoff(pd_context(ctx, placement), placement, engine_request, stack)
