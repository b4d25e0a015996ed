"""A lean HTTP/1.1 client for the coordinator's own upstreams: the render sidecar and the engines.

Why not httpx here: on the simulated fleet a third of the coordinator's CPU per request went
into httpx and httpcore (request and response models, header normalisation, the pool's locks,
one task hop per read), for three JSON posts and one SSE stream to servers we run ourselves.
This module speaks exactly what those servers need (uvicorn: ``Content-Length`` or chunked
bodies, keep-alive) on an ``asyncio.Protocol``, with connections kept per origin.

It keeps httpx's surface where the callers touch it (``post``, ``get``, ``stream``, a
``timeout`` of ``httpx.Timeout``, ``status_code``/``json()``/``aiter_raw()``) and raises
httpx's exception classes, so the callers classify failures one way whichever client they
hold.

Flow control (``http11_wire.py``): a streamed body is read from its socket only while its reader
waits for it (a read that comes while it is away takes ``TRICKLE_SIZE`` bytes and shuts the socket),
a body of known length until ``HIGH_WATER`` bytes wait unread, so a client that reads nothing holds
the engine back by TCP instead of the coordinator buffering the whole generation. Responses are parsed
by llhttp (``httptools``), strictly; see ``http11_wire.py`` for what is refused and bounded.

A request is written once. A kept-alive connection is checked right before the write (the loop
saw it close, or its socket has the server's FIN waiting: ``Connection.dropped``) and a new one
opened in its place; once the request is written, any failure is the caller's, even before the
first byte of the answer: a generate or a prefill may already be running on the engine (a
non-streaming one sends nothing until it is done), so only the caller's attempt policy may decide
to send it again, under a new attempt, with the engine counted.

Deadlines (``timeout``, an ``httpx.Timeout`` or seconds): ``connect`` bounds opening a connection;
``read`` bounds a whole reply from the write to its last byte (``post``, ``get``) and, for a
stream, the response head and then each SSE event: the time from one event's end to the next one's
(``StreamReply``), so a trickle of bytes that never completes an event does not keep it alive. A
caller's deadline for a whole stream is an ``asyncio.timeout`` around it (cancellation closes the
connection).

A sidecar on the coordinator's own machine may listen on a unix socket (``vllm launch render
--uds PATH``): its URLs are ``http+unix://`` with the socket's path percent-encoded as the
authority (``unix_base_url``; the convention of requests-unixsocket and docker-py), so a base URL
plus a route is still one URL. Its connections are pooled, bounded and timed like any other
origin's, and its requests carry ``Host: localhost`` (a socket path is no host name).
"""

from __future__ import annotations

import asyncio
import re
import ssl
import weakref
from types import TracebackType
from typing import Any, AsyncIterator, Mapping
from urllib.parse import quote, unquote, urlsplit

import httpx

from serving.pipeline.http11_wire import HIGH_WATER, READ_SIZE, Connection
from serving.pipeline.json_codec import dumps, loads

__all__ = ["HIGH_WATER", "READ_SIZE", "UNIX_SCHEME", "Http11Client", "Reply", "StreamReply", "unix_base_url"]

# uvicorn closes an idle keep-alive connection after 5 s: never reuse one that old.
KEEPALIVE_S = 4.0
MAX_IDLE_PER_ORIGIN = 64
DONE_FRAME = b"data: [DONE]\n\n"
# A stream whose SSE ended waits this long for the body's last chunk before its connection goes.
DRAIN_S = 1.0
# The largest reply read whole (render, derender, a non-streaming generate or native answer, an
# error body): a 32k-token prompt renders to about 200 KiB and n=16 choices of 2k tokens with top-20
# logprobs to about 20 MiB; past 64 MiB it is an upstream gone wrong, not an answer to hold.
MAX_REPLY_BYTES = 64 * 1024 * 1024

Origin = tuple[str, str, int]  # scheme, host, port; for UNIX_SCHEME: scheme, socket path, 0
UNIX_SCHEME = "http+unix"


def unix_base_url(path: str) -> str:
    """The base URL of an HTTP server on the unix socket at ``path``: ``http+unix://%2Frun%2Fr.sock``."""
    return f"{UNIX_SCHEME}://{quote(path, safe='')}"


class Reply:
    """A whole response: what the callers read of ``httpx.Response``."""

    __slots__ = ("status_code", "headers", "content")

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code = status_code
        self.headers = headers
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return loads(self.content)


class StreamReply:
    """A response whose body is read as it arrives."""

    __slots__ = (
        "_conn", "_timeout", "_max_bytes", "status_code", "headers", "sse_done", "whole_reads", "_event_deadline",
        "_ends_line", "_cut",
    )

    def __init__(self, conn: Connection, read_timeout_s: float | None, *, max_bytes: int = MAX_REPLY_BYTES) -> None:
        self._conn = conn
        self._timeout = read_timeout_s
        self._max_bytes = max_bytes
        self.status_code = conn.status
        self.headers = conn.headers
        self.sse_done = False  # the body's last piece ended the SSE stream
        # Each piece all that arrived since the last (``Connection.read_piece``), not one chunk.
        self.whole_reads = False
        # When the next SSE event must have ended: pushed on only when one does (``_Pieces``).
        self._event_deadline = _deadline(conn.loop, read_timeout_s)
        self._ends_line = False  # the last piece ended with a newline: the next may end an event
        self._cut = b""  # the last piece's tail when it did not end an event

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return _Pieces(self)

    async def aread(self) -> bytes:
        """The rest of the body, at most ``MAX_REPLY_BYTES`` of it (an error body, in practice)."""
        declared = self.headers.get("content-length")  # plain digits: llhttp checked them
        if declared is not None and int(declared) > self._max_bytes:
            raise httpx.RemoteProtocolError(f"a body of {declared} bytes, over the reply limit of {self._max_bytes}")
        pieces, size = [], 0
        async for piece in self.aiter_raw():
            size += len(piece)
            if size > self._max_bytes:
                raise httpx.RemoteProtocolError(f"a body over the reply limit of {self._max_bytes} bytes")
            pieces.append(piece)
        return b"".join(pieces)


class _Pieces:
    """``StreamReply.aiter_raw``: a plain async iterator, not a generator, so that between reads
    nothing here still holds the piece it handed over (up to ``WHOLE_READ_SIZE`` and a trickle
    with whole reads, while a stalled client's stream waits)."""

    def __init__(self, reply: StreamReply) -> None:
        self._reply = reply

    def __aiter__(self) -> _Pieces:
        return self

    async def __anext__(self) -> bytes:
        reply = self._reply
        piece = await reply._conn.read_piece(reply._event_deadline, whole=reply.whole_reads)
        if piece is None:
            raise StopAsyncIteration
        # The [DONE] frame may come in two pieces: a read while the reader is away takes only
        # ``http11_wire.TRICKLE_SIZE`` bytes.
        reply.sse_done = piece.endswith(DONE_FRAME) or (reply._cut != b"" and (reply._cut + piece).endswith(DONE_FRAME))
        # An event ended (a blank line): the stall deadline starts again from now. Single bytes
        # that never end one leave it where it was.
        if b"\n\n" in piece or b"\n\r\n" in piece or (reply._ends_line and piece[:1] in (b"\n", b"\r")):
            reply._event_deadline = _deadline(reply._conn.loop, reply._timeout)
        reply._ends_line = piece[-1:] == b"\n"
        reply._cut = b"" if piece.endswith(b"\n\n") else piece[-len(DONE_FRAME):]
        return piece


class Http11Client:
    """Keep-alive connections per origin, bound to the event loop that first used them."""

    def __init__(
        self,
        timeout: httpx.Timeout | None = None,
        *,
        idle_per_origin: int = MAX_IDLE_PER_ORIGIN,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        self.timeout = timeout or httpx.Timeout(60.0, connect=2.0)
        self._idle_cap = idle_per_origin
        self._max_reply = max_reply_bytes
        self._idle: dict[Origin, list[Connection]] = {}
        # Per loop, the timer that closes its idle connections once they are too old to reuse.
        # Weak both ways, as ``render/window.py`` keeps its loops: a loop closed with its sweep
        # pending never runs it, and neither this client nor the timer (which holds its loop: a
        # value holding its key would keep a weak key alive) may keep that loop alive. A pending
        # timer is held by its loop's schedule.
        self._sweeps: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.ref[asyncio.TimerHandle]] = (
            weakref.WeakKeyDictionary())
        self._heads: dict[Origin, bytes] = {}
        self._ssl: ssl.SSLContext | None = None
        self.is_closed = False

    async def post(
        self,
        url: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: httpx.Timeout | float | None = None,
    ) -> Reply:
        body = dumps(json) if content is None else content
        return await self._send("POST", url, body, headers, timeout)

    async def get(
        self, url: str, *, headers: Mapping[str, str] | None = None, timeout: httpx.Timeout | float | None = None
    ) -> Reply:
        return await self._send("GET", url, None, headers, timeout)

    async def _send(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str] | None, timeout: Any
    ) -> Reply:
        connect_s, read_s = self._timeouts(timeout)
        origin, conn, deadline = await self._exchange(method, url, body, headers, connect_s, read_s, self._max_reply)
        try:
            pieces = []
            # One deadline for the head and the whole body, from the write on.
            while (piece := await conn.read_piece(deadline)) is not None:
                pieces.append(piece)
        except BaseException:
            conn.close()
            raise
        reply = Reply(conn.status, conn.headers, b"".join(pieces))
        self._release(origin, conn)
        return reply

    def stream(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: httpx.Timeout | float | None = None,
    ) -> _Stream:
        """``async with client.stream(...) as reply``: the request is sent on entry; on exit the
        connection goes back to the pool if the body was read whole, else it is closed."""
        return _Stream(self, method, url, json, headers, timeout)

    async def aclose(self) -> None:
        self.is_closed = True
        for sweep in self._sweeps.values():
            if (handle := sweep()) is not None:
                handle.cancel()
        self._sweeps.clear()
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    # -- connections

    def _timeouts(self, timeout: httpx.Timeout | float | None) -> tuple[float | None, float | None]:
        t = self.timeout if timeout is None else timeout
        if isinstance(t, httpx.Timeout):
            return t.connect, t.read
        return t, t

    async def _exchange(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str] | None,
        connect_s: float | None,
        read_s: float | None,
        body_limit: int | None,
    ) -> tuple[Origin, Connection, float | None]:
        """Send the request once and read the response head; returns the connection and the
        deadline (``read_s`` from the write) the head was read under.

        A kept-alive connection is used only if nothing says the server closed it
        (``_idle_connection``); a failure after the write is the caller's, never retried here
        (the module docstring says why).
        """
        parts = urlsplit(url)
        scheme = parts.scheme
        if scheme == UNIX_SCHEME:
            # The authority is the socket's path (case kept: not ``hostname``, which lowers it).
            origin, netloc = (scheme, unquote(parts.netloc), 0), "localhost"
        else:
            origin = (scheme, parts.hostname or "", parts.port or (443 if scheme == "https" else 80))
            netloc = parts.netloc
        path = (parts.path or "/") + ("?" + parts.query if parts.query else "")
        request = self._request_bytes(origin, netloc, method, path, body, headers)
        conn = self._idle_connection(origin)
        if conn is None:
            conn = await self._connect(origin, connect_s)
        conn.start(request, body_limit=body_limit)
        deadline = _deadline(conn.loop, read_s)
        try:
            await conn.read_head(deadline)
        except BaseException:
            conn.close()
            raise
        return origin, conn, deadline

    def _request_bytes(
        self, origin: Origin, netloc: str, method: str, path: str, body: bytes | None, headers: Mapping[str, str] | None
    ) -> bytes:
        head = self._heads.get(origin)
        if head is None:
            _check_field("Host", netloc)
            head = self._heads[origin] = f"Host: {netloc}\r\nAccept: */*\r\nUser-Agent: motorsite\r\n".encode("latin-1")
        if not _TOKEN.fullmatch(method) or _UNSAFE_TARGET.search(path):
            raise ValueError(f"refusing to send {method[:20]!r} {path[:80]!r}: not a method and a request target")
        extra = ""
        if headers:
            for k, v in headers.items():
                _check_field(k, v)
            extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if body is None:
            return f"{method} {path} HTTP/1.1\r\n".encode("latin-1") + head + extra.encode("latin-1") + b"\r\n"
        if not headers or not any(k.lower() == "content-type" for k in headers):
            extra += "Content-Type: application/json\r\n"
        line = f"{method} {path} HTTP/1.1\r\nContent-Length: {len(body)}\r\n".encode("latin-1")
        return line + head + extra.encode("latin-1") + b"\r\n" + body

    def _idle_connection(self, origin: Origin) -> Connection | None:
        conns = self._idle.get(origin)
        if not conns:
            return None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while conns:
            conn = conns.pop()
            # dropped(): one poll(2) of the socket, the proof that the request about to be written
            # goes to a connection the server had not closed when it was written.
            if conn.loop is loop and conn.reusable() and now - conn.idle_since < KEEPALIVE_S and not conn.dropped():
                return conn
            conn.close()
        return None

    async def _connect(self, origin: Origin, connect_s: float | None) -> Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = None
        if scheme == "https":
            tls = self._ssl = self._ssl or ssl.create_default_context()
        where = f"unix:{host}" if scheme == UNIX_SCHEME else f"{host}:{port}"
        try:
            async with asyncio.timeout(connect_s):
                if scheme == UNIX_SCHEME:
                    _, conn = await loop.create_unix_connection(lambda: Connection(loop), host)
                else:
                    _, conn = await loop.create_connection(lambda: Connection(loop), host, port, ssl=tls)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {where} timed out") from exc
        except OSError as exc:
            # A missing socket file (the sidecar not started, or gone) is a refusal like a closed port.
            raise httpx.ConnectError(f"cannot connect to {where}: {exc}") from exc
        return conn

    def _release(self, origin: Origin, conn: Connection) -> None:
        if self.is_closed or not conn.reusable():
            conn.close()
            return
        conns = self._idle.setdefault(origin, [])
        if len(conns) >= self._idle_cap:
            conn.close()
            return
        conn.idle_since = conn.loop.time()
        # The reply that was read has them if its caller wants them; an idle connection needs none.
        conn.headers = {}
        conns.append(conn)
        if conn.loop not in self._sweeps:
            self._sweeps[conn.loop] = weakref.ref(conn.loop.call_later(KEEPALIVE_S, self._sweep, conn.loop))

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close ``loop``'s connections idle for ``KEEPALIVE_S``, and come back when the next one
        will be. One is never reused past that age (``_idle_connection``), but until then it was
        closed only when a request met it, and requests take the newest: after a burst of streams
        the oldest stayed open, a transport, socket and connection each (about 1.5 KiB; issue 31)."""
        del self._sweeps[loop]
        now = loop.time()
        oldest = None
        for conns in self._idle.values():
            kept = []
            for conn in conns:
                if conn.loop is not loop:
                    kept.append(conn)
                elif now - conn.idle_since >= KEEPALIVE_S:
                    conn.close()
                else:
                    kept.append(conn)
                    oldest = conn.idle_since if oldest is None else min(oldest, conn.idle_since)
            conns[:] = kept
        if oldest is not None:
            self._sweeps[loop] = weakref.ref(loop.call_later(oldest + KEEPALIVE_S - now, self._sweep, loop))


class _Stream:
    """``Http11Client.stream``'s context manager. A class, not an ``asynccontextmanager``: a
    generator's suspended frame, its wrapper and asyncio's weak registry of async generators would
    hold about 1 KiB more a prompt for as long as the stream lasts (issue 31's 64 KiB a silent
    stream)."""

    __slots__ = ("_client", "_method", "_url", "_json", "_headers", "_timeout", "_origin", "_conn", "_reply")

    def __init__(
        self, client: Http11Client, method: str, url: str, json: Any, headers: Mapping[str, str] | None,
        timeout: httpx.Timeout | float | None,
    ) -> None:
        self._client = client
        self._method = method
        self._url = url
        self._json = json
        self._headers = headers
        self._timeout = timeout
        self._origin: Origin | None = None
        self._conn: Connection | None = None
        self._reply: StreamReply | None = None

    async def __aenter__(self) -> StreamReply:
        client = self._client
        connect_s, read_s = client._timeouts(self._timeout)
        json, self._json = self._json, None
        body = None if json is None else dumps(json)
        # Sent: neither the body nor the payload it was made of is held for the life of the stream
        # (a generate request is a few KiB parsed; issue 31's 64 KiB a silent stream).
        del json
        origin, conn, _ = await client._exchange(
            self._method, self._url, body, self._headers, connect_s, read_s, None
        )
        del body
        self._origin, self._conn = origin, conn
        try:
            reply = self._reply = StreamReply(conn, read_s, max_bytes=client._max_reply)
        except BaseException:
            conn.close()
            raise
        return reply

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        conn, reply, origin = self._conn, self._reply, self._origin
        assert conn is not None and reply is not None and origin is not None
        client = self._client
        if exc_type is not None:
            conn.close()
            return
        if conn.complete:
            client._release(origin, conn)  # closed instead when it is paused with pieces unread
        elif reply.sse_done and conn.lost is None and not conn.pieces:
            # The stream said [DONE]; only the body's last chunk is still on its way (the socket
            # may be shut: a streamed body is read only while its reader waits).
            conn.resume()
            conn.on_complete = lambda c: client._release(origin, c)
            conn.loop.call_later(DRAIN_S, _close_if_draining, conn)
        else:
            conn.close()  # a body left unread: the server sees the close (vLLM aborts on it)


# A header name is an RFC 9110 token; a method too.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A header value: visible ASCII, spaces and tabs, obs-text; never CR, LF or NUL (RFC 9110 5.5).
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
# What would end or split a request line.
_UNSAFE_TARGET = re.compile(r"[\x00-\x20\x7f]")


def _check_field(name: str, value: str) -> None:
    """Refuse a header that would split the request (CR/LF) or is not a field at all: a value
    such as a request id may come from a client, and an injected line would be a request of its
    own on a kept-alive connection."""
    if not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
        raise ValueError(f"refusing to send header {name[:40]!r}: {value[:80]!r} is not a field value")


def _deadline(loop: asyncio.AbstractEventLoop, seconds: float | None) -> float | None:
    return None if seconds is None else loop.time() + seconds


def _close_if_draining(conn: Connection) -> None:
    if conn.on_complete is not None:
        conn.on_complete = None
        conn.close()
