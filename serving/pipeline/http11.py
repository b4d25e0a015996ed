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

Flow control (``http11_wire.py``): a connection stops reading from its socket once ``HIGH_WATER`` bytes wait
unread (and reads at most ``READ_SIZE`` at once), so a client that reads nothing holds the
engine back by TCP instead of the coordinator buffering the whole generation.
"""

from __future__ import annotations

import asyncio
import json as stdlib_json
import ssl
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Mapping
from urllib.parse import urlsplit

import httpx
import orjson

from serving.pipeline.http11_wire import HIGH_WATER, READ_SIZE, Connection

__all__ = ["HIGH_WATER", "READ_SIZE", "Http11Client", "Reply", "StreamReply", "dumps", "loads"]

# uvicorn closes an idle keep-alive connection after 5 s: never reuse one that old.
KEEPALIVE_S = 4.0
MAX_IDLE_PER_ORIGIN = 64
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

    def __init__(self, conn: Connection, read_timeout_s: float | None) -> None:
        self._conn = conn
        self._timeout = read_timeout_s
        self.status_code = conn.status
        self.headers = conn.headers
        self.sse_done = False  # the body's last piece ended the SSE stream
        # Each piece all that arrived since the last (``Connection.read_piece``), not one chunk.
        self.whole_reads = False

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return _Pieces(self)

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


class _Pieces:
    """``StreamReply.aiter_raw``: a plain async iterator, not a generator, so that between reads
    nothing here still holds the piece it handed over (up to ``HIGH_WATER`` + ``READ_SIZE``
    bytes with whole reads, while a stalled client's stream waits)."""

    def __init__(self, reply: StreamReply) -> None:
        self._reply = reply

    def __aiter__(self) -> _Pieces:
        return self

    async def __anext__(self) -> bytes:
        reply = self._reply
        piece = await reply._conn.read_piece(reply._timeout, whole=reply.whole_reads)
        if piece is None:
            raise StopAsyncIteration
        reply.sse_done = piece.endswith(DONE_FRAME)
        return piece


class Http11Client:
    """Keep-alive connections per origin, bound to the event loop that first used them."""

    def __init__(self, timeout: httpx.Timeout | None = None, *, idle_per_origin: int = MAX_IDLE_PER_ORIGIN) -> None:
        self.timeout = timeout or httpx.Timeout(60.0, connect=2.0)
        self._idle_cap = idle_per_origin
        self._idle: dict[Origin, list[Connection]] = {}
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
        del body  # sent: not held for the life of the stream
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
    ) -> tuple[Origin, Connection]:
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

    def _idle_connection(self, origin: Origin) -> Connection | None:
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

    async def _connect(self, origin: Origin, connect_s: float | None) -> Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = None
        if scheme == "https":
            tls = self._ssl = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(lambda: Connection(loop), host, port, ssl=tls)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
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
        conns.append(conn)


def _close_if_draining(conn: Connection) -> None:
    if conn.on_complete is not None:
        conn.on_complete = None
        conn.close()
