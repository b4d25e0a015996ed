"""Server-sent events as vLLM writes and reads them: ``data: <json>\\n\\n`` frames, ``[DONE]`` last."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import orjson

DONE = b"data: [DONE]\n\n"


def frame(payload: dict[str, Any]) -> bytes:
    try:
        body = orjson.dumps(payload)
    except TypeError:  # integers past 64 bits: only the standard library writes them
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    return b"data: " + body + b"\n\n"


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
            event = _loads(data)
        except ValueError as exc:
            raise SSEProtocolError(f"bad SSE data: {data[:200]!r}") from exc
        if not isinstance(event, dict):
            raise SSEProtocolError(f"SSE data is not an object: {data[:200]!r}")
        yield event
    raise StreamTruncated("stream ended before [DONE]")


def _loads(data: str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)  # NaN and Infinity, which Python's encoder writes
