"""HTTP plumbing for streams: SSE framing, disconnect detection, dropping a connection.

Dropping a connection on purpose has no ASGI message; an exception before the response
starts makes uvicorn answer 500 instead. So the simulator keeps the server's raw ``send``
in the scope (:class:`RawSendApp`) and closes the transport of uvicorn's request cycle
behind it. Under servers without one (httpx's ``ASGITransport``) it raises
:class:`ConnectionDropped` instead, which the in-process client sees as an error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

RAW_SEND_KEY = "enginesim.raw_send"
DONE_EVENT = "data: [DONE]\n\n"


def sse_event(payload_json: str) -> str:
    """One SSE frame as vLLM writes it: a ``data:`` line and a blank line."""
    return f"data: {payload_json}\n\n"


class ConnectionDropped(Exception):
    """Raised when a fault wants the connection closed but no transport is reachable."""


class RawSendApp(Starlette):
    """Starlette that remembers the server's own ``send`` for :func:`close_connection`."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette's middleware wraps send before any user middleware sees it, so the
        # raw callable is only visible here.
        scope[RAW_SEND_KEY] = send
        await super().__call__(scope, receive, send)


def close_connection(scope: Scope) -> bool:
    """Close the client connection under this request; False if it cannot be reached."""
    send = scope.get(RAW_SEND_KEY)
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    # Not an isinstance check: uvloop's transports (uvicorn's loop when uvloop is installed)
    # do not subclass asyncio's.
    if transport is None or not callable(getattr(transport, "is_closing", None)):
        return False
    # close() (not abort()) flushes what was already written: the tokens sent before a
    # drop reach the client, then the body ends without its final chunk.
    transport.close()
    return True


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the server reports ``http.disconnect`` (request body already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def wait_forever() -> None:
    """Block until cancelled (stalls; a closed connection waiting for its cancel)."""
    await asyncio.Event().wait()


async def race_disconnect(work: Awaitable[T], receive: Receive) -> tuple[bool, T | None]:
    """Run ``work`` until it finishes or the client goes away.

    Returns ``(True, result)`` or ``(False, None)`` after a disconnect, having cancelled
    and awaited ``work`` either way, so nothing outlives the request.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return True, work_task.result()
        return False, None
    finally:
        for task in (work_task, watch_task):
            task.cancel()
        # wait() never raises the tasks' own errors; our own cancellation still propagates.
        await asyncio.wait({work_task, watch_task})


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response that always closes its body generator.

    Starlette cancels the sending task when the client disconnects; if the generator was
    parked at a ``yield`` it would otherwise only be finalized by the garbage collector,
    and its ``finally`` (active stream count, abort registry) would run late.
    """

    body_iterator: AsyncIterator[str]  # type: ignore[assignment]

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream")

    async def stream_response(self, send: Send) -> None:
        async with contextlib.aclosing(self.body_iterator):  # type: ignore[type-var]
            await super().stream_response(send)
