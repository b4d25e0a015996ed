"""The native path on prefill/decode engines: the vllm-ascend guide's proxy flow, at the OpenAI level.

What the RFC calls the native path (原生链路) is the engine API the coordinator used before render:
on a fleet of P/D pairs, the guide's global proxy. The client's body goes to P's own OpenAI API
with one output token (``max_completion_tokens`` / ``max_tokens`` / ``max_output_tokens`` 1 as
the API names it), no stream, and ``kv_transfer_params: {"do_remote_decode": true, ...}``; P
prefills, keeps the KV and answers with the params D needs (the top-level ``kv_transfer_params``
of its JSON answer, which vLLM's chat, completions, Responses and Anthropic schemas all carry);
then the same body goes to D's own OpenAI API with those params verbatim, streaming or not, and
D's answer is the client's. Upstream vLLM's MooncakeConnector pairs get the router's params on
both legs instead (``handoff.router_pull_params``), as the token-only Handoff gives them.

Push pairs (Trigger, the layer-wise connector) run the same flow in the guide's other order
(``run_native_trigger``): D's own API first with ``do_remote_prefill`` and this request's
metaserver URL, P's one-token prefill when D calls back, with the callback body as its params. Only
the simulator shows that order here (no layer-wise engine runs on this machine). Requests a
pair cannot serve exactly stay off it (``native_pd_ineligible``): several samples or prompts per
body (P returns one set of params for the batch; several prompts are then run one pair flow
each, ``native_prompts.py``), prompt logprobs (D computes no prompt), a Responses ``background``
run (P would answer before prefilling). With obfuscation on nothing here runs: the native path is
closed (the pipeline refuses before it gets here).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Collection, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from serving.pipeline.engine.leg import Reservation
from serving.pipeline.engine.native import NativeStream
from serving.pipeline.errors import EngineError
from serving.pipeline.placement.filters import eligible_instances, native_pd_role, pairs_with
from serving.pipeline.protocol import ApiKind
from serving.pipeline.snapshot import FleetSnapshot, InstanceView
from serving.pipeline.topologies.handoff import router_pull_params, router_supplies_params
from serving.pipeline.topologies.metaserver import MetaServer, Registration
from serving.pipeline.topologies.pd import PREFILL_KV_PARAMS, _settle
from serving.pipeline.topologies.trigger import push_prefill_params

logger = logging.getLogger(__name__)

# The field each API reads its output bound from: what P's leg sets to one token.
PREFILL_OUTPUT_FIELD: dict[ApiKind, str] = {
    "chat": "max_completion_tokens",  # read before max_tokens by vLLM's chat schema
    "completions": "max_tokens",
    "responses": "max_output_tokens",
    "messages": "max_tokens",
}


def native_pd_ineligible(kind: ApiKind, body: Mapping[str, Any]) -> str:
    """Why ``body`` cannot take a P/D pair's own API exactly, or "" when it can."""
    if kind in ("chat", "completions"):
        if int(body.get("n") or 1) > 1 or int(body.get("best_of") or 1) > 1:
            return "n>1"
        if body.get("prompt_logprobs") is not None or (body.get("echo") and body.get("logprobs") is not None):
            return "prompt_logprobs"
    if kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt) and len(prompt) > 1:
            return "several_prompts"
    if kind == "responses" and body.get("background"):
        return "background"
    return ""


@dataclass(frozen=True, slots=True)
class NativePair:
    """A prefill and a decode instance that serve the native path together."""

    prefill: InstanceView
    decode: InstanceView

    @property
    def names(self) -> tuple[str, str]:
        return self.prefill.name, self.decode.name

    @property
    def transfer(self) -> str:
        """"pull" (Handoff: P first) or "push" (Trigger: D first, P on D's callback)."""
        return self.prefill.kv_transfer


def native_pairs(
    snapshot: FleetSnapshot, model: str, *, live: Callable[[InstanceView], bool], load: Callable[[InstanceView], float],
    exclude: Collection[str] = (), kind: str | None = None,
) -> list[NativePair]:
    """Eligible pairs of ``model`` (one connector, or a blank one on either side) whose engines
    serve ``kind``'s own route, least loaded first."""
    pool = eligible_instances(snapshot, model, live=live, exclude=exclude)
    pairs = [
        NativePair(p, d)
        for p in native_pd_role(pool, "prefill", kind) for d in native_pd_role(pool, "decode", kind)
        if pairs_with(p, d)
    ]
    # Pull pairs first (the guide's main flow, and no callback to wait for), then the least loaded.
    return sorted(pairs, key=lambda x: (x.transfer != "pull", max(load(x.prefill), load(x.decode)), x.names))


def prefill_body(kind: ApiKind, body: Mapping[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """P's leg: the client's body for one output token, whole (no stream), asking P to keep the KV."""
    leg = dict(body)
    leg["stream"] = False
    leg.pop("stream_options", None)
    if kind == "chat":
        leg.pop("max_tokens", None)
    leg[PREFILL_OUTPUT_FIELD[kind]] = 1
    if "min_tokens" in leg:
        leg["min_tokens"] = 1  # vLLM refuses min_tokens above max_tokens
    if kind == "responses":
        leg["store"] = False  # P's one-token answer is no response the client could ever name
    leg["kv_transfer_params"] = kv_transfer_params
    return leg


def decode_body(body: Mapping[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """D's leg: the client's body as sent, with the params P returned (the very object)."""
    leg = dict(body)
    leg["kv_transfer_params"] = kv_transfer_params
    return leg


# One guarded call to an engine's own API: (instance, body, leg request id, admission tokens,
# output bound, the leg's stack, the holds reserved for it) -> JSON answer or an established
# stream (which takes the stack).
NativeCall = Callable[
    [InstanceView, dict[str, Any], str, int, int | None, AsyncExitStack, Reservation | None],
    Awaitable[dict[str, Any] | NativeStream],
]
# Takes an instance's breaker slot, admission lease and load hold ahead of its call.
ReserveFn = Callable[[InstanceView, int], Awaitable[Reservation]]


async def run_native_handoff(
    call: NativeCall, reserve: ReserveFn, pair: NativePair, kind: ApiKind, body: dict[str, Any], request_id: str, *,
    prompt_tokens: int, tokens: int, max_output: int | None, stack: AsyncExitStack,
) -> dict[str, Any] | NativeStream:
    """Prefill on P's own API, then D's with P's params; returns D's answer (JSON or stream).

    ``tokens``/``max_output``: D's admission tokens and output bound, reserved (``reserve``) before
    P runs; P holds the prompt and its one token. ``stack`` takes D's holds (a stream keeps them). Raises ``EngineError`` naming P
    when P fails or answers without params (D is then never called: invented params crash a real
    decode engine), naming D when D fails; an engine's 4xx propagates as the client's error.
    """
    prefill, decode = pair.prefill, pair.decode
    p_id, d_id = f"{request_id}-prefill", f"{request_id}-decode"
    if router_supplies_params(prefill, decode):
        # Unique and unguessable, as the token-only Handoff's: P keeps the blocks under it.
        p_params, kv = router_pull_params(prefill, f"{request_id}-{secrets.token_hex(8)}")
    else:
        p_params, kv = dict(PREFILL_KV_PARAMS), None
    # D first, as the token-only Handoff does: a decode side that is held off or full refuses the
    # attempt before P prefills KV that would stay pinned on P, waiting for a pull that never comes.
    reserved = await reserve(decode, tokens)
    try:
        async with AsyncExitStack() as p_stack:
            answer = await call(prefill, prefill_body(kind, body, p_params), p_id,
                                min(prompt_tokens, prefill.max_model_len - 1) + 1, 1, p_stack, None)
        if kv is None:
            kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if not isinstance(kv, dict) or not kv:
                raise EngineError(
                    f"{prefill.name} answered the native prefill leg without kv_transfer_params (is it a KV producer?)",
                    instance=prefill.name,
                )
        logger.info("native_pd request_id=%s prefill=%s decode=%s leg=decode", request_id, prefill.name, decode.name)
        return await call(decode, decode_body(body, kv), d_id, tokens, max_output, stack, reserved)
    finally:
        await reserved.aclose()  # unused when P failed (D's breaker stays as it was); a no-op once taken


# How long D's metaserver callback may take once D has the request (the token-only Trigger's default).
CALLBACK_TIMEOUT_S = 30.0


async def run_native_trigger(
    call: NativeCall, pair: NativePair, kind: ApiKind, body: dict[str, Any], request_id: str, *,
    metaserver: MetaServer, prompt_tokens: int, tokens: int, max_output: int | None, stack: AsyncExitStack,
    callback_timeout_s: float = CALLBACK_TIMEOUT_S,
) -> dict[str, Any] | NativeStream:
    """The layer-wise (push) flow at the OpenAI level: D's own API first, with
    ``do_remote_prefill`` and this request's metaserver URL; D's callback starts P's one-token
    prefill with the callback body (plus ``do_remote_decode``) as its params; P pushes the KV and
    D answers. Returns D's answer once D's call *and* P's are over (a D stream is open then).

    Both legs carry one request id (the ``X-Request-Id`` header and the body's ``request_id``), so
    P's engine names the pushed request as D's engine knows it, whatever id form the API gives it
    (vllm-ascend's layer-wise connector matches P's done-signal by P's external request id). The
    callback is bound to this request by its unguessable token; its ``request_id`` is not checked
    against an id form, which differs per API and engine version. Raises ``EngineError`` naming D
    when D fails or never calls back, naming P when the prefill fails; D's call is then cancelled
    (a real D aborts a request whose client left).
    """
    prefill, decode = pair.prefill, pair.decode
    leg_id = f"{request_id}-trigger"
    d_stack = AsyncExitStack()
    await metaserver.advertise()  # as the token-only Trigger: a callback landing on a replica finds us
    with metaserver.register(request_id, engine_request_id="") as reg:
        d_body = decode_body(body, {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": reg.url})
        d_body["request_id"] = leg_id
        d_task = asyncio.create_task(_awaited(call(decode, d_body, leg_id, tokens, max_output, d_stack, None)))
        p_task: asyncio.Task[dict[str, Any] | NativeStream] | None = None
        ok = False
        try:
            callback = await _callback(reg, d_task, decode, callback_timeout_s)
            p_body = prefill_body(kind, body, push_prefill_params(callback))
            p_body["request_id"] = leg_id
            p_stack = AsyncExitStack()
            p_task = asyncio.create_task(_closing(call(
                prefill, p_body, leg_id, min(prompt_tokens, prefill.max_model_len - 1) + 1, 1, p_stack, None,
            ), p_stack))
            pending: set[asyncio.Task[Any]] = {p_task, d_task}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                # D first: when D gave up, P's push had nowhere to go and D's failure is the cause.
                for finished in sorted(done, key=lambda t: t is not d_task):
                    finished.result()
            result: dict[str, Any] | NativeStream = d_task.result()
            ok = True
        finally:
            await _settle(p_task, d_task)
            if not ok:
                if d_task.done() and not d_task.cancelled() and d_task.exception() is None:
                    answer = d_task.result()
                    if isinstance(answer, NativeStream):
                        await answer.aclose()
                await d_stack.aclose()
    if not isinstance(result, NativeStream):
        await d_stack.aclose()
    else:
        stack.push_async_callback(d_stack.aclose)  # empty: the stream took D's holds over
    return result


async def _awaited(leg: Awaitable[dict[str, Any] | NativeStream]) -> dict[str, Any] | NativeStream:
    return await leg


async def _closing(
    leg: Awaitable[dict[str, Any] | NativeStream], leg_stack: AsyncExitStack
) -> dict[str, Any] | NativeStream:
    """P's leg with its holds released as soon as it answered."""
    async with leg_stack:
        return await leg


async def _callback(
    reg: Registration, d_task: asyncio.Task[Any], decode: InstanceView, timeout_s: float
) -> dict[str, Any]:
    """D's callback body; D's own failure if D's call ends first without one."""
    wait = asyncio.create_task(reg.wait(timeout_s))
    try:
        done, _ = await asyncio.wait({wait, d_task}, return_when=asyncio.FIRST_COMPLETED)
        if wait not in done:
            d_task.result()  # D's own failure, as it raised
            raise EngineError(f"{decode.name} answered a Trigger request without calling back", instance=decode.name)
    finally:
        if not wait.done():
            wait.cancel()
            await asyncio.wait([wait])
    if wait.exception() is not None:
        raise EngineError(f"{decode.name} did not call the metaserver back within {timeout_s:g}s", instance=decode.name)
    return wait.result()
