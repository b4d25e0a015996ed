"""Stop strings on the streaming token-only path: engine-side stop, coordinator-side hold-back.

Streaming derender refuses a request with stop strings (400: text already sent cannot be taken
back). The mechanism that keeps such streams on the token-only path and equal to native vLLM:

1. the engine stops generating: a tokenizer-loaded engine (the router sends stop strings only
   to those) matches the stop strings on its own detokenized text, exactly as native vLLM does,
   and reports the matched string as ``stop_reason`` with ``finish_reason: "stop"``;
2. derender gets the request without ``stop`` (``derender_request``), so it neither refuses nor
   cuts, and returns the raw text of every token, including the stop string;
3. the coordinator holds back the chunks holding the last ``max(len(stop)) - 1`` characters of
   each choice's text until it is finished, and cuts the final text at the stop string
   (``ChunkHoldback``), the way vLLM's ``IncrementalDetokenizer.get_next_output_text`` /
   ``check_stop_strings`` do. Text a stop string may still start in is therefore never sent
   early. Chunks are held whole, so a chunk's state and ids are committed exactly when its text
   is handed to the client (``StopHoldback`` is the character cursor, for a whole text).

The concatenated text equals native vLLM's; token ids, logprobs, finish and stop reason and usage
are the engine's own and pass through unchanged. Only ``delta.content`` (chat) and ``text``
(completions) are held back: with a reasoning or tool parser on the sidecar the stop string is
cut from content only (documented limitation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from serving.pipeline.protocol import TokenKind

if TYPE_CHECKING:
    from serving.pipeline.derender.session import PendingChunk


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


class _ChoiceHold:
    """The derendered chunks of one choice whose text may still be cut, held whole.

    A chunk is sent whole or not at all: its ``stream_state`` and token ids can only be
    committed together with all of its text, when the client is handed it (RFC: state is saved
    only once the chunk can be given to the client). A held chunk is released once its text ends
    at least ``buffer_length`` characters before the end of all text so far, the point before
    which no stop string can still start (vLLM's hold-back rule, at chunk granularity); on the
    finishing chunk everything is released, cut at the stop string.
    """

    def __init__(self, stop: list[str], include_in_output: bool) -> None:
        self.stop = stop
        self.include_in_output = include_in_output
        longest = max((len(x) for x in stop), default=0)
        self.buffer_length = 0 if include_in_output or not stop else longest - 1
        self.held: list[tuple[PendingChunk, str]] = []  # (chunk, its original text), in order
        self.held_text = ""  # the text of the held chunks: what the client has not been handed
        # The end of the text already handed on, as long as a stop string but one: a stop string
        # that ends in a held chunk may start there (always so with include_stop_str_in_output,
        # which holds nothing back: the cut then falls after the stop string, in the new text).
        self._keep = max(0, longest - 1)
        self.sent_tail = ""
        self.finished = False

    def push(self, pending: PendingChunk, text: str, *, finished: bool, stop_reason: Any, kind: TokenKind) -> list[PendingChunk]:
        before = len(self.held_text)
        self.held.append((pending, text))
        self.held_text += text
        if finished:
            self.finished = True
            cut = len(self.held_text)
            if isinstance(stop_reason, str) and stop_reason:
                # The stop string completed within this chunk's text; it may have started in text
                # already handed on. Excluded from the output, it never did (that text ends
                # buffer_length before the end), so the cut is >= 0; included, the cut falls
                # after it, in the held text.
                window = self.sent_tail + self.held_text
                at = window.find(stop_reason, max(0, len(self.sent_tail) + before - len(stop_reason) + 1))
                if at != -1:
                    cut = max(0, at - len(self.sent_tail) + (len(stop_reason) if self.include_in_output else 0))
            released, start = [], 0
            for chunk, original in self.held:
                _set_text(chunk.chunk, kind, original[: max(0, cut - start)])
                start += len(original)
                released.append(chunk)
            self.held, self.held_text = [], ""
            return released
        safe = len(self.held_text) - self.buffer_length
        released, end = [], 0
        while self.held and end + len(self.held[0][1]) <= safe:
            chunk, original = self.held.pop(0)
            end += len(original)
            released.append(chunk)
        if end and self._keep:
            self.sent_tail = (self.sent_tail + self.held_text[:end])[-self._keep:]
        self.held_text = self.held_text[end:]
        return released

    def discard(self) -> None:
        """Forget the held chunks (their attempt failed): they were never the client's.

        ``sent_tail`` stays: it is the client's text, which the relay continues."""
        self.held, self.held_text = [], ""


def _text(chunk: dict[str, Any], kind: TokenKind) -> tuple[str, bool, Any]:
    """The text, finished flag and stop reason of ``chunk``'s one choice."""
    choice = (chunk.get("choices") or [{}])[0]
    if kind == "chat":
        delta = choice.get("delta")
        text = (delta.get("content") or "") if isinstance(delta, dict) else ""
    else:
        text = choice.get("text") or ""
    return text, choice.get("finish_reason") is not None, choice.get("stop_reason")


def _set_text(chunk: dict[str, Any], kind: TokenKind, text: str) -> None:
    for choice in chunk.get("choices") or []:
        if kind == "chat":
            delta = choice.get("delta")
            if isinstance(delta, dict):
                delta["content"] = text or None  # derender's own convention for an empty delta
        else:
            choice["text"] = text


class ChunkHoldback:
    """Hold-back for the derendered chunks of one prompt's stream: one ``_ChoiceHold`` per choice.

    ``release`` takes each derendered chunk and returns the chunks that may go to the client now,
    in order, whole (only the finishing chunks' text is cut at the stop string); the session
    commits each when the client is handed it. ``discard`` drops what is held when an attempt
    fails, so a relay continues from what the client has.
    """

    __slots__ = ("kind", "stop", "include_in_output", "_choices")  # one a prompt, for the stream's life

    def __init__(self, kind: TokenKind, body: Mapping[str, Any]) -> None:
        self.kind = kind
        self.stop = stop_strings(body)
        self.include_in_output = bool(body.get("include_stop_str_in_output"))
        self._choices: dict[int, _ChoiceHold] = {}

    @property
    def active(self) -> bool:
        return bool(self.stop)

    def release(self, pending: PendingChunk) -> list[PendingChunk]:
        if not self.stop or pending.index is None:
            return [pending]  # nothing to hold; a usage-only chunk comes after every finish
        hold = self._choices.get(pending.index)
        if hold is None:
            hold = self._choices[pending.index] = _ChoiceHold(self.stop, self.include_in_output)
        text, finished, stop_reason = _text(pending.chunk, self.kind)
        return hold.push(pending, text, finished=finished, stop_reason=stop_reason, kind=self.kind)

    def discard(self) -> None:
        for hold in self._choices.values():
            hold.discard()
