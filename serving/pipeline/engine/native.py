"""The native path: a request served by an engine's own OpenAI API instead of token-only.

Taken when the token-only path cannot serve a request exactly (``native_reason``): render is
disabled; ``echo``; the Responses and Anthropic Messages APIs, which have no derender; stop
strings, structured output / guided decoding or a forced tool choice when no token-only engine
of the model loads a tokenizer (a tokenizer-loaded engine takes those token-only); the local
tokenizer fallback lacking render's metadata; an engine without token-only generate; a
streaming request when the sidecar has no streaming derender (older than vLLM 0.27, as the
version probe records in ``RenderView.streaming_derender``), and every request when it is older
than 0.24 (no derender, ``no_derender``) or 0.23 (no token-in render, ``no_token_in``). Union
instances declaring ``native_openai`` serve it, and on fleets of P/D pairs that declare it, the
guide's proxy flow through both (``topologies/native_pd.py``). With obfuscation on, the engines' weights are
permuted and their own tokenizer would produce garbage, so such requests are refused (400).

The body goes to the engine as the client sent it, and the engine's answer comes back as is:
JSON, or the SSE byte stream relayed chunk by chunk.

Accounting (``NativeEstimate``): admission and the key's tokens per minute hold what the
engine may really process, as on the token-only path: each prompt's tokens plus ``n`` times the
output bound vLLM resolves (``min(requested, max_model_len - prompt)``, the whole room left when
the API's own field is absent), read from the field each API's schema uses
(``NATIVE_OUTPUT_FIELDS``). Prompt tokens are render's count when the request was rendered
(or render answers a count-only render call), else an upper bound from the body's size
(``prompt_bound``). A JSON answer's deadline scales with that bound (``ReplyDeadline``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping

import httpx

from serving.pipeline import tracing
from serving.pipeline.apis.responses import native_responses_reason, responses_tokenizer_feature
from serving.pipeline.engine.client import ReplyDeadline, raise_for_status
from serving.pipeline.errors import EngineError, error_body
from serving.pipeline.http11 import Http11Client, StreamReply
from serving.pipeline.json_codec import dumps, loads
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
    if kind == "messages":
        return _messages_tokenizer_feature(body)
    if kind == "responses":
        return responses_tokenizer_feature(body)
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
    if kind == "responses":
        reason = native_responses_reason(body)
        if reason is not None:
            return reason
    if not snapshot.render.enable:
        return "render_disabled"
    if not snapshot.render.token_in:
        # Below vLLM 0.23 the sidecar has no render route: token-only would have no ids to send.
        return "no_token_in"
    if not snapshot.render.derender:
        # Below 0.24 there is no derender: token-only ids would have no way back to text. The local
        # tokenizer cannot stand in for it either (the RFC: a request without render's full
        # metadata keeps the native path), so the whole request goes native.
        return "no_derender"
    if body.get("stream") and not snapshot.render.streaming_derender:
        # The sidecar derenders whole responses only: a stream's chunks would have nowhere to go.
        return "no_streaming_derender"
    if kind == "completions" and body.get("echo"):
        return "echo"
    feature = engine_tokenizer_feature(kind, body)
    if feature is not None and not any(i.tokenizer for i in union_role(eligible_instances(snapshot, model))):
        return feature
    return None


def _messages_tokenizer_feature(body: Mapping[str, Any]) -> str | None:
    """``engine_tokenizer_feature`` for a Messages body, in the fields vLLM converts to chat's."""
    if any(isinstance(s, str) and s for s in body.get("stop_sequences") or ()):
        return "stop_strings"
    output = body.get("output_config")
    if isinstance(output, dict) and isinstance(output.get("format"), dict):
        return "structured_output"
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("any", "tool") and body.get("tools"):
        return "forced_tool_choice"
    return None


# The field each engine API reads its output bound from (vLLM 0.33's schemas), and its default
# when absent: a number, or None for "the room left in the context". Only these count: vLLM's
# Responses schema ignores ``max_tokens``, so a body with ``max_tokens: 1`` and no
# ``max_output_tokens`` generates up to the context there.
NATIVE_OUTPUT_FIELDS: dict[ApiKind, tuple[tuple[str, ...], int | None]] = {
    "chat": (("max_completion_tokens", "max_tokens"), None),  # the first present wins (vLLM's order)
    "completions": (("max_tokens",), 16),  # CompletionRequest.max_tokens = 16
    "responses": (("max_output_tokens",), None),
    "messages": (("max_tokens",), None),  # required (request_checks)
}


def requested_output(kind: ApiKind, body: Mapping[str, Any]) -> int | None:
    """The output bound per choice ``body`` asks of the engine's own API (request_checks made it
    an int), or None when the engine may generate up to its context."""
    names, default = NATIVE_OUTPUT_FIELDS[kind]
    for name in names:
        value = body.get(name)
        if value is not None:
            if kind == "completions" and value == 0 and body.get("echo"):
                return 1  # echo without generation: vLLM still runs one step (max_tokens=1)
            return int(value)
    return default


def sequences(kind: ApiKind, body: Mapping[str, Any]) -> int:
    """How many sequences the engine decodes per prompt: ``n`` on chat and completions; the
    Responses and Messages schemas have no ``n`` (vLLM ignores it there): one."""
    return int(body.get("n") or 1) if kind in ("chat", "completions") else 1


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogatepass"))


def prompt_bound(kind: ApiKind, body: Mapping[str, Any]) -> tuple[int, ...]:
    """Each prompt's tokens estimated from the body alone, erring high, for when render cannot count.

    A byte-level BPE token (the models vLLM serves) covers at least one byte of text, so a
    text's UTF-8 length bounds its tokens; for chats the whole body's JSON is counted, whose
    keys and quotes around each message outweigh the few tokens a chat template adds. Token-id
    prompts count exactly. (Media given by URL, images or audio, is what this undercounts.)
    """
    prompt = body.get("prompt")
    if kind == "completions" and isinstance(prompt, (str, list)):
        if isinstance(prompt, str):
            return (_utf8_len(prompt) + 1,)  # + the BOS a tokenizer may add
        if prompt and all(isinstance(t, int) for t in prompt):
            return (len(prompt),)
        return tuple(
            _utf8_len(p) + 1 if isinstance(p, str) else len(p) if isinstance(p, list) else _utf8_len(json.dumps(p))
            for p in prompt
        ) or (1,)
    return (_utf8_len(json.dumps(body, ensure_ascii=False)),)


@dataclass(frozen=True, slots=True)
class NativeEstimate:
    """What one native request may make an engine process, per instance context length."""

    prompts: tuple[int, ...]  # tokens per prompt: exact (render) or an upper bound
    requested: int | None  # the output bound asked per choice; None: up to the context
    n: int  # sequences per prompt
    source: str  # render | local | bound: where the prompt counts came from (logs)

    @classmethod
    def of(cls, kind: ApiKind, body: Mapping[str, Any], prompts: Sequence[int], source: str) -> NativeEstimate:
        return cls(tuple(max(1, p) for p in prompts) or (1,), requested_output(kind, body), sequences(kind, body), source)

    def _output(self, prompt: int, max_model_len: int) -> int:
        room = max(1, max_model_len - prompt)
        return room if self.requested is None else max(1, min(self.requested, room))

    def output(self, max_model_len: int) -> int:
        """The longest output one choice may have (what the reply's deadline scales with)."""
        return max(self._output(min(p, max_model_len - 1), max_model_len) for p in self.prompts)

    def tokens(self, max_model_len: int) -> int:
        """Prompt plus ``n`` x resolved output, summed over prompts: what admission holds. A
        prompt bound past the context counts as the context (the engine would refuse more)."""
        total = 0
        for p in self.prompts:
            prompt = min(p, max_model_len - 1)
            total += prompt + self.n * self._output(prompt, max_model_len)
        return total


# What the client can do when a request of this reason finds no native path (refused or no engine).
NATIVE_HINTS = {
    "no_token_in": "the render sidecar is older than vLLM 0.23 and cannot render token ids; upgrade the sidecar",
    "no_derender": "the render sidecar is older than vLLM 0.24 and cannot derender; upgrade the sidecar",
    "no_streaming_derender": "the render sidecar is older than vLLM 0.27 and cannot derender a stream; "
    "send the request with `stream: false`, or upgrade the sidecar",
}


# How ``raise_for_status`` names an engine's own API in what it raises.
NATIVE_STATUS = {"source": "native", "lacks": "native OpenAI API"}


@dataclass
class NativeStream:
    """A relayed SSE body from an engine's own API; owns the upstream response until closed."""

    kind: ApiKind
    instance: InstanceView
    request_id: str
    response: StreamReply
    stack: AsyncExitStack
    _closed: bool = field(default=False, init=False)

    async def frames(self) -> AsyncIterator[bytes]:
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
                yield b"event: error\ndata: " + dumps(payload) + b"\n\n"
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

    def __init__(self, client: Http11Client, *, deadline: ReplyDeadline | None = None) -> None:
        self._client = client
        # The token-only path's deadline for a whole reply (None: the shared client's read timeout).
        self.deadline = deadline

    async def call(
        self, instance: InstanceView, kind: ApiKind, body: dict[str, Any], request_id: str, stack: AsyncExitStack,
        *, max_output: int | None = None, trace: Mapping[str, str] = tracing.NO_TRACE,
    ) -> dict[str, Any] | NativeStream:
        """Send ``body`` to ``instance``; a stream is returned only once the engine answered 200.

        ``stack`` holds what the call keeps (admission lease, load): a JSON answer closes it
        before returning, a stream takes it over. ``max_output``: the output bound per choice the
        engine will resolve; a JSON answer may take as long as ``deadline`` gives it (a stream's
        chunks each get the shared client's read timeout instead).
        """
        url = instance.url + NATIVE_PATHS[kind]
        headers = tracing.with_trace({"X-Request-Id": request_id}, trace)
        try:
            if body.get("stream"):
                opened: AbstractAsyncContextManager[StreamReply] = self._client.stream(
                    "POST", url, json=body, headers=headers
                )
                streamed = await stack.enter_async_context(opened)
                if streamed.status_code != 200:
                    raw = await streamed.aread()
                    raise_for_status(instance, streamed.status_code, _json(raw), **NATIVE_STATUS)
                return NativeStream(kind, instance, request_id, streamed, stack.pop_all())
            if self.deadline is None:
                response = await self._client.post(url, json=body, headers=headers)
            else:
                # An engine's own API sends nothing until a JSON answer is whole: a flat read
                # timeout would cut a long healthy generation, trip the breaker and rerun it.
                timeout = self.deadline.timeout(self._client.timeout, max_output)
                response = await self._client.post(url, json=body, headers=headers, timeout=timeout)
        except httpx.ReadTimeout as exc:
            raise EngineError(f"{instance.name} gave no answer in time ({exc!r})", instance=instance.name) from exc
        except httpx.HTTPError as exc:
            raise EngineError(f"{instance.name} unreachable: {exc!r}", instance=instance.name) from exc
        payload = _json(response.content)
        if response.status_code != 200:
            raise_for_status(instance, response.status_code, payload, **NATIVE_STATUS)
        if not isinstance(payload, dict):
            raise EngineError(f"{instance.name} answered a malformed response", instance=instance.name)
        return payload


def _json(raw: bytes) -> Any:
    try:
        return loads(raw)
    except ValueError:
        return raw.decode(errors="replace")

