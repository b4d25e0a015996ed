"""Stop strings on the streaming token-only path: engine-side stop, coordinator-side hold-back.

Streaming derender refuses a request with stop strings (400: text already sent cannot be taken
back). The mechanism that keeps such streams on the token-only path and equal to native vLLM:

1. the engine stops generating: a tokenizer-loaded engine (the router sends stop strings only
   to those) matches the stop strings on its own detokenized text, exactly as native vLLM does,
   and reports the matched string as ``stop_reason`` with ``finish_reason: "stop"``;
2. derender gets the request without ``stop`` (``derender_request``), so it neither refuses nor
   cuts, and returns the raw text of every token, including the stop string;
3. the coordinator holds back the last ``max(len(stop)) - 1`` characters of each choice's text
   until it is finished, and cuts the final text at the stop string (``StopHoldback``), the way
   vLLM's ``IncrementalDetokenizer.get_next_output_text`` / ``check_stop_strings`` do. Text a
   stop string may still start in is therefore never sent early.

The concatenated text equals native vLLM's; token ids, logprobs, finish and stop reason and usage
are the engine's own and pass through unchanged. Only ``delta.content`` (chat) and ``text``
(completions) are held back: with a reasoning or tool parser on the sidecar the stop string is
cut from content only (documented limitation).
"""

from __future__ import annotations

from typing import Any, Mapping

from serving.pipeline.protocol import TokenKind


def stop_strings(body: Mapping[str, Any]) -> list[str]:
    """The request's stop strings as vLLM's ``SamplingParams`` normalizes them (empty ones dropped)."""
    stop = body.get("stop")
    if not stop:
        return []
    if isinstance(stop, str):
        return [stop]
    return [s for s in stop if isinstance(s, str) and s]


def derender_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` as streaming derender accepts it: without ``stop`` (which it refuses with 400)."""
    return {k: v for k, v in body.items() if k != "stop"}


class StopHoldback:
    """The hold-back cursor over one choice's streamed text.

    ``feed`` takes each derendered delta and returns what may go to the client now. Only the
    text from the last sent character minus the longest stop string is kept, so memory stays
    bounded whatever the stream's length.
    """

    def __init__(self, stop: list[str], *, include_in_output: bool = False) -> None:
        self.stop = list(stop)
        self.include_in_output = include_in_output
        longest = max((len(s) for s in self.stop), default=0)
        # As vLLM's detokenizer: nothing is held back when the stop string is part of the output.
        self.buffer_length = 0 if include_in_output or not self.stop else longest - 1
        self._longest = longest
        self._tail = ""  # text from absolute offset _base on
        self._base = 0
        self._sent = 0  # absolute offset of the first character not yet sent
        self.finished = False

    def feed(self, delta: str, *, finished: bool, stop_reason: Any = None) -> str:
        """Return the text to send for this delta; on the last one, cut at ``stop_reason``.

        ``stop_reason`` is the engine's: the matched stop string, a stop token id or None. The
        string completed within this delta (the engine would have stopped earlier otherwise),
        so it is searched from the end of the previous text minus its length, as
        ``check_stop_strings`` searches only the newly added text.
        """
        if self.finished:
            return ""
        before = self._base + len(self._tail)
        self._tail += delta
        end = self._base + len(self._tail)
        if finished:
            self.finished = True
            if isinstance(stop_reason, str) and stop_reason:
                start = max(self._base, before - len(stop_reason) + 1)
                at = self._tail.find(stop_reason, start - self._base)
                if at != -1:
                    cut = self._base + at + (len(stop_reason) if self.include_in_output else 0)
                    end = max(cut, self._sent)  # never less than what was sent (cannot happen)
        else:
            end -= self.buffer_length
        out = ""
        if end > self._sent:
            out = self._tail[self._sent - self._base:end - self._base]
            self._sent = end
        # Keep only what a later search can still need: the unsent text and one stop length before it.
        keep_from = max(self._base, self._sent - self._longest)
        self._tail = self._tail[keep_from - self._base:]
        self._base = keep_from
        return out


class ChunkHoldback:
    """Hold-back for the derendered chunks of one engine stream: one ``StopHoldback`` per choice."""

    def __init__(self, kind: TokenKind, body: Mapping[str, Any]) -> None:
        self.kind = kind
        self.stop = stop_strings(body)
        self.include_in_output = bool(body.get("include_stop_str_in_output"))
        self._choices: dict[int, StopHoldback] = {}

    @property
    def active(self) -> bool:
        return bool(self.stop)

    def apply(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """Rewrite the text of ``chunk``'s choices in place (before any index remap) and return it."""
        if not self.stop:
            return chunk
        for choice in chunk.get("choices") or []:
            index = int(choice.get("index", 0))
            hold = self._choices.get(index)
            if hold is None:
                hold = self._choices[index] = StopHoldback(self.stop, include_in_output=self.include_in_output)
            finished = choice.get("finish_reason") is not None
            if self.kind == "chat":
                delta = choice.get("delta")
                if not isinstance(delta, dict):
                    continue
                text = hold.feed(delta.get("content") or "", finished=finished, stop_reason=choice.get("stop_reason"))
                delta["content"] = text or None  # derender's own convention for an empty delta
            else:
                choice["text"] = hold.feed(choice.get("text") or "", finished=finished,
                                           stop_reason=choice.get("stop_reason"))
        return chunk
