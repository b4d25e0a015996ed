"""Server-sent events as vLLM writes and reads them: ``data: <json>\\n\\n`` frames, ``[DONE]`` last."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from serving.pipeline.http11 import dumps, loads

DONE = b"data: [DONE]\n\n"


def frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


class SSEProtocolError(ValueError):
    """The upstream stream was not well-formed SSE JSON."""


class StreamTruncated(SSEProtocolError):
    """The upstream closed the stream before ``data: [DONE]``."""


async def iter_events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """Yield each ``data:`` event's JSON until ``[DONE]``.

    Raises ``StreamTruncated`` if the lines end before ``[DONE]`` (a dropped connection that
    closed cleanly looks exactly like that), ``SSEProtocolError`` on data that is not JSON.
    """
    async for line in lines:
        if not line or line.startswith(":"):
            continue  # blank separator or keep-alive comment
        if not line.startswith("data:"):
            continue  # vLLM writes no event:/id: fields; ignore them if a proxy adds some
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = loads(data)
        except ValueError as exc:
            raise SSEProtocolError(f"bad SSE data: {data[:200]!r}") from exc
        if not isinstance(event, dict):
            raise SSEProtocolError(f"SSE data is not an object: {data[:200]!r}")
        yield event
    raise StreamTruncated("stream ended before [DONE]")


class FieldScrub:
    """Nulls ``fields`` (wherever they sit in an event's JSON) in an SSE byte stream relayed raw.

    The native path relays an engine's chunks as they arrive, cut anywhere; this keeps the
    incomplete last frame back until its blank line arrives, and parses only the frames whose
    bytes mention a field: every other frame passes byte for byte. Frames end with ``\\n\\n``,
    as vLLM writes them; a stream without one is held to its end and scrubbed whole.
    """

    def __init__(self, fields: tuple[str, ...]) -> None:
        self._fields = frozenset(fields)
        self._needles = tuple(b'"' + f.encode() + b'"' for f in fields)
        self._tail = b""

    def _mentions(self, data: bytes) -> bool:
        return any(n in data for n in self._needles)

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
                event = json.loads(line[5:])
            except ValueError:
                continue  # not JSON: nothing a client could read a field from
            if _null_fields(event, self._fields):
                lines[i] = b"data: " + json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()
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
