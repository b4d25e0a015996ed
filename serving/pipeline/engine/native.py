"""The native path: a request served by an engine's own OpenAI API instead of token-only.

Taken when the token-only path cannot serve a request exactly (``native_reason``): render is
disabled; ``echo``; the Responses and Anthropic Messages APIs, which have no derender; stop
strings, structured output / guided decoding or a forced tool choice when no token-only engine
of the model loads a tokenizer (a tokenizer-loaded engine takes those token-only); the local
tokenizer fallback lacking render's metadata; an engine without token-only generate; a
streaming request when the sidecar has no streaming derender (older than vLLM 0.27, as the
version probe records in ``RenderView.streaming_derender``). Only
instances declaring ``native_openai`` serve it. With obfuscation on, the engines' weights are
permuted and their own tokenizer would produce garbage, so such requests are refused (400).

The body goes to the engine as the client sent it, and the engine's answer comes back as is:
JSON, or the SSE byte stream relayed chunk by chunk.
"""

from __future__ import annotations

import json
import logging
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping

import httpx

from serving.pipeline.errors import EngineBusy, EngineError, EngineLacksCapability, UpstreamRequestError, error_body
from serving.pipeline.http import Upstream
from serving.pipeline.http11 import StreamReply, loads
from serving.pipeline.placement.filters import eligible_instances, union_role
from serving.pipeline.protocol import ApiKind
from serving.pipeline.snapshot import FleetSnapshot, InstanceView
from serving.pipeline.sse import DONE, frame

logger = logging.getLogger(__name__)

NATIVE_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


def engine_tokenizer_feature(kind: ApiKind, body: Mapping[str, Any]) -> str | None:
    """The feature of ``body`` that needs a tokenizer on the engine, or None.

    Stop strings are matched on detokenized text, structured output compiles a grammar over the
    vocabulary and a forced tool choice is a grammar too: a ``--tokens-only`` engine refuses all
    three (vllm-protocol.md section 7, item 8).
    """
    stop = body.get("stop")
    if stop and (isinstance(stop, str) or any(isinstance(s, str) and s for s in stop)):
        return "stop_strings"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object", "structural_tag", "grammar"):
        return "structured_output"
    if body.get("structured_outputs") or any(k.startswith("guided_") and body.get(k) for k in body):
        return "structured_output"
    choice = body.get("tool_choice")
    if kind == "chat" and (choice == "required" or isinstance(choice, dict)):
        return "forced_tool_choice"
    return None


def native_reason(kind: ApiKind, body: Mapping[str, Any], snapshot: FleetSnapshot, model: str) -> str | None:
    """Why ``body`` must take the native path before render, or None for token-only."""
    if kind in ("responses", "messages"):
        return f"api:{kind}"
    if not snapshot.render.enable:
        return "render_disabled"
    if body.get("stream") and not snapshot.render.streaming_derender:
        # The sidecar derenders whole responses only: a stream's chunks would have nowhere to go.
        return "no_streaming_derender"
    if kind == "completions" and body.get("echo"):
        return "echo"
    feature = engine_tokenizer_feature(kind, body)
    if feature is not None and not any(i.tokenizer for i in union_role(eligible_instances(snapshot, model))):
        return feature
    return None


# What the client can do when a request of this reason finds no native path (refused or no engine).
NATIVE_HINTS = {
    "no_streaming_derender": "the render sidecar is older than vLLM 0.27 and cannot derender a stream; "
    "send the request with `stream: false`, or upgrade the sidecar",
}


def _raise_for_status(instance: InstanceView, status: int, body: Any) -> None:
    if status == 503:
        raise EngineBusy(f"{instance.name} is busy", instance=instance.name)
    shaped = isinstance(body, dict) and isinstance(body.get("error"), dict)
    if status in (403, 501) or (status == 404 and not shaped):
        raise EngineLacksCapability(f"{instance.name} has no native OpenAI API ({status})", instance=instance.name)
    if 400 <= status < 500:
        if shaped:
            raise UpstreamRequestError(status, body, source="native")
        raise EngineError(f"{instance.name} answered {status}: {str(body)[:200]}", instance=instance.name)
    raise EngineError(f"{instance.name} answered {status}: {str(body)[:200]}", instance=instance.name)


@dataclass
class NativeStream:
    """A relayed SSE body from an engine's own API; owns the upstream response until closed."""

    kind: ApiKind
    instance: InstanceView
    request_id: str
    response: StreamReply | httpx.Response
    stack: AsyncExitStack
    _started: bool = field(default=False, init=False)
    _closed: bool = field(default=False, init=False)

    @property
    def started(self) -> bool:
        return self._started

    async def frames(self) -> AsyncIterator[bytes]:
        self._started = True
        outcome = "ok"
        try:
            async for chunk in self.response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            # The status is already 200: end with an error event the client's SDK understands.
            outcome = "upstream_failed"
            err = EngineError(f"{self.instance.name} stream failed: {exc!r}", instance=self.instance.name)
            if self.kind == "messages":
                payload = {"type": "error", "error": {"type": "api_error", "message": err.public or err.message}}
                yield b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"
            else:
                yield frame(error_body(err)[1])
                yield DONE
        finally:
            await self.aclose()
            logger.info(
                "response request_id=%s kind=%s path=native stream=true instance=%s result=%s",
                self.request_id, self.kind, self.instance.name, outcome,
            )

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self.stack.aclose()


class NativeClient:
    """Calls one engine's own OpenAI API over the shared HTTP client."""

    def __init__(self, client: Upstream) -> None:
        self._client = client

    async def call(
        self, instance: InstanceView, kind: ApiKind, body: dict[str, Any], request_id: str, stack: AsyncExitStack
    ) -> dict[str, Any] | NativeStream:
        """Send ``body`` to ``instance``; a stream is returned only once the engine answered 200.

        ``stack`` holds what the call keeps (admission lease, load): a JSON answer closes it
        before returning, a stream takes it over.
        """
        url = instance.url + NATIVE_PATHS[kind]
        headers = {"X-Request-Id": request_id}
        try:
            if body.get("stream"):
                opened: AbstractAsyncContextManager[StreamReply | httpx.Response] = self._client.stream(
                    "POST", url, json=body, headers=headers
                )
                streamed = await stack.enter_async_context(opened)
                if streamed.status_code != 200:
                    raw = await streamed.aread()
                    _raise_for_status(instance, streamed.status_code, _json(raw))
                return NativeStream(kind, instance, request_id, streamed, stack.pop_all())
            response = await self._client.post(url, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise EngineError(f"{instance.name} unreachable: {exc!r}", instance=instance.name) from exc
        payload = _json(response.content)
        if response.status_code != 200:
            _raise_for_status(instance, response.status_code, payload)
        if not isinstance(payload, dict):
            raise EngineError(f"{instance.name} answered a malformed response", instance=instance.name)
        return payload


def _json(raw: bytes) -> Any:
    try:
        return loads(raw)
    except ValueError:
        return raw.decode(errors="replace")

