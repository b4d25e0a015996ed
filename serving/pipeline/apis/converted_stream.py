"""A chat ``EventStream`` sent as another API's events (Anthropic Messages, OpenAI Responses).

The stream stays the chat one's (derender per chunk, relay, cancellation on disconnect, its
engine streams); only its frames are re-read (``chat_payloads``) and written in the API's events.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol, cast

from serving.pipeline.json_codec import loads
from serving.pipeline.streaming.event_stream import EventStream


def chat_payloads(framed: bytes) -> list[dict[str, Any]]:
    """The JSON payloads of one or more chat SSE frames; ``[DONE]`` is left out."""
    out = []
    for line in framed.split(b"\n"):
        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
            out.append(loads(line[6:]))
    return out


class ApiEvents(Protocol):
    """Chat chunks in, one API's events out, for one answer."""

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]: ...

    def end(self) -> list[bytes]: ...


@dataclass
class ConvertedStream:
    """``inner``'s chat frames as ``events`` writes them; after an error payload, no end events."""

    inner: EventStream
    events: ApiEvents

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def frames(self) -> AsyncIterator[bytes]:
        failed = False
        async with aclosing(cast(AsyncGenerator[bytes, None], self.inner.frames())) as chunks:
            async for framed in chunks:
                for payload in chat_payloads(framed):
                    out = self.events.chunk(payload)
                    failed = failed or "error" in payload
                    if out:
                        yield b"".join(out)
        out = [] if failed else self.events.end()
        if out:
            yield b"".join(out)
