"""vLLM's token-only generate and abort (``/inference/v1/generate``, ``abort_requests``): one
request's life on the simulated engine, KV transfer for the P/D roles, and the armed faults."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from enginesim.bodies import json_body, parse
from enginesim.config import EngineRole
from enginesim.engine import ChoiceDelta, Generation, SimEngine
from enginesim.errors import SimError, schema_error
from enginesim.faults import Fault, FaultMode
from enginesim.model import TokenLogprobs
from enginesim.protocol import (
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateRequest,
    GenerateResponse,
    GenerateResponseChoice,
    GenerateStreamChoice,
    GenerateStreamResponse,
    UsageInfo,
)
from enginesim.streaming import (
    DONE_EVENT,
    ConnectionDropped,
    SSEResponse,
    close_connection,
    race_disconnect,
    sse_event,
    wait_for_disconnect,
    wait_forever,
)

logger = logging.getLogger(__name__)

_AFTER_TOKENS = frozenset(
    {FaultMode.DROP_AFTER_TOKENS, FaultMode.STALL_AFTER_TOKENS, FaultMode.ERROR_EVENT_AFTER_TOKENS}
)


def _logprobs_json(entries: list[TokenLogprobs]) -> GenerateLogProbs:
    """Tokens-mode logprobs: per token, the sampled entry and top_logprobs listing the
    sampled token first and then the top-k, the sampled one not repeated (a dict in
    vLLM), so k entries when it is in the top-k and k+1 otherwise."""
    content = []
    for entry in entries:
        s = entry.sampled
        sampled = GenerateLogProb(token_id=s.token_id, logprob=s.logprob, rank=s.rank or None)
        top = [sampled] + [
            GenerateLogProb(token_id=c.token_id, logprob=c.logprob, rank=c.rank or None)
            for c in entry.top
            if c.token_id != s.token_id
        ]
        content.append(
            GenerateLogProbsContent(
                token_id=s.token_id, logprob=s.logprob, rank=s.rank or None, top_logprobs=top
            )
        )
    return GenerateLogProbs(content=content)


class _KV(enum.Enum):
    """Where a request's prompt KV comes from."""

    # Computed here (union, prefill, or a decode not asked for a remote prefill).
    LOCAL = "local"
    # Pulled from, or pushed by, a prefill instance.
    REMOTE = "remote"
    # Aborted while waiting for the push: the request ends with "abort", no tokens.
    ABORTED = "aborted"


class GenerateHandlers:
    """The generate and abort routes bound to one engine."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    async def generate(self, request: Request) -> Response:
        return await self.serve(request, lambda: parse(request, GenerateRequest))

    async def serve(self, request: Request, read: Callable[[], Awaitable[GenerateRequest]]) -> Response:
        """One generate: ``read`` gives the body (the OpenAI API's handlers build it from theirs),
        answered as a GenerateResponse or its stream, faults and KV transfer included."""
        engine = self.engine
        engine.stats.requests_received += 1
        engine.stats.x_request_ids.append(request.headers.get("x-request-id"))
        engine.stats.traceparents.append(request.headers.get("traceparent"))
        # Taken before validation: "the next n requests fail" whatever they contain.
        fault = engine.faults.take()
        if fault is not None and fault.mode is FaultMode.FAIL_BEFORE_FIRST_TOKEN:
            return await self._drop_before_response(request)
        if fault is not None and fault.mode is FaultMode.HTTP_STATUS:
            raise SimError(f"Simulated engine failure (HTTP {fault.status})", status=fault.status)

        body = await read()
        engine.stats.last_token_ids = list(body.token_ids)
        engine.check_model(body.model)
        engine.admit(body)
        engine_request_id = f"generate-tokens-{request.headers.get('x-request-id', body.request_id)}"
        if body.stream:
            kv = await self._receive_kv(body, engine_request_id)
            return SSEResponse(self._stream(request, body, engine_request_id, fault, kv))
        engine.validate(body)
        kv = await self._receive_kv(body, engine_request_id)
        return await self._full(request, body, engine_request_id, fault, kv)

    async def _receive_kv(self, body: GenerateRequest, engine_request_id: str) -> _KV:
        """On a decode instance asked for a remote prefill, get the KV (pull, or wait for
        the push). Raises the KV-failure SimError when it cannot."""
        engine = self.engine
        params = body.kv_transfer_params
        if engine.config.role is not EngineRole.DECODE or not params:
            return _KV.LOCAL
        if params.get("do_remote_prefill") is not True:
            return _KV.LOCAL
        if engine.config.kv_transfer == "push":
            if not await engine.kv.await_push(params, engine_request_id, len(body.token_ids)):
                return _KV.ABORTED
        elif engine.config.kv_pull_params == "router":
            missing = [k for k in ("remote_engine_id", "remote_bootstrap_addr", "transfer_id") if k not in params]
            if missing:
                # Upstream Mooncake's D (update_state_after_alloc) warns and computes the prompt itself.
                logger.warning("Got invalid KVTransferParams: %s. This request will not utilize KVTransfer", params)
                return _KV.LOCAL
            await engine.kv.pull_transfer(params, len(body.token_ids))
        else:
            await engine.kv.pull(params, len(body.token_ids))
        return _KV.REMOTE

    async def _send_kv(self, body: GenerateRequest, engine_request_id: str) -> dict[str, Any] | None:
        """On a prefill instance asked for a remote decode, hold the KV for D's pull (and
        return the params D needs) or push it to D; None when there is nothing to do."""
        engine = self.engine
        params = body.kv_transfer_params
        if engine.config.role is not EngineRole.PREFILL or not params:
            return None
        if params.get("do_remote_decode") is not True:
            return None
        if engine.config.kv_transfer == "push":
            await engine.kv.push(params, engine_request_id, len(body.token_ids))
            return None
        if engine.config.kv_pull_params == "router":
            transfer_id = params.get("transfer_id")
            if not isinstance(transfer_id, str) or not transfer_id:
                logger.warning("Missing transfer_id in kv_transfer_params from router!")
            else:
                engine.kv.hold_transfer(transfer_id, len(body.token_ids))
            return None  # upstream Mooncake's request_finished returns no params
        return engine.kv.hold(engine_request_id, len(body.token_ids))

    async def _drop_before_response(self, request: Request) -> Response:
        if not close_connection(request.scope):
            raise ConnectionDropped("fail_before_first_token")
        # Wait for the server to notice, so it does not answer 500 for a response we
        # never started; the Response below is then discarded by the server.
        await wait_for_disconnect(request.receive)
        return Response(status_code=500)

    async def _full(
        self,
        request: Request,
        body: GenerateRequest,
        engine_request_id: str,
        fault: Fault | None,
        kv: _KV = _KV.LOCAL,
    ) -> Response:
        engine = self.engine
        generation = engine.start(
            engine_request_id, body, remote_kv=kv is _KV.REMOTE, aborted=kv is _KV.ABORTED
        )
        logprobs: dict[int, list[TokenLogprobs]] = {c.index: [] for c in generation.choices}
        try:
            completed, fired = await race_disconnect(
                self._collect(generation, logprobs, fault), request.receive
            )
        finally:
            engine.finish(generation)
        if not completed:
            # Like vLLM's with_cancellation: the client left, the request was aborted.
            engine.stats.disconnects += 1
            return Response(status_code=499)
        if fired and fault is not None:
            if fault.mode is FaultMode.ERROR_EVENT_AFTER_TOKENS:
                raise SimError(f"Simulated engine failure after {fault.tokens} tokens", status=500)
            if fault.mode is FaultMode.DROP_AFTER_TOKENS:
                return await self._drop_before_response(request)
            await wait_for_disconnect(request.receive)  # stall
            engine.stats.disconnects += 1
            return Response(status_code=499)

        kv_transfer_params = await self._send_kv(body, engine_request_id)
        prompt_len = len(generation.prompt)
        completion = sum(len(c.output) for c in generation.choices)
        want_logprobs = generation.params.logprobs is not None
        response = GenerateResponse(
            request_id=engine_request_id,
            model=engine.config.model_name,
            created=int(time.time()),
            usage=UsageInfo(
                prompt_tokens=prompt_len,
                completion_tokens=completion,
                total_tokens=prompt_len + completion,
            ),
            prompt_token_ids=list(generation.prompt) if body.return_token_ids else None,
            kv_transfer_params=kv_transfer_params,
            choices=[
                GenerateResponseChoice(
                    index=c.index,
                    # vLLM reports "stop" when the engine gave no reason.
                    finish_reason=c.finish_reason or "stop",
                    stop_reason=c.stop_reason,
                    token_ids=list(c.output),
                    logprobs=_logprobs_json(logprobs[c.index]) if want_logprobs else None,
                )
                for c in generation.choices
            ],
        )
        return JSONResponse(response.model_dump())

    async def _collect(
        self,
        generation: Generation,
        logprobs: dict[int, list[TokenLogprobs]],
        fault: Fault | None,
    ) -> bool:
        """Run ``generation`` to the end; True if an after-tokens fault fired."""
        threshold = fault.tokens if fault is not None and fault.mode in _AFTER_TOKENS else None
        produced = 0
        async with aclosing(generation.deltas()) as deltas:
            async for delta in deltas:
                if threshold is not None and produced >= threshold:
                    return True
                produced += len(delta.token_ids)
                if delta.logprobs:
                    logprobs[delta.index].extend(delta.logprobs)
        return threshold is not None

    async def _stream(
        self,
        request: Request,
        body: GenerateRequest,
        engine_request_id: str,
        fault: Fault | None,
        kv: _KV = _KV.LOCAL,
    ) -> AsyncIterator[str]:
        engine = self.engine
        engine.stats.active_streams += 1
        generation: Generation | None = None
        # Set when the stream ended on our terms; otherwise the client went away.
        ended = False
        try:
            try:
                engine.validate(body)
            except SimError as exc:
                # Engine-level validation runs after the 200 went out: in-band error.
                yield sse_event(exc.sse_json())
                yield DONE_EVENT
                ended = True
                return
            generation = engine.start(
                engine_request_id, body, remote_kv=kv is _KV.REMOTE, aborted=kv is _KV.ABORTED
            )
            options = body.stream_options
            include_usage = bool(options and options.include_usage)
            continuous = include_usage and bool(options and options.continuous_usage_stats)
            prompt_len = len(generation.prompt)
            counts = [0] * generation.params.n
            threshold = fault.tokens if fault is not None and fault.mode in _AFTER_TOKENS else None
            sent = 0
            first = True
            try:
                async with aclosing(generation.deltas()) as deltas:
                    async for delta in deltas:
                        if threshold is not None and sent >= threshold:
                            break  # the fault fires below, as it does at the end of a shorter output
                        counts[delta.index] += len(delta.token_ids)
                        usage = (
                            UsageInfo(
                                prompt_tokens=prompt_len,
                                completion_tokens=counts[delta.index],
                                total_tokens=prompt_len + counts[delta.index],
                            )
                            if continuous
                            else None
                        )
                        event = self._stream_event(
                            engine_request_id, delta, usage, body, generation, first
                        )
                        first = False
                        yield sse_event(event.to_sse_json())
                        sent += len(delta.token_ids)
            except Exception:
                # What vLLM does with an unexpected engine error mid-stream.
                logger.exception("generate stream %s failed", engine_request_id)
                yield sse_event(SimError("Internal server error", status=500).sse_json())
                yield DONE_EVENT
                ended = True
                return
            if threshold is not None:
                assert fault is not None
                ended = fault.mode is not FaultMode.STALL_AFTER_TOKENS
                if fault.mode is FaultMode.ERROR_EVENT_AFTER_TOKENS:
                    error = SimError(f"Simulated engine failure after {sent} tokens", status=500)
                    yield sse_event(error.sse_json())
                    yield DONE_EVENT
                    return
                if fault.mode is FaultMode.DROP_AFTER_TOKENS:
                    if not close_connection(request.scope):
                        raise ConnectionDropped("drop_after_tokens")
                # Dropped (waiting for the server to cancel us) or stalled.
                await wait_forever()
            if include_usage:
                completion = sum(counts)
                final = GenerateStreamResponse(
                    request_id=engine_request_id,
                    usage=UsageInfo(
                        prompt_tokens=prompt_len,
                        completion_tokens=completion,
                        total_tokens=prompt_len + completion,
                    ),
                    choices=[],
                )
                yield sse_event(final.model_dump_json(exclude_none=True))
            yield DONE_EVENT
            ended = True
        finally:
            engine.stats.active_streams -= 1
            if generation is not None:
                engine.finish(generation)
            if not ended:
                engine.stats.disconnects += 1

    @staticmethod
    def _stream_event(
        engine_request_id: str,
        delta: ChoiceDelta,
        usage: UsageInfo | None,
        body: GenerateRequest,
        generation: Generation,
        first: bool,
    ) -> GenerateStreamResponse:
        return GenerateStreamResponse(
            request_id=engine_request_id,
            usage=usage,
            prompt_token_ids=list(generation.prompt) if first and body.return_token_ids else None,
            choices=[
                GenerateStreamChoice(
                    index=delta.index,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                    token_ids=list(delta.token_ids),
                    logprobs=(
                        _logprobs_json(list(delta.logprobs))
                        if generation.params.logprobs is not None and delta.logprobs is not None
                        else None
                    ),
                )
            ],
        )

    async def abort_requests(self, request: Request) -> Response:
        body = await json_body(request)
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids is None:
            raise schema_error("Missing 'request_ids' in request body")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise schema_error("'request_ids' must be a list of strings")
        # Only engine-side ids (generate-tokens-<id>) match; a bare id is a silent no-op.
        self.engine.abort(ids)
        return Response(status_code=200)
