"""HTTP client for the vLLM render sidecar: render, derender (whole and per chunk), health.

Render failures and derender failures are different fault domains (architecture invariant 4):
render errors about the request go back to the client, an unusable render raises
``RenderUnavailable``; derender errors never touch engines and map to 4xx passthrough or
``DerenderError`` (502, or 504 on timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any, AsyncContextManager, Sequence

import httpx
import msgspec

from serving.pipeline import tracing
from serving.pipeline.derender.payload import StreamState, packed_state
from serving.pipeline.errors import DerenderError, RenderUnavailable, UpstreamRequestError
from serving.pipeline.http11 import Http11Client, Reply
from serving.pipeline.protocol import ApiKind, GenerateRequest, TokenKind
from serving.pipeline.tracing import NO_TRACE

logger = logging.getLogger(__name__)

CHAT_RENDER = "/v1/chat/completions/render"
COMPLETIONS_RENDER = "/v1/completions/render"
# vLLM 0.33's sidecar renders the Responses and Messages APIs too (no derender exists for them):
# Messages runs the chat token path from its render (``apis/messages.py``); the native path asks
# render for their prompt token counts.
RENDER_PATHS: dict[ApiKind, str] = {
    "chat": CHAT_RENDER,
    "completions": COMPLETIONS_RENDER,
    "responses": "/v1/responses/render",
    "messages": "/v1/messages/render",
}
# What a streamed chunk's derender call enters instead of a deadline of its own (reusable).
_UNBOUNDED: contextlib.nullcontext[None] = contextlib.nullcontext()

CHAT_DERENDER = "/v1/chat/completions/derender"
COMPLETIONS_DERENDER = "/v1/completions/derender"


# Pause before a same-chunk derender retry (``StreamSettings.derender_retries``, opt-in): short,
# doubling, all inside the chunk's one bound (the render config's ``timeout_ms``).
RETRY_DELAY_MIN_S = 0.05
RETRY_DELAY_MAX_S = 0.5


class DerenderRetryable(DerenderError):
    """A derender failure a same-chunk retry may cure (when retries are on): unreachable, or a 5xx."""


def _json_or_none(response: Reply) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _is_request_error(status: int, body: Any) -> bool:
    """True when the sidecar rejected the request itself, not when it lacks the route.

    A route-level 404 from FastAPI is ``{"detail": "Not Found"}``; vLLM's own 404 about an
    unknown model is an ErrorResponse. 403 "scale-out disabled" and 501 are missing capability.
    """
    if status in (400, 422):
        return True
    return status == 404 and isinstance(body, dict) and isinstance(body.get("error"), dict)


# Render answers the client keeps besides request errors (the RFC's fault table: only an
# unusable render falls back). 413: the body is too large for the sidecar, and the local
# tokenizer accepting it would change what the deployment accepts. 429: the sidecar (or a proxy
# in front of it) says "slow down"; a fallback would take the load it shed onto the coordinator.
# A 5xx is render being unavailable, as the RFC counts derender's: that falls back.
RENDER_KEPT = frozenset({413, 429})
# The OpenAI error ``type`` given to a kept status whose answer carried no OpenAI error body.
_ERROR_TYPES = {413: "RequestEntityTooLarge", 422: "Unprocessable", 429: "TooManyRequests"}


def _request_error(status: int, body: Any, *, source: str) -> UpstreamRequestError:
    """The sidecar's verdict as the client's error; a body that is no OpenAI error (a proxy's
    page, nothing) gets the standard shape, with the status kept."""
    if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        kind = _ERROR_TYPES.get(status, "BadRequestError")
        body = {"error": {"message": f"{source} rejected the request ({status})", "type": kind, "param": None,
                          "code": status}}
    return UpstreamRequestError(status, body, source=source)


class RenderClient:
    """Calls one render sidecar over the shared HTTP client, each call bounded by ``timeout_s``.

    Every call is made once: the RFC adds no automatic derender retry in this stage. A streaming
    chunk's opt-in retry lives in ``StreamingRenderSession.derender``, inside the same bound.
    """

    def __init__(self, client: Http11Client, base_url: str, timeout_s: float) -> None:
        self._client = client
        self._base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s  # the render config's timeout_ms: a call, or a streaming chunk
        self._timeout = httpx.Timeout(timeout_s)
        # A streamed chunk's call: no deadline of its own, as the session's bound of the same
        # ``timeout_s`` around it started first and always ends first (derender/session.py); a
        # connection opened for it keeps the connect bound.
        self._chunk_timeout = httpx.Timeout(None, connect=timeout_s)

    async def _post_render(
        self, path: str, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> Any:
        try:
            # The whole call (httpx's timeouts are per phase: a sidecar trickling bytes would pass).
            async with asyncio.timeout(self.timeout_s):
                response = await self._client.post(
                    self._base_url + path, json=body, headers=tracing.with_trace({"X-Request-Id": request_id}, trace),
                    timeout=self._timeout,
                )
        except (httpx.TimeoutException, TimeoutError) as exc:
            raise RenderUnavailable(f"render timed out: {exc!r}", reason="timeout") from exc
        except httpx.TransportError as exc:
            raise RenderUnavailable(f"render unreachable: {exc!r}", reason="unreachable") from exc
        payload = _json_or_none(response)
        if response.status_code == 200:
            return payload
        if _is_request_error(response.status_code, payload) or response.status_code in RENDER_KEPT:
            raise _request_error(response.status_code, payload, source="render")
        reason = "capability" if response.status_code in (403, 404, 405, 501) else "status"
        raise RenderUnavailable(f"render answered {response.status_code}: {str(payload)[:200]}", reason=reason)

    async def render_chat(
        self, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> dict[str, Any]:
        """Return one GenerateRequest for a chat request."""
        out: dict[str, Any] = await self._post_render(CHAT_RENDER, body, request_id, trace)
        _check_generate_requests([out])
        return out

    async def render_messages(
        self, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> dict[str, Any]:
        """Return one GenerateRequest for an Anthropic Messages request (a sidecar without the
        route answers 404: ``RenderUnavailable`` with reason ``capability``)."""
        out: dict[str, Any] = await self._post_render(RENDER_PATHS["messages"], body, request_id, trace)
        _check_generate_requests([out])
        return out

    async def render_responses(
        self, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> dict[str, Any]:
        """Return one GenerateRequest for a Responses request (``apis/responses.py``)."""
        out: dict[str, Any] = await self._post_render(RENDER_PATHS["responses"], body, request_id, trace)
        _check_generate_requests([out])
        if body.get("stream"):
            # vLLM's Responses server counts usage for its final event; render's request asks none.
            out["stream_options"] = {"include_usage": True}
        return out

    async def render_completions(
        self, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> list[dict[str, Any]]:
        """Return one GenerateRequest per prompt, in prompt order."""
        out = await self._post_render(COMPLETIONS_RENDER, body, request_id, trace)
        if not (isinstance(out, list) and out):
            raise RenderUnavailable("render answered without a list of generate requests", reason="malformed")
        _check_generate_requests(out)
        return out

    async def prompt_lengths(
        self, kind: ApiKind, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> list[int]:
        """How many tokens each prompt of ``body`` renders to (one for all but completions).

        Raises what rendering raises: ``UpstreamRequestError`` for render's verdict on the body,
        ``RenderUnavailable`` when the sidecar cannot answer (an older one lacks the route: 404).
        """
        # Only the ids' layout is read: "none" spares the processed media tensors in the answer.
        out = await self._post_render(RENDER_PATHS[kind], {**body, "mm_payload": "none"}, request_id)
        rendered = out if isinstance(out, list) else [out]
        if not (rendered and all(isinstance(r, dict) and _has_token_ids(r) for r in rendered)):
            raise RenderUnavailable("render answered without usable token_ids", reason="no_token_ids")
        return [len(r["token_ids"]) for r in rendered]

    async def _post_derender(
        self, path: str, body: dict[str, Any], trace: Mapping[str, str], *, chunk: bool = False
    ) -> dict[str, Any]:
        """One derender call, bounded by ``timeout_s`` as a whole; a streamed ``chunk``'s by the
        session around it only (two timers fewer a chunk, neither of which could end first)."""
        try:
            async with _UNBOUNDED if chunk else asyncio.timeout(self.timeout_s):  # the whole call, as for render
                response = await self._client.post(
                    self._base_url + path, json=body, headers=tracing.with_trace({}, trace),
                    timeout=self._chunk_timeout if chunk else self._timeout,
                )
        except (httpx.TimeoutException, TimeoutError) as exc:
            raise DerenderError(f"derender timed out: {exc!r}", status=504) from exc
        except httpx.TransportError as exc:
            raise DerenderRetryable(f"derender unreachable: {exc!r}") from exc
        payload = _json_or_none(response)
        if response.status_code == 200 and isinstance(payload, dict):
            return payload
        if _is_request_error(response.status_code, payload):
            raise _request_error(response.status_code, payload, source="derender")
        if response.status_code in (403, 404, 501):
            raise DerenderError(f"the response stage is unavailable: derender answered {response.status_code}")
        if response.status_code >= 500:
            raise DerenderRetryable(f"derender failed with {response.status_code}: {str(payload)[:200]}")
        raise DerenderError(f"derender failed with {response.status_code}: {str(payload)[:200]}")

    async def derender_chat(
        self,
        generate_response: dict[str, Any],
        *,
        prompt_token_ids: Sequence[int],
        chat_request: dict[str, Any],
        model: str | None,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> dict[str, Any]:
        return await self._post_derender(
            CHAT_DERENDER,
            {
                "model": model,
                "generate_response": generate_response,
                "prompt_tokens": len(prompt_token_ids),  # omitted, derender reports 0
                "prompt_token_ids": prompt_token_ids,
                "chat_request": chat_request,
            },
            trace,
        )

    async def derender_completions(
        self,
        generate_responses: list[dict[str, Any]],
        *,
        prompt_token_ids: Sequence[Sequence[int]],
        completion_request: dict[str, Any],
        model: str | None,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> dict[str, Any]:
        return await self._post_derender(
            COMPLETIONS_DERENDER,
            {
                "model": model,
                "generate_responses": generate_responses,
                "prompt_tokens": [len(ids) for ids in prompt_token_ids],
                "prompt_token_ids": prompt_token_ids,
                "completion_request": completion_request,
            },
            trace,
        )

    def chunk_slot(self) -> AsyncContextManager[None]:
        """Held around a streaming chunk's derender, outside its deadline: a single client waits for
        nothing; ``RenderPool`` queues past its window (render/window.py)."""
        return contextlib.nullcontext()

    async def derender_chunk(
        self,
        kind: TokenKind,
        generate_chunk: dict[str, Any],
        *,
        stream_state: StreamState,
        prompt_tokens: int,
        prompt_token_ids: Sequence[int] | None,
        request: dict[str, Any] | None,
        model: str | None,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Derender one generate event with the previous state; return ``(chunk, next_state)``.

        ``prompt_token_ids`` None leaves them out (a plain-path call after the first,
        ``derender/payload.py``), and so does ``request`` None (a plain-path call that reads none
        of it); ``prompt_tokens`` is always sent, for usage.
        """
        body: dict[str, Any] = {
            "stream": True,
            "model": model,
            "generate_chunk": generate_chunk,
            "stream_state": stream_state,
            "prompt_tokens": prompt_tokens,
        }
        if prompt_token_ids is not None:
            body["prompt_token_ids"] = prompt_token_ids
        if request is not None:
            body["chat_request" if kind == "chat" else "completion_request"] = request
        # Within the session's bound of the chunk (derender/session.py), as in ``RenderPool``.
        out = await self._post_derender(CHAT_DERENDER if kind == "chat" else COMPLETIONS_DERENDER, body, trace,
                                        chunk=True)
        chunk = out.get("chunk")
        if not isinstance(chunk, dict):
            raise DerenderError("derender answered without a chunk")
        return chunk, out.get("stream_state")

    # The state goes back to the sidecar as it came: kept as its JSON between calls.
    kept = staticmethod(packed_state)

    async def health(self) -> bool:
        try:
            response = await self._client.get(self._base_url + "/health", timeout=self._timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200


def _has_token_ids(req: dict[str, Any]) -> bool:
    ids = req.get("token_ids")
    return isinstance(ids, list) and bool(ids) and all(isinstance(t, int) for t in ids)


def _check_generate_requests(rendered: list[Any]) -> None:
    """Raise ``RenderUnavailable`` unless each item is a GenerateRequest the pipeline can run.

    The RFC's "invalid structure" falls back like an unreachable sidecar: the pipeline reads
    ``request_id`` (engine request ids, logs) and ``sampling_params`` (budgets, admission) of
    every prompt, and an answer without them would fail later as a 500 instead.
    """
    for req in rendered:
        try:
            msgspec.convert(req, GenerateRequest)
        except msgspec.ValidationError as exc:
            ids = not isinstance(req, dict) or not _has_token_ids(req)
            raise RenderUnavailable(
                f"render answered an unusable GenerateRequest: {exc}", reason="no_token_ids" if ids else "malformed"
            ) from None
