"""The local derender: generate responses into OpenAI responses with the model's own tokenizer.

Used only for requests tokenized locally (``render/tokenization.py``'s fallback when the sidecar
cannot be used), which ``local_unsupported`` limits to plain text without tools, reasoning or
logprobs, so decoding the ids is the whole derender.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from serving.pipeline.derender.holdback import StopHoldback, stop_strings
from serving.pipeline.render.local_tokenizer import LocalTokenizer
from serving.pipeline.render.tokenization import skip_special_tokens


@dataclass
class LocalDerenderer:
    """Turns generate responses into OpenAI responses with the local tokenizer (plain text only).

    Used only for requests tokenized locally, which ``local_unsupported`` limits to plain
    text without tools, reasoning or logprobs, so decoding the ids is the whole derender.
    """

    tok: LocalTokenizer
    created: Callable[[], int] = field(default=lambda: int(time.time()))

    def _text(
        self, prompt_ids: Sequence[int], ids: list[int], choice: Mapping[str, Any], body: Mapping[str, Any], skip: bool
    ) -> str:
        """The choice's text as derender makes it (``OnlineDerenderer._decode_output``): the stop
        token left out, decoded by vLLM's incremental detokenizer (``LocalTokenizer.decode_output``)
        and cut at the stop string the engine reported, as the streaming path cuts it."""
        text = self.tok.decode_output(list(prompt_ids), _without_stop_token(ids, choice, body, self.tok.eos_token_id),
                                      skip_special_tokens=skip)
        cut = StopHoldback(stop_strings(body), include_in_output=bool(body.get("include_stop_str_in_output")))
        return cut.feed(text, finished=True, stop_reason=choice.get("stop_reason"))  # the whole text, final

    def _usage(self, prompt: int, completion: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
                "prompt_tokens_details": None, "completion_tokens_details": None}

    def chat(self, response: Mapping[str, Any], *, prompt_ids: Sequence[int], body: Mapping[str, Any]) -> dict[str, Any]:
        skip = skip_special_tokens(body, self.tok.generation_defaults)
        with_ids = bool(body.get("return_token_ids"))
        choices = []
        for c in sorted(response.get("choices") or [], key=lambda c: c.get("index", 0)):
            ids = list(c.get("token_ids") or [])
            choices.append({
                "index": c.get("index", 0),
                "message": {"role": "assistant", "content": self._text(prompt_ids, ids, c, body, skip),
                            "refusal": None, "annotations": None, "audio": None, "function_call": None,
                            "tool_calls": [], "reasoning": None},
                "logprobs": None, "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason"),
                "token_ids": ids if with_ids else None,
            })
        completion = sum(len(c.get("token_ids") or []) for c in response.get("choices") or [])
        return {
            "id": "", "object": "chat.completion", "created": self.created(), "model": body.get("model"),
            "choices": choices, "service_tier": None, "system_fingerprint": None,
            "usage": self._usage(len(prompt_ids), completion),
            "prompt_logprobs": None, "prompt_token_ids": prompt_ids if with_ids else None,
            "kv_transfer_params": None,
        }

    def completions(
        self, responses: Sequence[Mapping[str, Any]], *, prompt_ids: Sequence[Sequence[int]], body: Mapping[str, Any]
    ) -> dict[str, Any]:
        skip = skip_special_tokens(body, self.tok.generation_defaults)
        with_ids = bool(body.get("return_token_ids"))
        choices: list[dict[str, Any]] = []
        completion = 0
        for prompt, response in zip(prompt_ids, responses, strict=True):
            for c in sorted(response.get("choices") or [], key=lambda c: c.get("index", 0)):
                ids = list(c.get("token_ids") or [])
                completion += len(ids)
                choices.append({
                    "index": len(choices), "text": self._text(prompt, ids, c, body, skip), "logprobs": None,
                    "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason"),
                    "prompt_logprobs": None, "prompt_token_ids": prompt if with_ids else None,
                    "token_ids": ids if with_ids else None,
                })
        return {
            "id": "", "object": "text_completion", "created": self.created(), "model": body.get("model"),
            "choices": choices, "service_tier": None, "system_fingerprint": None,
            "usage": self._usage(sum(len(p) for p in prompt_ids), completion), "kv_transfer_params": None,
        }


def _without_stop_token(ids: list[int], choice: Mapping[str, Any], body: Mapping[str, Any], eos: int | None) -> list[int]:
    """``ids`` without the token that stopped generation, as derender leaves it out
    (``OnlineDerenderer._drop_stop_token``): EOS unless ``ignore_eos``, a ``stop_token_ids`` entry,
    or the id the engine reported as ``stop_reason``; kept with ``include_stop_str_in_output``."""
    reason = choice.get("stop_reason")
    if choice.get("finish_reason") != "stop" or isinstance(reason, str) or not ids:
        return ids
    last = ids[-1]
    if reason is None:
        stopped = (last == eos and not body.get("ignore_eos")) or last in (body.get("stop_token_ids") or ())
    else:
        stopped = last == reason
    return ids[:-1] if stopped and not body.get("include_stop_str_in_output") else ids
