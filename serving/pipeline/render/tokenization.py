"""The tokenization service: an OpenAI request in, a ``TokenizedRequest`` out.

Render (the vLLM sidecar) is the source of truth. When render cannot be used (unreachable,
timed out, missing the capability, answering without usable ids: ``RenderUnavailable.reason``)
the request is tokenized with the served model's own files (``local_tokenizer``), built lazily
on the first such fallback. Errors render raises about the request itself (400/422, a 404
``NotFoundError``, context overflow), and its 413 and 429, reach the client unchanged and never
fall back (docs/render-faults.md has the whole table).

The local fallback builds exactly the GenerateRequest render would for the requests it accepts;
``local_unsupported`` names what it does not (tools, structured output, logprobs, multimodal or
templated extras, streaming), and those requests raise ``NeedsNative`` so the router sends them
to an engine's own OpenAI API rather than run a half-built token-only request. Its sampling
parameters include the model's generation_config.json defaults, as render's do. A chat for a
sidecar that runs a reasoning or tool parser is refused (503, ``Retry-After``): the local
derender has no vLLM parser and would answer differently.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

from serving.pipeline.errors import RenderUnavailable, RequestError
from serving.pipeline.json_codec import dumps, loads
from serving.pipeline.protocol import TokenKind
from serving.pipeline.render.client import RenderClient
from serving.pipeline.render.local_tokenizer import LocalTokenizer, LocalTokenizerUnavailable, local_tokenizer
from serving.pipeline.snapshot import ModelView
from serving.pipeline.tracing import NO_TRACE

# vLLM's CompletionRequest.max_tokens default (chat defaults to the room left in the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class TokenizedPrompt:
    """One prompt of a request, as token ids plus what generate needs besides them.

    Only semantic ids are kept: with obfuscation on, the physical ids are made where they are
    used (the engine boundary per engine call, placement's affinity lookup), from these or from
    a relay's replay ids, never stored on the request.

    Once its streams are open (``pack``), the rest of render's GenerateRequest is kept as its JSON
    bytes, for a relay to read again: a parsed reply held a silent stream's whole life cost
    about three times its JSON (its dicts, floats and key tables).
    """

    __slots__ = ("token_ids", "_request")

    # The very ids in ``generate_request``, never changed: render's in 4 bytes each (``_compact_ids``).
    token_ids: Sequence[int]
    _request: Mapping[str, Any] | bytes  # render's GenerateRequest, carried opaquely to generate

    def __init__(self, token_ids: Sequence[int], generate_request: Mapping[str, Any]) -> None:
        self.token_ids = token_ids
        self._request = generate_request

    def __repr__(self) -> str:
        return f"TokenizedPrompt(token_ids=<{len(self.token_ids)} ids>, generate_request={self.generate_request!r})"

    @property
    def generate_request(self) -> Mapping[str, Any]:
        """Render's GenerateRequest (parsed again, with the same ids, once ``pack`` kept it as JSON)."""
        if isinstance(self._request, bytes):
            request: dict[str, Any] = loads(self._request)
            request["token_ids"] = self.token_ids
            return request
        return self._request

    def pack(self) -> None:
        """Keep render's GenerateRequest as its JSON from now on, when it reads back exactly (a NaN
        would not: the parsed reply stays); its ids stay ``token_ids``, the very object."""
        request = self._request
        if isinstance(request, bytes) or request.get("token_ids") is not self.token_ids:
            return
        rest = {**request, "token_ids": None}  # the key keeps its place, so bodies stay byte for byte
        try:
            # Copied out: orjson's bytes keep its whole output buffer (derender/payload.py).
            packed = bytes(memoryview(dumps(rest)))
        except (TypeError, ValueError):
            return
        if loads(packed) == rest:
            self._request = packed

    @property
    def request_id(self) -> str:
        return str(self.generate_request["request_id"])

    @property
    def sampling_params(self) -> Mapping[str, Any]:
        return self.generate_request.get("sampling_params") or {}


@dataclass(frozen=True, slots=True)
class TokenizedRequest:
    """A whole request after render: one prompt for chat, one or more for completions."""

    kind: TokenKind
    model: str
    prompts: tuple[TokenizedPrompt, ...]
    tokenizer_source: str  # render | local
    fallback_reason: str | None = None  # RenderUnavailable.reason when tokenizer_source is local
    latency_ms: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)


def _compact_ids(rendered: dict[str, Any]) -> Sequence[int]:
    """Render's ids as 4-byte integers, in the reply sent on too (``json_codec.dumps`` writes a list),
    not 8 + 28 bytes an id; ids too big for that stay a list, for the request checks to refuse."""
    ids: Sequence[int] = rendered["token_ids"]
    try:
        ids = rendered["token_ids"] = array("i", ids)
    except (OverflowError, TypeError):
        pass
    return ids


class NeedsNative(Exception):
    """The local fallback cannot build this request exactly: serve it on the native path."""

    def __init__(self, reason: str, fallback_reason: str, *, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.fallback_reason = fallback_reason
        self.detail = detail or reason


# Keys the local fallback reproduces exactly; anything else with a value that is not its
# default needs render's metadata (parse context, structured outputs, logprob plumbing, ...).
_COMMON_KEYS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stream",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids",
    "ignore_eos", "min_tokens", "user", "skip_special_tokens", "return_token_ids", "request_id",
    "include_stop_str_in_output", "spaces_between_special_tokens", "priority",
})
_CHAT_KEYS = _COMMON_KEYS | {"messages", "max_completion_tokens", "parallel_tool_calls"}
_COMPLETIONS_KEYS = _COMMON_KEYS | {"prompt"}
_DEFAULT_VALUES: tuple[Any, ...] = (None, False, [], {}, "none")


def local_unsupported(kind: TokenKind, body: Mapping[str, Any]) -> str | None:
    """Why the local fallback cannot tokenize ``body`` exactly, or None when it can.

    Refused: streaming (its derender needs the sidecar too), any key outside the plain sampling
    set with a non-default value (tools, tool_choice, response_format, guided_*, logprobs,
    top_logprobs, logit_bias, echo, suffix, chat_template(_kwargs), add_generation_prompt,
    continue_final_message, ...), and chat messages other than system/user/assistant text
    without tool calls.
    """
    if body.get("stream"):
        return "stream"
    allowed = _CHAT_KEYS if kind == "chat" else _COMPLETIONS_KEYS
    for key, value in body.items():
        if key not in allowed and not any(value is d or value == d for d in _DEFAULT_VALUES):
            return f"param:{key}"
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "messages"
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
                return "messages"
            if m.get("tool_calls") or set(m) - {"role", "content", "name"}:
                return "messages"
            content = m.get("content")
            if not (content is None or isinstance(content, str) or (
                isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content)
            )):
                return "messages"
    return None


class RenderHealth:
    """Process-wide memory that render is down, so a dead sidecar costs one failed connect, not one per request.

    After render refused a connection (nothing listens: it is down or restarting), or timed out
    ``timeouts_to_down`` times in a row with no success between, requests go straight to the
    local tokenizer for ``cooldown_s`` (fallback reason ``render_down``); the first request after
    that tries render again, and one success clears the mark. One timeout alone marks nothing:
    it may be one slow request (a long prompt), and the whole process should not give up render's
    answers for it; a hung sidecar is still found after a few timeouts of concurrent requests.
    """

    def __init__(
        self, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic, *, timeouts_to_down: int = 3
    ) -> None:
        self.cooldown_s = cooldown_s
        self.timeouts_to_down = timeouts_to_down
        self._clock = clock
        self._down_until = 0.0
        self._timeouts = 0  # consecutive, since the last success

    def skip(self) -> bool:
        return self._clock() < self._down_until

    @property
    def retry_after_s(self) -> int:
        """Seconds a client refused while render is away should wait (``Retry-After``)."""
        return max(1, round(self.cooldown_s))

    def mark(self, exc: RenderUnavailable | None) -> None:
        if exc is None:
            self._down_until = 0.0
            self._timeouts = 0
        elif exc.reason == "unreachable":
            self._down_until = self._clock() + self.cooldown_s
        elif exc.reason == "timeout":
            self._timeouts += 1
            if self._timeouts >= self.timeouts_to_down:
                self._timeouts = 0
                self._down_until = self._clock() + self.cooldown_s


class TokenizationService:
    """Tokenizes one request: render first, the model's local tokenizer when render is unusable."""

    def __init__(
        self,
        render: RenderClient,
        model: ModelView,
        *,
        health: RenderHealth | None = None,
        loader: Callable[[str], LocalTokenizer] = local_tokenizer,
    ) -> None:
        self.render = render
        self.model = model
        self.health = health or RenderHealth()
        self._loader = loader

    async def tokenize(
        self, kind: TokenKind | Literal["messages", "responses"], body: dict[str, Any], request_id: str,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> TokenizedRequest:
        """Return the request's prompts (a Messages request's as a chat's: the chat token path
        serves it, ``apis/messages.py``); raise ``UpstreamRequestError`` for render's verdicts on the
        request, ``NeedsNative`` when only the native path can serve it exactly, and
        ``RenderUnavailable`` when neither render nor the local tokenizer is usable."""
        start = time.perf_counter()
        if self.health.skip():
            down = RenderUnavailable("render was unreachable moments ago", reason="render_down")
            return await self._fallback(kind, body, request_id, down, start)
        try:
            if kind == "chat":
                rendered = [await self.render.render_chat(body, request_id, trace)]
            elif kind == "messages":
                rendered = [await self.render.render_messages(body, request_id, trace)]
            elif kind == "responses":
                rendered = [await self.render.render_responses(body, request_id, trace)]
            else:
                rendered = await self.render.render_completions(body, request_id, trace)
        except RenderUnavailable as exc:
            self.health.mark(exc)
            return await self._fallback(kind, body, request_id, exc, start)
        self.health.mark(None)
        prompts = tuple(TokenizedPrompt(_compact_ids(r), r) for r in rendered)
        token_kind: TokenKind = "completions" if kind == "completions" else "chat"
        return TokenizedRequest(token_kind, self.model.name, prompts, "render", None,
                                (time.perf_counter() - start) * 1000)

    async def local_tokenizer(self) -> LocalTokenizer:
        # Building reads and parses files: off the event loop, once per model directory.
        return await asyncio.to_thread(self._loader, self.model.model_path)

    async def _fallback(
        self, kind: TokenKind | Literal["messages", "responses"], body: dict[str, Any], request_id: str,
        cause: RenderUnavailable, start: float,
    ) -> TokenizedRequest:
        reason = cause.reason
        if kind == "messages" or kind == "responses":
            # Only render converts these APIs as vLLM does (a sidecar older than 0.33 lacks the route).
            raise NeedsNative(f"api:{kind}", reason, detail=f"render:{reason}") from cause
        unsupported = local_unsupported(kind, body)
        if unsupported is not None:
            # The reason is the category (``local:param``, a metric label); which key it was, a
            # name the client chose, goes to the log only.
            raise NeedsNative(f"local:{unsupported.partition(':')[0]}", reason, detail=f"local:{unsupported}") from cause
        parsers = [p for p in (self.model.reasoning_parser, self.model.tool_parser) if p]
        if kind == "chat" and parsers:
            # A sidecar with parsers answers every chat through them: the reasoning parser splits
            # reasoning from content, and vLLM's parser engine turns skip_special_tokens off for
            # every chat it parses. The local derender has no vLLM parser; its answer would carry
            # the reasoning inside ``content``. Refused, with when to come back, rather than
            # answered differently.
            refused = RenderUnavailable(
                f"{cause.message}; the local fallback cannot run the sidecar's parsers {parsers}",
                reason=reason, retry_after_s=self.health.retry_after_s,
            )
            refused.public = ("The tokenization service is unavailable and this model's chat answers need its "
                              "reasoning or tool parser; retry later.")
            raise refused from cause
        try:
            tok = await self.local_tokenizer()
            rendered = local_render(tok, kind, body, request_id, self.model)
        except LocalTokenizerUnavailable as exc:
            raise RenderUnavailable(f"{cause.message}; no local fallback: {exc}", reason=reason) from exc
        prompts = tuple(TokenizedPrompt(r["token_ids"], r) for r in rendered)
        return TokenizedRequest(kind, self.model.name, prompts, "local", reason, (time.perf_counter() - start) * 1000)


# vLLM's sampling_params._SAMPLING_EPS and _MAX_TEMP: below the first is greedy, a positive
# temperature below the second is raised to it.
_SAMPLING_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2

# vLLM's ``_DEFAULT_SAMPLING_PARAMS`` (chat and completions alike): the OpenAI defaults, used
# where neither the request nor the model's generation config says otherwise.
_OPENAI_DEFAULTS: dict[str, float | int] = {
    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
}


def _max_tokens(
    kind: TokenKind, body: Mapping[str, Any], prompt_len: int, max_model_len: int, default: int | None = None
) -> int:
    """vLLM's resolution (``get_max_tokens``): the client's value, else 16 for a completion (its
    schema's default, an explicit null included: ``normalize_null_max_tokens``), else the
    generation config's ``max_new_tokens`` (``default``); never more than the room left."""
    room = max_model_len - prompt_len
    if room <= 0:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
            param="messages" if kind == "chat" else "prompt",
        )
    requested = body.get("max_completion_tokens") if kind == "chat" else None
    if requested is None:
        requested = body.get("max_tokens")
    if requested is None and kind == "completions":
        requested = COMPLETIONS_DEFAULT_MAX_TOKENS
    elif requested is None:
        return room if default is None else min(default, room)
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        raise RequestError("max_tokens must be a positive integer.", param="max_tokens")
    if requested > max_model_len:
        raise RequestError(
            f"max_tokens={requested} cannot be greater than max_model_len={max_model_len}.", param="max_tokens"
        )
    return min(requested, room)


def skip_special_tokens(body: Mapping[str, Any], defaults: Mapping[str, Any]) -> bool:
    """The request's ``skip_special_tokens``, else the generation config's, else True (vLLM's order)."""
    value = body.get("skip_special_tokens")
    if value is None:
        value = defaults.get("skip_special_tokens", True)
    return value is not False


def _sampling_params(
    kind: TokenKind, body: Mapping[str, Any], prompt_len: int, max_model_len: int,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Render's sampling parameters for ``body``: the request's value, else the model's
    generation default (``defaults``: ``LocalTokenizer.generation_defaults``), else OpenAI's
    (``to_sampling_params``' "user -> server default -> OpenAI default")."""
    defaults = defaults or {}
    stop = body.get("stop") or []
    chosen = {
        name: body[name] if body.get(name) is not None else defaults.get(name, fallback)
        for name, fallback in _OPENAI_DEFAULTS.items()
    }
    temperature, top_p, top_k, min_p = (float(chosen["temperature"]), float(chosen["top_p"]), int(chosen["top_k"]),
                                        float(chosen["min_p"]))
    # SamplingParams.__post_init__'s normalizations, so the engine sees the same values either way.
    if 0 < temperature < _MIN_TEMPERATURE:
        temperature = _MIN_TEMPERATURE
    if temperature < _SAMPLING_EPS:  # greedy: the other sampling knobs are off
        top_p, top_k, min_p = 1.0, 0, 0.0
    seed = body.get("seed")
    params: dict[str, Any] = {
        "n": int(body.get("n") or 1),
        "presence_penalty": float(chosen["presence_penalty"]),
        "frequency_penalty": float(chosen["frequency_penalty"]),
        "repetition_penalty": float(chosen["repetition_penalty"]),
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "seed": None if seed == -1 else seed,
        "stop": [stop] if isinstance(stop, str) else list(stop),
        "stop_token_ids": list(body.get("stop_token_ids") or []),
        "ignore_eos": bool(body.get("ignore_eos")),
        "max_tokens": _max_tokens(kind, body, prompt_len, max_model_len, defaults.get("max_tokens")),
        "min_tokens": int(body.get("min_tokens") or 0),
        "skip_special_tokens": skip_special_tokens(body, defaults),
        "include_stop_str_in_output": bool(body.get("include_stop_str_in_output")),
        "output_kind": 1 if body.get("stream") else 2,
        "skip_clone": True,
    }
    return params


def _text(content: Any) -> Any:
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content)
    return content


def local_render(
    tok: LocalTokenizer, kind: TokenKind, body: Mapping[str, Any], request_id: str, model: ModelView
) -> list[dict[str, Any]]:
    """Build the GenerateRequest(s) render would, for a request ``local_unsupported`` accepts."""
    if kind == "chat":
        messages = [{**m, "content": _text(m.get("content"))} for m in body["messages"]]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=None)
        prompts = [tok.encode(text, add_special_tokens=False)]
        ids = [f"chatcmpl-{request_id}"]
    else:
        prompt = body.get("prompt")
        prompts = [_prompt_ids(tok, p) for p in _prompt_list(prompt)]
        ids = [f"cmpl-{request_id}"] if len(prompts) == 1 else [f"cmpl-{request_id}-{i}" for i in range(len(prompts))]
    out = []
    for rid, token_ids in zip(ids, prompts, strict=True):
        if not token_ids:
            raise RequestError("The prompt is empty.", param="prompt" if kind != "chat" else "messages")
        out.append({
            "request_id": rid,
            "token_ids": token_ids,
            "sampling_params": _sampling_params(kind, body, len(token_ids), model.max_model_len, tok.generation_defaults),
            "model": body.get("model") or model.name,
            "output_mode": "tokens",
            "stream": bool(body.get("stream")),
            "stream_options": None,
            "priority": int(body.get("priority") or 0),
            "kv_transfer_params": None,
        })
    return out


def _prompt_list(prompt: Any) -> list[Any]:
    """A completions prompt: a string, a list of strings, a list of ids or a list of id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        return prompt
    raise RequestError("prompt must be a string, a list of strings or token ids.", param="prompt")


def _prompt_ids(tok: LocalTokenizer, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return tok.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise RequestError("prompt must be a string, a list of strings or token ids.", param="prompt")
