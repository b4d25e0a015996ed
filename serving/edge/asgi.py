"""ASGI plumbing of the edge: read a request, watch for the client leaving, send a response.

Written against the ASGI 3 spec directly (the shape of Starlette's ``Request`` and
``StreamingResponse``, without their per-request objects): the edge serves a handful of routes,
and every allocation on this path is paid on every request.

Exceptions, raised by ``read_body``:

ClientGone      the client disconnected before its body was complete: there is nobody to answer
BodyTooLarge    the body is over the cap (Content-Length, or counted while reading): 413

and by ``send_stream``:

ClientStalled   the client read nothing for the stall deadline: its stream was cut
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, MutableMapping
from contextlib import aclosing
from types import TracebackType
from typing import Any

from serving.pipeline.json_codec import dumps
from serving.pipeline.sse import FieldScrub
from serving.pipeline.step_bound import StepBound

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

# Built once: every response of the edge starts with one of these.
JSON_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-type", b"application/json"),
    (b"x-content-type-options", b"nosniff"),
)
STREAM_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-content-type-options", b"nosniff"),
)


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class BodyTooLarge(Exception):
    """The request body is over the cap."""


class ClientStalled(Exception):
    """The client read nothing of a streaming response for the stall deadline; the stream was cut."""


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case, as ASGI servers give names), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, refused before it is held in memory when it is over ``limit``.

    A declared Content-Length over the cap is refused before a byte is read; a body without one
    (chunked) or lying about it is counted as it arrives and refused as soon as it passes the cap.
    Raises ``BodyTooLarge`` or ``ClientGone``.
    """
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class DisconnectWatch:
    """Cancels the request's task when the client disconnects, until the response is complete.

    ``async with DisconnectWatch(receive) as watch:`` around the handler and its streaming: a
    client that leaves while the pipeline renders, waits for admission or streams gets the
    request's own task cancelled at once, so every ``finally`` of the data plane (abort the
    engines, release quota) runs in that task before ``__aexit__`` returns. (Channels'
    ``AsyncHttpConsumer`` reads ``receive`` only between handler calls, so it would notice the
    disconnect only after the whole response; django/channels#1249.) The cancellation the watch
    caused is absorbed on the way out: the server expects a normal return from a request whose
    client left. Set ``complete`` before the last send: from then on a disconnect (uvicorn
    reports one as soon as the response is complete) cancels nothing.
    """

    __slots__ = ("_receive", "_task", "_watcher", "_cancelled", "complete")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._cancelled = False
        self.complete = False

    async def __aenter__(self) -> DisconnectWatch:
        self._task = asyncio.current_task()
        assert self._task is not None  # an ASGI app always runs in a task
        self._watcher = self._task.get_loop().create_task(self._watch())
        return self

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                if not self.complete:
                    assert self._task is not None
                    self._cancelled = True
                    self._task.cancel()
                return

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        self.complete = True
        assert self._watcher is not None and self._task is not None
        self._watcher.cancel()
        # Awaited, not only cancelled: the request leaves no task behind when it returns.
        await asyncio.wait((self._watcher,))
        if self._cancelled:
            # Undo our own cancel() so an enclosing asyncio.timeout or a server's cancel still
            # counts; swallow the CancelledError only when nobody else asked for it.
            if self._task.uncancel() == 0 and exc_type is asyncio.CancelledError:
                return True
        return False


async def send_json(send: Send, status: int, payload: Any, extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = dumps(payload)
    headers: Headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_stream(
    send: Send, frames: AsyncGenerator[bytes, None], extra: Iterable[tuple[bytes, bytes]], watch: DisconnectWatch,
    scrub: FieldScrub | None = None, stall_s: float | None = None,
) -> None:
    """A 200 ``text/event-stream`` of ``frames``, each sent as it comes (through ``scrub`` if given:
    a frame cut across chunks is sent once whole).

    A ``send`` waits while the client is not reading (the server's write buffer is full: uvicorn's
    flow control, Daphne's through ``motorsite.send_flow``), which holds the engines back. One that
    waits longer than ``stall_s`` cuts the stream (``StepBound``: one timer per response, not one per send): raises ``ClientStalled``, and
    the server drops the connection of the abandoned send (``motorsite.send_flow``).

    ``aclosing``: when the send fails, stalls or the task is cancelled between frames, the generator
    is closed here, in this task, so its ``finally`` (abort the engines, release) has run when this
    returns or raises.
    """

    bound = StepBound(stall_s) if stall_s is not None else None

    async def send_within(message: Message) -> None:
        if bound is None:
            await send(message)
            return
        try:
            async with bound:
                await send(message)
        except TimeoutError:
            # The connection is dropped for the abandoned send, and the server reports that as
            # a disconnect: the watch must not cancel this task while the generator is closed.
            watch.complete = True
            raise ClientStalled from None

    try:
        await send_within({"type": "http.response.start", "status": 200, "headers": [*STREAM_HEADERS, *extra]})
        async with aclosing(frames) as chunks:
            async for chunk in chunks:
                if scrub is not None:
                    chunk = scrub.feed(chunk)
                    if not chunk:
                        continue
                await send_within({"type": "http.response.body", "body": chunk, "more_body": True})
        watch.complete = True
        rest = scrub.flush() if scrub is not None else b""
        await send_within({"type": "http.response.body", "body": rest, "more_body": False})
    finally:
        if bound is not None:
            bound.close()


class PrefixMount:
    """Sends HTTP requests under ``prefix`` (the path itself, or below it) to ``app``, the rest to ``fallback``."""

    def __init__(self, prefix: str, app: ASGIApp, fallback: ASGIApp) -> None:
        self.prefix = prefix.rstrip("/")
        self._below = self.prefix + "/"
        self.app = app
        self.fallback = fallback

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            if path.startswith(self._below) or path == self.prefix:
                await self.app(scope, receive, send)
                return
        await self.fallback(scope, receive, send)
