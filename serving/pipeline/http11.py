"""A lean HTTP/1.1 client for the coordinator's own upstreams: the render sidecar and the engines.

Why not httpx here: on the simulated fleet a third of the coordinator's CPU per request went
into httpx and httpcore (request and response models, header normalisation, the pool's locks,
one task hop per read), for three JSON posts and one SSE stream to servers we run ourselves.
This module speaks exactly what those servers need (uvicorn: ``Content-Length`` or chunked
bodies, keep-alive) on an ``asyncio.Protocol``, with connections kept per origin.

It keeps httpx's surface where the callers touch it (``post``, ``get``, ``stream``, a
``timeout`` of ``httpx.Timeout``, ``status_code``/``json()``/``aiter_lines()``) and raises
httpx's exception classes, so the callers classify failures one way whichever client they
hold (the tests hand them ``httpx.MockTransport`` clients).

Flow control: a connection stops reading from its socket once ``HIGH_WATER`` bytes wait
unread (and reads at most ``READ_SIZE`` at once), so a client that reads nothing holds the
engine back by TCP instead of the coordinator buffering the whole generation.
"""

from __future__ import annotations

import asyncio
import json as stdlib_json
import ssl
from collections import deque
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Mapping
from urllib.parse import urlsplit

import httpx
import orjson

# uvicorn closes an idle keep-alive connection after 5 s: never reuse one that old.
KEEPALIVE_S = 4.0
MAX_IDLE_PER_ORIGIN = 64
HIGH_WATER = 16 * 1024
# The most one socket read hands over (asyncio's default is 256 KiB): with HIGH_WATER, what a
# stream whose client reads nothing holds in this process.
READ_SIZE = 32 * 1024
DONE_FRAME = b"data: [DONE]\n\n"
# A stream whose SSE ended waits this long for the body's last chunk before its connection goes.
DRAIN_S = 1.0

Origin = tuple[str, str, int]  # scheme, host, port


def dumps(payload: Any) -> bytes:
    """JSON bytes of a request body: orjson, or the standard library for what orjson refuses
    (integers past 64 bits)."""
    try:
        return orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return stdlib_json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def loads(raw: bytes | str) -> Any:
    """Parse an upstream's JSON; the standard library takes what orjson refuses (``NaN``,
    ``-Infinity``: Python's encoder writes them, and vLLM's logprobs can be ``-inf``)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return stdlib_json.loads(raw)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time into body pieces."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self.idle_since = 0.0
        self._buf = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.on_complete: Any = None  # called once the current response has been read whole
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.complete = False
        self.received = False  # any byte of this response arrived
        self.keep_alive = True
        self.pieces: deque[bytes] = deque()
        self.buffered = 0
        self._remaining = -1  # Content-Length left; -1 chunked or until close
        self._chunked = False
        self._chunk_left = 0  # data bytes left in the current chunk; -1 reading its CRLF
        self._trailers = False

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if hasattr(transport, "max_size"):  # asyncio's selector transports read this much at once
            transport.max_size = READ_SIZE

    def data_received(self, data: bytes) -> None:
        if self.complete:
            self.keep_alive = False  # nothing is expected between responses: never reuse this one
            return
        self.received = True
        self._buf += data
        try:
            self._parse()
        except ValueError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed response: {exc}"))
            return
        self._wake()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self.head_done and not self._chunked and self._remaining < 0 and not self.complete:
            self._finish()  # a body delimited by the close itself
        self.lost = exc or ConnectionResetError("connection closed")
        self._wake()

    # -- parsing

    def _parse(self) -> None:
        if not self.head_done:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > 65536:
                    raise ValueError("response head too large")
                return
            self._parse_head(bytes(self._buf[:end]))
            del self._buf[: end + 4]
        if self._chunked:
            self._parse_chunks()
        elif self._remaining >= 0:
            take = min(len(self._buf), self._remaining)
            if take:
                self._push(bytes(self._buf[:take]))
                del self._buf[:take]
                self._remaining -= take
            if self._remaining == 0:
                self._finish()
        elif self._buf:
            self._push(bytes(self._buf))
            self._buf.clear()

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ValueError(f"bad status line {lines[0][:80]!r}")
        self.status = int(parts[1])
        headers = self.headers
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"bad header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        self.head_done = True
        if headers.get("connection", "").lower() == "close" or parts[0] == "HTTP/1.0":
            self.keep_alive = False
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunked = True
        elif "content-length" in headers:
            self._remaining = int(headers["content-length"])
        elif self.status in (204, 304) or 100 <= self.status < 200:
            self._remaining = 0
        else:
            self.keep_alive = False  # the body ends when the server closes

    def _parse_chunks(self) -> None:
        buf = self._buf
        while True:
            if self._trailers:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                line = bytes(buf[:end])
                del buf[: end + 2]
                if not line:
                    self._finish()
                    return
                continue
            if self._chunk_left > 0:
                take = min(len(buf), self._chunk_left)
                if not take:
                    return
                self._push(bytes(buf[:take]))
                del buf[:take]
                self._chunk_left -= take
                if self._chunk_left:
                    return
                self._chunk_left = -1
            if self._chunk_left == -1:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise ValueError("chunk not followed by CRLF")
                del buf[:2]
                self._chunk_left = 0
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) > 1024:
                    raise ValueError("chunk size line too long")
                return
            size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
            del buf[: end + 2]
            if size == 0:
                self._trailers = True
            else:
                self._chunk_left = size

    def _push(self, data: bytes) -> None:
        self.pieces.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def _finish(self) -> None:
        self.complete = True
        if self._buf:
            self.keep_alive = False  # bytes past the response: out of step, never reuse
        if self.on_complete is not None:
            callback, self.on_complete = self.on_complete, None
            callback(self)

    def _fail(self, exc: BaseException) -> None:
        self.lost = exc
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the caller's side

    async def _wait(self, timeout_s: float | None, what: str) -> None:
        waiter = self._waiter = self.loop.create_future()
        timer = None
        if timeout_s is not None:
            timer = self.loop.call_later(timeout_s, _expire, waiter, what)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def read_head(self, timeout_s: float | None) -> None:
        while not self.head_done:
            if self.lost is not None:
                raise _lost(self.lost, "before the response head")
            await self._wait(timeout_s, "waiting for the response head")

    async def read_piece(self, timeout_s: float | None) -> bytes | None:
        """The next piece of the body, or None once it has been read whole."""
        while True:
            if self.pieces:
                piece = self.pieces.popleft()
                self.buffered -= len(piece)
                if self._paused and self.buffered <= HIGH_WATER // 2 and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                return piece
            if self.complete:
                return None
            if self.lost is not None:
                raise _lost(self.lost, "in the middle of the response body")
            await self._wait(timeout_s, "waiting for the response body")

    def start(self, request: bytes) -> None:
        self._reset()
        assert self.transport is not None
        self.transport.write(request)

    def reusable(self) -> bool:
        return (
            self.complete and self.keep_alive and self.lost is None and self.transport is not None
            and not self.transport.is_closing() and not self._buf
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None], what: str) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout(f"timed out {what}"))


def _lost(exc: BaseException, where: str) -> httpx.TransportError:
    if isinstance(exc, httpx.TransportError):
        return exc
    return httpx.RemoteProtocolError(f"server closed the connection {where} ({exc!r})")


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

    def __init__(self, conn: _Connection, read_timeout_s: float | None) -> None:
        self._conn = conn
        self._timeout = read_timeout_s
        self.status_code = conn.status
        self.headers = conn.headers
        self.sse_done = False  # the body's last piece ended the SSE stream

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while True:
            piece = await self._conn.read_piece(self._timeout)
            if piece is None:
                return
            self.sse_done = piece.endswith(DONE_FRAME)
            yield piece

    async def aiter_lines(self) -> AsyncIterator[str]:
        pending = b""
        async for piece in self.aiter_raw():
            pending += piece
            if b"\n" not in piece:
                continue
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if pending:
            yield pending.rstrip(b"\r").decode("utf-8", errors="replace")

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self.aiter_raw()])


class Http11Client:
    """Keep-alive connections per origin, bound to the event loop that first used them."""

    def __init__(self, timeout: httpx.Timeout | None = None, *, idle_per_origin: int = MAX_IDLE_PER_ORIGIN) -> None:
        self.timeout = timeout or httpx.Timeout(60.0, connect=2.0)
        self._idle_cap = idle_per_origin
        self._idle: dict[Origin, list[_Connection]] = {}
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
        origin, conn = await self._exchange(method, url, body, headers, connect_s, read_s)
        try:
            pieces = []
            while (piece := await conn.read_piece(read_s)) is not None:
                pieces.append(piece)
        except BaseException:
            conn.close()
            raise
        reply = Reply(conn.status, conn.headers, b"".join(pieces))
        self._release(origin, conn)
        return reply

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: httpx.Timeout | float | None = None,
    ) -> AsyncIterator[StreamReply]:
        connect_s, read_s = self._timeouts(timeout)
        body = None if json is None else dumps(json)
        origin, conn = await self._exchange(method, url, body, headers, connect_s, read_s)
        try:
            reply = StreamReply(conn, read_s)
            yield reply
        except BaseException:
            conn.close()
            raise
        if conn.complete:
            self._release(origin, conn)
        elif reply.sse_done and conn.lost is None:
            # The stream said [DONE]; only the body's last chunk is still on its way.
            conn.on_complete = lambda c: self._release(origin, c)
            conn.loop.call_later(DRAIN_S, _close_if_draining, conn)
        else:
            conn.close()  # a body left unread: the server sees the close (vLLM aborts on it)

    async def aclose(self) -> None:
        self.is_closed = True
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
    ) -> tuple[Origin, _Connection]:
        """Send the request and read the response head, on a kept-alive connection when one is idle.

        A kept-alive connection the server closed before it sent one byte back (it went away
        between two requests, or closed an idle one at the same moment) is tried once more on
        a new connection, as urllib3 does; any other failure is the caller's.
        """
        parts = urlsplit(url)
        scheme = parts.scheme
        host = parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)
        origin = (scheme, host, port)
        path = (parts.path or "/") + ("?" + parts.query if parts.query else "")
        request = self._request_bytes(origin, parts.netloc, method, path, body, headers)
        conn = self._idle_connection(origin)
        if conn is not None:
            conn.start(request)
            try:
                await conn.read_head(read_s)
                return origin, conn
            except httpx.RemoteProtocolError:
                conn.close()
                if conn.received:
                    raise
            except BaseException:
                conn.close()
                raise
        conn = await self._connect(origin, connect_s)
        conn.start(request)
        try:
            await conn.read_head(read_s)
        except BaseException:
            conn.close()
            raise
        return origin, conn

    def _request_bytes(
        self, origin: Origin, netloc: str, method: str, path: str, body: bytes | None, headers: Mapping[str, str] | None
    ) -> bytes:
        head = self._heads.get(origin)
        if head is None:
            head = self._heads[origin] = f"Host: {netloc}\r\nAccept: */*\r\nUser-Agent: motorsite\r\n".encode("latin-1")
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
        if body is None:
            return f"{method} {path} HTTP/1.1\r\n".encode("latin-1") + head + extra.encode("latin-1") + b"\r\n"
        if not headers or not any(k.lower() == "content-type" for k in headers):
            extra += "Content-Type: application/json\r\n"
        line = f"{method} {path} HTTP/1.1\r\nContent-Length: {len(body)}\r\n".encode("latin-1")
        return line + head + extra.encode("latin-1") + b"\r\n" + body

    def _idle_connection(self, origin: Origin) -> _Connection | None:
        conns = self._idle.get(origin)
        if not conns:
            return None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while conns:
            conn = conns.pop()
            if conn.loop is loop and conn.reusable() and now - conn.idle_since < KEEPALIVE_S:
                return conn
            conn.close()
        return None

    async def _connect(self, origin: Origin, connect_s: float | None) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = None
        if scheme == "https":
            tls = self._ssl = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(lambda: _Connection(loop), host, port, ssl=tls)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    def _release(self, origin: Origin, conn: _Connection) -> None:
        if self.is_closed or not conn.reusable():
            conn.close()
            return
        conns = self._idle.setdefault(origin, [])
        if len(conns) >= self._idle_cap:
            conn.close()
            return
        conn.idle_since = conn.loop.time()
        conns.append(conn)


def _close_if_draining(conn: _Connection) -> None:
    if conn.on_complete is not None:
        conn.on_complete = None
        conn.close()
