"""Streaming derender of a plain stream in the coordinator: the sidecar's answer without the call.

An operator option (``RenderConfig.local_stream_detokenize``, off by default: the RFC puts
derender in the sidecar). For a stream that qualifies (``qualifies``: chat or completions, no
tool or reasoning parser on the model, no logprobs, no echo, no obfuscation) each chunk is
derendered here with the model's own tokenizer files, by the algorithm vLLM 0.33's sidecar runs on
its plain path (``OnlineDerenderer.derender_chat_stream`` / ``derender_completion_stream``):

- a choice's first call seeds the decode window from the prompt's last 7 tokens (5 of context,
  read offset after all of them), as the engine primes its incremental detokenizer;
- the token that stopped generation is left out (EOS unless ``ignore_eos``, a ``stop_token_ids``
  entry, the model's other EOS ids, or the id the engine reported), unless
  ``include_stop_str_in_output``;
- each remaining id is decoded incrementally: the text of the window from the prefix offset,
  minus the text up to the read offset, emitted only when it grew and does not end in U+FFFD
  (an unfinished multi-byte character); the window is then trimmed to the prefix offset;
- the chunk and the carried ``stream_state`` have the sidecar's shape, key for key, so the
  session's commit, relay and hold-back rules (and a later sidecar call) read them unchanged.

Stop strings are not derender's business on either side: the engine stops, and the session's
hold-back (derender/holdback.py) cuts the text, as it does after a sidecar call.

``tests/integration/test_local_stream_diff_real.py`` compares this with the real sidecar, byte
for byte, over generated id sequences; that test is what allows the option.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, AsyncContextManager

from serving.pipeline.derender.payload import StreamState, unpacked_state
from serving.pipeline.protocol import TokenKind
from serving.pipeline.render.local_tokenizer import LocalTokenizerUnavailable, local_tokenizer
from serving.pipeline.snapshot import ModelView, RenderView
from serving.pipeline.tracing import NO_TRACE

logger = logging.getLogger(__name__)

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens of context before the read offset.
SEED_OFFSET = 5
# How many sampled ids the state carries for logprob corrections (vLLM's _LOGPROB_CONTEXT_WINDOW).
LOGPROB_CONTEXT = 4


def qualifies(kind: str, body: Mapping[str, Any], *, parsers: bool, obfuscation: bool) -> bool:
    """Whether a stream's derender may run here: nothing in it needs more than the plain path.

    Logprobs (chat ``logprobs``/``top_logprobs``, a completion's ``logprobs``, 0 included), an
    echoed completion, a model whose sidecar runs a tool or reasoning parser, and obfuscation
    keep the sidecar.
    """
    if kind not in ("chat", "completions") or parsers or obfuscation:
        return False
    logprobs = body.get("logprobs")
    if not (logprobs is None or logprobs is False) or body.get("top_logprobs") is not None:
        return False
    return not body.get("echo") and not body.get("prompt_logprobs")


def model_eos_ids(root: Path) -> frozenset[int]:
    """The generation config's ``eos_token_id`` (one id or a list), as the sidecar reads it."""
    from transformers import AutoConfig, GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(str(root), local_files_only=True)
    except OSError:
        try:
            config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(root), local_files_only=True))
        except (OSError, ValueError):
            return frozenset()
    eos = config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class LocalStreamDerenderer:
    """Derenders one model's stream chunks like its sidecar's plain path; stateless between calls.

    Stands in for ``RenderClient`` in a ``StreamingRenderSession`` (same ``derender_chunk`` and
    ``timeout_s``), so the session's committed-state rules hold unchanged.
    """

    def __init__(self, hf: Any, eos_token_id: int | None, eos_ids: frozenset[int], *, timeout_s: float = 30.0,
                 clock: Any = time.time) -> None:
        self._hf = hf
        self._vocab = len(hf)
        self._eos = eos_token_id
        self._model_eos = eos_ids | ({eos_token_id} if eos_token_id is not None else frozenset())
        self.timeout_s = timeout_s
        self._clock = clock
        self.calls = 0

    # -- the decode ------------------------------------------------------------------------------

    def _tokens(self, ids: list[int], skip: bool) -> list[str]:
        return [t or "" for t in self._hf.convert_ids_to_tokens(ids, skip_special_tokens=skip)]

    def seed(self, prompt_ids: Sequence[int] | None, skip: bool) -> dict[str, Any]:
        if not prompt_ids:
            return _state([], 0, 0)
        window = self._tokens(list(prompt_ids[-SEED_OFFSET - 2:]), skip)
        return _state(window, max(len(window) - SEED_OFFSET, 0), len(window))

    def decode(self, ids: list[int], state: dict[str, Any], skip: bool) -> tuple[str, dict[str, Any]]:
        """The text ``ids`` add after ``state``'s window, and the window after them."""
        window: list[str] = list(state.get("prev_tokens") or ())
        prefix, read = int(state.get("prefix_offset") or 0), int(state.get("read_offset") or 0)
        text: list[str] = []
        to_string = self._hf.convert_tokens_to_string
        for token_id in ids:
            new = self._tokens([token_id], skip) if 0 <= token_id < self._vocab else [""]
            start = min(prefix, read, len(window))
            tail = window[start:] + new
            before = to_string(tail[prefix - start:read - start])
            after = to_string(tail[prefix - start:])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                text.append(after[len(before):])
                prefix, read = read, len(window) + len(new)
            # Nothing before the prefix offset is read again: keep the window from there.
            window = (window + new)[prefix:]
            read -= prefix
            prefix = 0
        return "".join(text), {**state, "prev_tokens": window, "prefix_offset": prefix, "read_offset": read}

    def drop_stop_token(self, ids: list[int], finish: Any, stop_reason: Any,
                        request: Mapping[str, Any] | None) -> tuple[list[int], Any]:
        """The ids to decode and the stop reason, as the sidecar's ``_drop_stop_token`` leaves them."""
        if finish != "stop" or isinstance(stop_reason, str) or not ids:
            return ids, stop_reason
        last = ids[-1]
        if stop_reason is None:
            honor_eos = request is None or not request.get("ignore_eos")
            if honor_eos and last == self._eos:
                stopped = True
            elif (request is not None and last in (request.get("stop_token_ids") or ())) or (
                    honor_eos and last in self._model_eos):
                stopped, stop_reason = True, last
            else:
                stopped = False
        else:
            stopped = last == stop_reason
        if not stopped or (request is not None and request.get("include_stop_str_in_output")):
            return ids, stop_reason
        return ids[:-1], stop_reason

    def kept(self, state: dict[str, Any] | None) -> StreamState:
        """Its state is read on the next call: kept as the dict it is."""
        return state

    # -- the chunk -------------------------------------------------------------------------------

    def chunk_slot(self) -> AsyncContextManager[None]:
        """No window: nothing is sent anywhere (render/window.py is for sidecars)."""
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
        """``RenderClient.derender_chunk``'s answer, made here (a plain path only: ``qualifies``;
        ``trace`` is unused: no call leaves the process)."""
        self.calls += 1
        # Its own states come back as its dicts (``kept``); a packed one only from a sidecar's.
        stream_state = unpacked_state(stream_state)
        choices = generate_chunk.get("choices") or []
        if len(choices) > 1:
            raise ValueError("derender expects at most one choice per chunk")
        skip = request is None or request.get("skip_special_tokens") is not False
        if stream_state is None:
            seed_ids = prompt_token_ids if prompt_token_ids is not None else generate_chunk.get("prompt_token_ids")
            stream_state = self.seed(seed_ids, skip)
        with_ids = request is not None and bool(request.get("return_token_ids"))
        state = stream_state
        out_choices: list[dict[str, Any]] = []
        for choice in choices:
            delta_ids = list(choice.get("token_ids") or ())
            finish = choice.get("finish_reason")
            text_ids, stop_reason = self.drop_stop_token(delta_ids, finish, choice.get("stop_reason"), request)
            text, state = self.decode(text_ids, state, skip)
            context = (list(stream_state.get("logprob_context_token_ids") or ()) + delta_ids)[-LOGPROB_CONTEXT:]
            if kind == "chat":
                role = not state.get("role_sent")
                state = {**state, "role_sent": True, "logprob_context_token_ids": context}
                out_choices.append({
                    "index": choice.get("index", 0),
                    "delta": {"role": "assistant" if role else None, "content": text or None, "reasoning": None},
                    "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason,
                    "token_ids": choice.get("token_ids") if with_ids else None, "weight_versions": None,
                })
            else:
                offset = int(stream_state.get("logprob_text_offset") or 0) + len(text)
                state = {**state, "logprob_context_token_ids": context, "logprob_text_offset": offset}
                out_choices.append({
                    "index": choice.get("index", 0), "text": text, "logprobs": None,
                    "finish_reason": finish, "stop_reason": stop_reason,
                    "prompt_token_ids": generate_chunk.get("prompt_token_ids") if with_ids else None,
                    "token_ids": choice.get("token_ids") if with_ids else None, "weight_versions": None,
                })
        usage = None
        engine_usage = generate_chunk.get("usage")
        if isinstance(engine_usage, dict):
            completion = engine_usage.get("completion_tokens") or 0
            usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion,
                     "completion_tokens": completion, "prompt_tokens_details": None,
                     "completion_tokens_details": None}
        head = {"id": generate_chunk.get("request_id"),
                "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": int(self._clock()), "model": model, "choices": out_choices, "usage": usage,
                "system_fingerprint": None}
        if kind == "chat":
            head |= {"prompt_token_ids": None, "prompt_text": None}
        return head | {"metrics": generate_chunk.get("metrics"), "kv_transfer_params": None}, state


def _state(window: list[str], prefix: int, read: int) -> dict[str, Any]:
    """A fresh ``DerenderStreamState`` as the sidecar serializes it (parser fields empty)."""
    return {"prev_tokens": window, "prefix_offset": prefix, "read_offset": read, "role_sent": False,
            "logprob_context_token_ids": [], "logprob_text_offset": 0, "output_token_ids": [],
            "output_chunk_lens": [], "tools_streamed": False, "last_tool_call_ids": []}


def local_stream_derenderer(model_path: str, timeout_s: float) -> LocalStreamDerenderer:
    """Built from the model directory the local fallback reads (call it off the event loop)."""
    tok = local_tokenizer(model_path)
    return LocalStreamDerenderer(tok.hf, tok.hf.eos_token_id, model_eos_ids(Path(model_path)), timeout_s=timeout_s)


# One derenderer per model directory, built on the first qualifying stream; a directory without
# usable tokenizer files is remembered, and its streams keep the sidecar.
_built: dict[str, LocalStreamDerenderer | None] = {}


async def stream_derenderer(render: RenderView, model: ModelView | None, kind: TokenKind,
                            body: Mapping[str, Any]) -> LocalStreamDerenderer | None:
    """The coordinator's derenderer for this stream, or None where the sidecar derenders it."""
    if not render.local_stream_detokenize or model is None:
        return None
    parsers = bool(model.tool_parser or model.reasoning_parser)
    if not qualifies(kind, body, parsers=parsers, obfuscation=render.obfuscation):
        return None
    path = model.model_path
    if path not in _built:
        try:
            # Reading the files and building the tokenizer takes tens of ms to seconds: off the loop, once.
            _built[path] = await asyncio.to_thread(local_stream_derenderer, path, render.timeout_s)
        except (LocalTokenizerUnavailable, OSError, ValueError) as exc:
            logger.warning("local_stream_detokenize model_path=%s unavailable=%s: streams keep the sidecar", path, exc)
            _built[path] = None
    return _built[path]
