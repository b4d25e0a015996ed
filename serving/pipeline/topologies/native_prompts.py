"""A completion of several prompts on the native P/D path: one pair run per prompt, merged.

A P/D pair's own API takes one prompt per body (P returns one set of ``kv_transfer_params``),
yet the RFC's native path "does not mean the request fails". So on a fleet whose only native
path is P/D pairs, ``NativePath`` splits such a body into one body per prompt (``split_prompts``),
runs them concurrently through the pairs, and merges the answers as vLLM's own server answers
the multi-prompt completion (``serving/openai/completion/serving.py``): choice ``index``
prompt-major (``prompt * n + choice``; a pair runs ``n`` 1, so the prompt's index), one
``usage`` summed over the prompts, one ``[DONE]``. A stream's per-prompt usage-only chunks are
summed into one, sent last when the client asked for usage; ``continuous_usage_stats`` chunks
keep their prompt's own usage, as vLLM's do. Every frame gets the first prompt's ``id`` and
``created``: one response to the client.

A failure of any prompt, before or after the response started, cancels and awaits the others
and closes every leg (their admission, load and engine connection); mid-stream the client gets
one error event and ``[DONE]``, as a single native stream ends.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import httpx

from serving.pipeline.engine.native import NativeStream
from serving.pipeline.errors import EngineError, MotorError, error_body
from serving.pipeline.sse import DONE, SSEProtocolError, frame, iter_event_batches
from serving.pipeline.streaming.fanout import fan_in

logger = logging.getLogger(__name__)


def split_prompts(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One completion body per prompt of ``body["prompt"]`` (a list of several), all else as sent."""
    return [{**body, "prompt": prompt} for prompt in body["prompt"]]


def sum_usage(usages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Usage objects added field by field (nested ``*_details`` too); a null stays null unless
    some prompt counted it."""
    total: dict[str, Any] = {}
    for usage in usages:
        for key, value in usage.items():
            if isinstance(value, bool) or value is None:
                total.setdefault(key, value)
            elif isinstance(value, (int, float)):
                total[key] = (total.get(key) or 0) + value
            elif isinstance(value, Mapping):
                total[key] = sum_usage([total[key], value]) if isinstance(total.get(key), Mapping) else dict(value)
            else:
                total.setdefault(key, value)
    return total


def _renumbered(choices: Any, prompt: int, n: int) -> list[dict[str, Any]]:
    return [{**c, "index": prompt * n + int(c.get("index") or 0)} for c in choices or () if isinstance(c, dict)]


def merge_whole(answers: Sequence[dict[str, Any]], n: int) -> dict[str, Any]:
    """The prompts' JSON answers as one completion (the first's id and created)."""
    merged = dict(answers[0])
    merged["choices"] = [c for i, a in enumerate(answers) for c in _renumbered(a.get("choices"), i, n)]
    usages = [a["usage"] for a in answers if isinstance(a.get("usage"), Mapping)]
    merged["usage"] = sum_usage(usages) if usages else None
    merged["kv_transfer_params"] = None
    return merged


class NativePromptsStream:
    """The prompts' SSE answers (each an established ``NativeStream``) as one completion stream.

    Driven like a ``NativeStream``: ``frames()`` once; its ``Response`` closes it if it never ran.
    """

    def __init__(self, request_id: str, legs: Sequence[NativeStream], n: int) -> None:
        self.kind = "completions"
        self.request_id = request_id
        self.legs = list(legs)
        self.n = n
        self._closed = False

    async def frames(self) -> AsyncGenerator[bytes, None]:
        outcome = "ok"
        usages: list[dict[str, Any]] = []
        head: dict[str, Any] = {}
        try:
            async with aclosing(fan_in([self._events(i) for i in range(len(self.legs))])) as events:
                async for prompt, event in events:
                    if not event.get("choices"):
                        if isinstance(event.get("usage"), dict):
                            usages.append(event["usage"])  # the prompt's final usage chunk: summed below
                        continue
                    head = head or {"id": event.get("id"), "created": event.get("created"), "model": event.get("model")}
                    event.update(head)
                    event["choices"] = _renumbered(event["choices"], prompt, self.n)
                    yield frame(event)
            if usages:
                yield frame({"object": "text_completion", **head, "choices": [], "usage": sum_usage(usages)})
            yield DONE
        except MotorError as exc:
            # The status is already 200: one error event and [DONE], as a single native stream ends.
            outcome = type(exc).__name__
            yield frame(error_body(exc)[1])
            yield DONE
        finally:
            await self.aclose()
            logger.info("response request_id=%s kind=completions path=native stream=true prompts=%d instances=%s "
                        "result=%s", self.request_id, len(self.legs),
                        ",".join(leg.instance.name for leg in self.legs), outcome)

    def _events(self, prompt: int) -> Callable[[], AsyncGenerator[tuple[int, dict[str, Any]], None]]:
        leg = self.legs[prompt]

        async def events() -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
            try:
                async for batch in iter_event_batches(leg.response.aiter_raw()):
                    for event in batch:
                        if event.get("error") is not None:
                            # An engine's in-stream error ends the whole response (vLLM's too).
                            raise EngineError(f"{leg.instance.name} stream failed: {str(event['error'])[:200]}",
                                              instance=leg.instance.name)
                        yield prompt, event
            except (httpx.HTTPError, SSEProtocolError) as exc:
                raise EngineError(f"{leg.instance.name} stream failed: {exc!r}", instance=leg.instance.name) from exc

        return events

    async def aclose(self) -> None:
        """Close every leg (its engine connection, admission and load), once."""
        if self._closed:
            return
        self._closed = True
        for leg in self.legs:
            await leg.aclose()
