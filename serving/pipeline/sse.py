"""Server-sent events as vLLM writes and reads them: ``data: <json>\\n\\n`` frames, ``[DONE]`` last."""

from __future__ import annotations

from typing import Any, AsyncIterator

from serving.pipeline.json_codec import dumps, loads

DONE = b"data: [DONE]\n\n"
# The longest SSE line kept while its end has not arrived: one event is one JSON document, as large
# as a whole reply can be in practice (a first chunk with prompt logprobs of a long prompt runs to
# megabytes); an upstream that sends more without a newline is broken, and is not buffered further.
MAX_LINE_BYTES = 16 * 1024 * 1024


def frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


class SSEProtocolError(ValueError):
    """The upstream stream was not well-formed SSE JSON."""


class StreamTruncated(SSEProtocolError):
    """The upstream closed the stream before ``data: [DONE]``."""


def iter_event_batches(pieces: AsyncIterator[bytes]) -> EventBatchReader:
    """Each ``data:`` event's JSON until ``[DONE]``, a list per piece of the body: the events that
    arrived together, in order (``EventBatchReader``).

    A line cut between pieces waits for its end. Raises ``StreamTruncated`` if the body ends
    before ``[DONE]`` (a dropped connection that closed cleanly looks exactly like that),
    ``SSEProtocolError`` on data that is not a JSON object; either only after the events before
    it were yielded. Nothing here holds a piece, or an event once its list was handed on: the
    stream's reader empties each list it takes (``EventBatches``).
    """
    return EventBatchReader(pieces)


class EventBatchReader:
    """``iter_event_batches``: a plain async iterator, not an async generator, so that a stream
    whose client reads nothing keeps no suspended frame (nor asyncio's weak-set entry for it)
    per prompt (issue 31, ``bench/slow_reader.py``). Once it has raised or ended it ends."""

    __slots__ = ("_pieces", "_held", "_held_bytes", "_end")

    def __init__(self, pieces: AsyncIterator[bytes]) -> None:
        self._pieces = pieces
        # The incomplete last line, kept as its pieces: joined once its end arrives, not copied
        # again with every piece (a long line in small pieces would cost quadratic time).
        self._held: list[bytes] = []
        self._held_bytes = 0
        # How the events stopped, raised (or, ``_DONE``, ended) at the next call: the events
        # before it were handed on first.
        self._end: SSEProtocolError | None = None

    def __aiter__(self) -> EventBatchReader:
        return self

    async def __anext__(self) -> list[dict[str, Any]]:
        held = self._held
        while True:
            end = self._end
            if end is not None:
                self._end = _DONE  # raised once; then ended, as a generator that raised
                if end is _DONE:
                    raise StopAsyncIteration
                raise end
            try:
                piece = await self._pieces.__anext__()
            except StopAsyncIteration:
                tail = b"".join(held)
                held.clear()
                batch, _, end = _split(tail + b"\n")
                self._end = end if end is not None else StreamTruncated("stream ended before [DONE]")
                if batch:
                    return batch
                continue
            if b"\n" not in piece:
                held.append(piece)
                self._held_bytes += len(piece)
                if self._held_bytes > MAX_LINE_BYTES:
                    self._end = _DONE
                    raise SSEProtocolError(f"an SSE line over {MAX_LINE_BYTES} bytes without its end")
                continue
            if held:
                held.append(piece)
                piece = b"".join(held)
                held.clear()
            batch, tail, end = _split(piece)
            del piece
            self._held_bytes = len(tail)
            if tail:
                held.append(tail)
            if self._held_bytes > MAX_LINE_BYTES:
                self._end = _DONE
                raise SSEProtocolError(f"an SSE line over {MAX_LINE_BYTES} bytes without its end")
            self._end = end
            if batch:
                return batch

    async def aclose(self) -> None:
        """End here (the pieces stay their owner's to close)."""
        self._end = _DONE
        self._held.clear()


_DONE = SSEProtocolError("[DONE]")  # how ``_split`` says the stream ended; never raised


def _split(data: bytes) -> tuple[list[dict[str, Any]], bytes, SSEProtocolError | None]:
    """The events of the complete lines of ``data``, the incomplete last line, and how the
    events stopped early: ``_DONE``, or the error a line raised (the events before it stand)."""
    *lines, tail = data.split(b"\n")
    events: list[dict[str, Any]] = []
    for raw in lines:
        line = raw.rstrip(b"\r")
        if not line.startswith(b"data:"):
            continue  # blank separator, keep-alive comment; vLLM writes no event:/id: fields
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return events, tail, _DONE
        try:
            event = loads(payload)
        except ValueError:
            return events, tail, SSEProtocolError(f"bad SSE data: {payload[:200]!r}")
        if not isinstance(event, dict):
            return events, tail, SSEProtocolError(f"SSE data is not an object: {payload[:200]!r}")
        events.append(event)
    return events, tail, None


class FieldScrub:
    """Nulls ``fields`` (wherever they sit in an event's JSON) in an SSE byte stream relayed raw.

    The native path relays an engine's chunks as they arrive, cut anywhere; this keeps the
    incomplete last frame back until its blank line arrives, and parses only the frames whose
    bytes mention a field with a value other than ``null``: every other frame passes byte for
    byte. Frames end with ``\\n\\n``, as vLLM writes them; a stream without one is held to its end
    and scrubbed whole.
    """

    def __init__(self, fields: tuple[str, ...]) -> None:
        self._fields = frozenset(fields)
        self._needles = tuple((b'"' + f.encode() + b'"', b'"' + f.encode() + b'":null') for f in fields)
        self._tail = b""

    def _mentions(self, data: bytes) -> bool:
        """Whether ``data`` may carry a field to null. vLLM writes every field, as ``null``, in
        every chunk (``"kv_transfer_params":null``, compact): where each mention of a field is
        exactly that, a parse would null nothing, so the frame is not parsed. (A mention is a
        JSON string token, its quotes unescaped; followed by ``:null`` it is a key whose value is
        null. Any other mention, a spaced ``: null`` included, is parsed as before.)"""
        for name, null in self._needles:
            count = data.count(name)
            if count and count != data.count(null):
                return True
        return False

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` (after what was held) can go to the client now."""
        if not self._tail and chunk.endswith(b"\n\n") and not self._mentions(chunk):
            return chunk  # whole frames, none concerned: the common case, no copy
        data = self._tail + chunk
        cut = data.rfind(b"\n\n") + 2
        if cut < 2:
            self._tail = data
            return b""
        done, self._tail = data[:cut], data[cut:]
        return self._scrub(done) if self._mentions(done) else done

    def flush(self) -> bytes:
        """What was held back when the stream ended."""
        tail, self._tail = self._tail, b""
        return self._scrub(tail) if self._mentions(tail) else tail

    def _scrub(self, block: bytes) -> bytes:
        lines = block.split(b"\n")
        for i, line in enumerate(lines):
            if not (line.startswith(b"data:") and self._mentions(line)):
                continue
            try:
                event = loads(line[5:])
            except ValueError:
                continue  # not JSON: nothing a client could read a field from
            if _null_fields(event, self._fields):
                lines[i] = b"data: " + dumps(event)
        return b"\n".join(lines)


def _null_fields(value: Any, fields: frozenset[str]) -> bool:
    """Set every non-null ``fields`` key in ``value`` (nested too) to None; whether any was."""
    changed = False
    if isinstance(value, dict):
        for key, item in value.items():
            if key in fields and item is not None:
                value[key] = None
                changed = True
            else:
                changed = _null_fields(item, fields) or changed
    elif isinstance(value, list):
        for item in value:
            changed = _null_fields(item, fields) or changed
    return changed
