"""The fake upstreams (``fakes.py``, or any ``httpx.MockTransport``-style handler) served over real
sockets on 127.0.0.1, so that the pipeline reaches them with the production client
(``Http11Client``): its parser, pool, deadlines and flow control are what a test exercises, not
httpx's ``MockTransport``.

One listening socket per fake host (``render``, ``e1``, ...): each request becomes an
``httpx.Request`` for the fake URL (``http://e1.test:8201/...``, what the handler keys on) and its
answer goes back as it is produced: a JSON answer with a ``Content-Length`` on a kept-alive
connection, a streamed one chunked, then the connection closes. An override that raises an httpx
transport error (``httpx.ReadError``, ``httpx.ConnectError``...) before its answer, or a stream
that raises one, resets the connection: the engine took the request and went away. A client that
closes its end in the middle of a stream closes the fake's stream (``SSEBody.aclose``), as vLLM
aborts a request whose connection went. A response with ``extensions={"loopback_raw": bytes}``
is answered with exactly those bytes.

``LoopbackClient`` is the production client with one test hook, where it connects: a request for a
fake URL (``http://e1.test:8201``) goes out unchanged (its ``Host`` is the fake's) on a socket to
that fake's loopback listener, opened on first use. A rig hands it to the pipeline as production
hands ``Http11Client`` (``serving/pipeline/http.py``), and its snapshot and assertions keep the
fake URLs.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
import weakref
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Collection
from urllib.parse import urlsplit

import httpx

from serving.pipeline.http11 import Http11Client, Origin
from serving.pipeline.http11_wire import Connection
from tests.serving.fakes import SSEBody

Handler = Callable[[httpx.Request], Awaitable[httpx.Response] | httpx.Response]

# Every loopback alive, for the leak checks: the tasks serving their connections are the fakes'
# side (a connection the client keeps in its pool is served until it closes), never the pipeline's.
_LIVE: "weakref.WeakSet[Loopback]" = weakref.WeakSet()


def fake_side_tasks() -> set[asyncio.Task[None]]:
    """The tasks of every live loopback's connections (see ``Loopback.tasks``)."""
    return set().union(*(loopback.tasks() for loopback in list(_LIVE)))


@dataclass(eq=False)  # hashable by identity: kept in _LIVE
class Loopback:
    handler: Handler
    urls: dict[str, str] = field(default_factory=dict)  # fake base URL -> http://127.0.0.1:port
    connections: dict[str, int] = field(default_factory=dict)  # by fake base URL
    _servers: list[asyncio.AbstractServer] = field(default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _streaming: int = 0  # requests being answered and streams being sent
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    by_host: bool = False  # the request URL from its Host header (LoopbackClient), not the listener's fake

    async def serve(self, *fake_urls: str) -> dict[str, str]:
        _LIVE.add(self)
        for fake in fake_urls:
            fake = fake.rstrip("/")
            server = await asyncio.start_server(
                lambda r, w, fake=fake: self._accept(fake, r, w), "127.0.0.1", 0
            )
            self._servers.append(server)
            self.urls[fake] = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            self.connections[fake] = 0
        return self.urls

    async def settle(self, timeout_s: float = 10.0) -> None:
        """Wait until every connection a client closed has been seen closed here (its fake stream
        closed with it); a connection the client keeps open is still served. Raises TimeoutError
        when a stream is still being sent after ``timeout_s``: a client that never closed it."""
        async with asyncio.timeout(timeout_s):
            while self._streaming:
                await asyncio.sleep(0.01)

    def tasks(self) -> set[asyncio.Task[None]]:
        """The tasks serving this loopback's connections (the fakes' side, not the client's)."""
        return set(self._tasks)

    async def aclose(self) -> None:
        for server in self._servers:
            server.close()
        for writer in list(self._writers):
            writer.transport.abort()  # each connection's task ends on its own (a cancelled one logs)
        if self._tasks:
            async with asyncio.timeout(10):
                await asyncio.wait(list(self._tasks))

    async def _accept(self, fake: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        self.connections[fake] += 1
        try:
            while await self._one(fake, reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            writer.close()

    async def _one(self, fake: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the connection is done."""
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ")
        headers = [(k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)]
        length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
        body = await reader.readexactly(length)
        parts = urlsplit(fake)
        netloc = parts.netloc
        if self.by_host:
            netloc = next((v for k, v in headers if k.lower() == "host"), netloc)
        request = httpx.Request(method, f"{parts.scheme}://{netloc}{target}", headers=headers, content=body)
        # The client sends nothing more before the answer (no pipelining): a read that returns is
        # its close, which cancels the handler, as a server's request task is when its client goes.
        self._streaming += 1
        handling = asyncio.ensure_future(self._answer(request))
        hangup = asyncio.ensure_future(reader.read())
        try:
            await asyncio.wait([handling, hangup], return_when=asyncio.FIRST_COMPLETED)
            answered = handling.done()
        finally:
            for task in (handling, hangup):
                task.cancel()
            await asyncio.gather(handling, hangup, return_exceptions=True)
            self._streaming -= 1
        if not answered:
            return False  # the client went first
        try:
            response = handling.result()
        except httpx.TransportError:
            writer.transport.abort()  # took the request, went away without a byte of an answer
            return False
        raw = response.extensions.get("loopback_raw")
        if raw is not None:  # a test's own bytes, however malformed, as the whole answer
            writer.write(raw)
            await writer.drain()
            return True
        status = b"HTTP/1.1 %d %s\r\n" % (response.status_code, response.reason_phrase.encode())
        fields = b"".join(
            b"%s: %s\r\n" % (k.encode(), v.encode())
            for k, v in response.headers.items() if k.lower() not in ("content-length", "transfer-encoding", "connection")
        )
        if not isinstance(response.stream, SSEBody):
            content = await response.aread()
            writer.write(status + fields + b"content-length: %d\r\n\r\n" % len(content) + content)
            await writer.drain()
            return True
        writer.write(status + fields + b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
        await self._stream(response.stream, reader, writer)
        return False

    async def _answer(self, request: httpx.Request) -> httpx.Response:
        out = self.handler(request)  # a handler may answer at once, as MockTransport's may
        return await out if inspect.isawaitable(out) else out

    async def _stream(self, stream: SSEBody, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def pump() -> None:
            async for piece in stream:
                if piece:
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        self._streaming += 1
        sending = asyncio.ensure_future(pump())
        # The client sends nothing more on a stream's connection: a read that returns is its close.
        hangup = asyncio.ensure_future(reader.read())
        try:
            await asyncio.wait([sending, hangup], return_when=asyncio.FIRST_COMPLETED)
            if sending.done():
                with contextlib.suppress(httpx.TransportError, ConnectionError):
                    sending.result()
                    return
                writer.transport.abort()  # the stream raised: the engine died mid-stream
        finally:
            for task in (sending, hangup):
                task.cancel()
            await asyncio.gather(sending, hangup, return_exceptions=True)
            await stream.aclose()
            self._streaming -= 1


class LoopbackClient(Http11Client):
    """``Http11Client`` whose connections to a fake origin go to that fake's loopback listener
    (``Loopback``, started on first use); everything past the connect is the production client."""

    def __init__(
        self, handler: Handler, timeout: httpx.Timeout | None = None, *, fakes: Collection[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(timeout, **kwargs)
        self.loopback = Loopback(handler, by_host=True)
        # The hosts the fake serves (``render.test``); None: every host. Others are real servers.
        self._fakes = None if fakes is None else frozenset(fakes)
        # The loop the listeners and connections live on: a test's, or Daphne's thread's when the
        # app behind Daphne uses this client (``live_edge.py``); closed on that loop.
        self._home: asyncio.AbstractEventLoop | None = None
        self._refused: dict[str, socket.socket] = {}  # fake host -> a bound socket that never listens

    def refuse(self, host: str) -> str:
        """Connections to fake ``host`` (``e1``) are refused from now on, as by a machine where
        nothing listens; returns the address the client's ``ConnectError`` names."""
        sock = self._refused.get(host)
        if sock is None:
            sock = self._refused[host] = socket.socket()
            sock.bind(("127.0.0.1", 0))  # bound, never listening: a connect is refused, the port stays ours
        address, port = sock.getsockname()
        return f"{address}:{port}"

    async def _connect(self, origin: Origin, connect_s: float | None) -> Connection:
        scheme, host, port = origin
        if self._fakes is not None and host not in self._fakes:
            return await super()._connect(origin, connect_s)  # a real server (a simulator)
        refused = self._refused.get(host.split(".")[0])
        if refused is not None:
            address, refused_port = refused.getsockname()
            return await super()._connect(("http", address, refused_port), connect_s)
        fake = f"{scheme}://{host}:{port}"
        self._home = self._home or asyncio.get_running_loop()
        if fake not in self.loopback.urls:
            await self.loopback.serve(fake)
        listener = urlsplit(self.loopback.urls[fake])
        return await super()._connect(("http", listener.hostname or "", listener.port or 80), connect_s)

    async def __aenter__(self) -> LoopbackClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Wait until every stream this client closed is closed at the fake too, then close the
        client's connections and the listeners (their connection tasks end with them)."""
        home = self._home
        if home is not None and home is not asyncio.get_running_loop() and home.is_running():
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._aclose_here(), home))
        else:
            await self._aclose_here()

    async def _aclose_here(self) -> None:
        try:
            await self.loopback.settle()
        finally:
            await super().aclose()
            await self.loopback.aclose()
            for sock in self._refused.values():
                sock.close()


# A deadline short enough for a test to wait out (a fake that never answers), long enough for
# an answering fake on 127.0.0.1 on a loaded machine.
HANG_DEADLINE_S = 0.5


async def hang(request: httpx.Request, _body: Any) -> httpx.Response:
    """An upstream that took the request and never answers: what a timeout test needs over
    loopback, where a handler's ``httpx.ReadTimeout`` would be a reset (``ConnectError``-like).
    The client's deadline ends it; its close cancels this (``Loopback._one``)."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def at_loopback(snapshot: Any, urls: dict[str, str]) -> Any:
    """``snapshot`` with every fake URL (render and instances) replaced by its loopback address."""
    from dataclasses import replace

    instances = tuple(replace(i, url=urls.get(i.url.rstrip("/"), i.url)) for i in snapshot.instances)
    render = replace(snapshot.render, base_url=urls.get(snapshot.render.base_url.rstrip("/"), snapshot.render.base_url))
    return replace(snapshot, instances=instances, render=render)
