"""One HTTP/1.1 client connection as an ``asyncio.Protocol``: the response parser (bodies by
``Content-Length``, by chunks or by the close) and read-side flow control (``http11.py``).

A connection stops reading from its socket once ``HIGH_WATER`` bytes wait unread and reads at
most ``READ_SIZE`` at once, so what a stream whose client reads nothing holds in this process is
bounded by their sum; the rest waits in the engine, held back by TCP. A body of known length
(``Content-Length``: render, derender and non-streaming generate replies) is read whole by its
caller anyway, so it is read ``BODY_READ_SIZE`` at a time: a long prompt's render reply (200 KiB
of token ids for 32k tokens) takes a sixteenth of the reads.

It never keeps its socket shut for longer than ``PAUSE_MAX_S`` at a time, though: an engine that
has finished hands its last bytes to the kernel, and its server (uvicorn, vLLM's keep-alive of 5 s)
closes the connection a few seconds later; the kernel then keeps that orphaned socket, with the
tail of the output unsent, only while its zero-window probes back off, and kills it (the next
read here gets a reset, the tail is lost) once they reach two minutes. Letting one more read in
every ``PAUSE_MAX_S`` keeps the window moving, so the orphan lives until it is read, at the cost
of at most ``READ_SIZE`` more held per ``PAUSE_MAX_S`` of a client's silence.

It is an ``asyncio.BufferedProtocol`` so that the read size is its own on every loop: asyncio's
selector loop and uvloop (uvicorn's loop when it is installed) both fill the buffer it hands out,
where uvloop's plain ``data_received`` reads up to 256 KiB at once and has no knob for it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

import httpx

# An engine's SSE event is a few hundred bytes, so a reader that keeps up at a real engine's pace
# never nears these; they bound what a stream whose client reads nothing holds per connection
# (issue 11: 64 KiB a stream; at 4 KiB + 4 KiB the two connections of a two-prompt stream held 18
# of its 80 KiB, at 2 + 2 they hold 9 of 64). They also bound what one coalescing read merges, up
# to about a dozen events a derender call: enough under load (bench/coalesce.py: a few calls for
# 65 engine chunks at 64 streams).
HIGH_WATER = 2 * 1024
# The most one socket read hands over for a response head and a streamed body (asyncio's default
# is 256 KiB).
READ_SIZE = 2 * 1024
# ... and for a body of known length, which its caller reads whole: 0.5 ms against 1.4 ms for a
# 218 KiB body read 4 KiB at a time (2-CPU EPYC).
BODY_READ_SIZE = 64 * 1024
# The longest a connection keeps its socket shut before it lets one more read in (see above).
PAUSE_MAX_S = 10.0


class _ReadBuffer(threading.local):
    """The buffer every connection of a thread's loop reads into. One is enough: both loops fill
    it and hand it to ``buffer_updated`` in one callback, before any other connection reads, and
    ``buffer_updated`` copies out what it got. One per connection would hold 2 KiB more per open
    stream (issue 11's memory budget), 64 KiB while a body of known length is read."""

    def __init__(self) -> None:
        self.view = memoryview(bytearray(max(READ_SIZE, BODY_READ_SIZE)))


_read_buffer = _ReadBuffer()


class Connection(asyncio.BufferedProtocol):
    """One keep-alive connection; parses one response at a time into body pieces."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self.idle_since = 0.0
        self._buf = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._pause_timer: asyncio.TimerHandle | None = None
        self._read_limit = READ_SIZE
        self.on_complete: Any = None  # called once the current response has been read whole
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.complete = False
        self.received = False  # any byte of this response arrived
        self.keep_alive = True
        # A list, not a deque: it holds a few pieces at most, and an empty deque weighs 0.7 KiB
        # (per connection, per open stream: issue 11's memory budget).
        self.pieces: list[bytes] = []
        self.buffered = 0
        self._remaining = -1  # Content-Length left; -1 chunked or until close
        self._chunked = False
        self._chunk_left = 0  # data bytes left in the current chunk; -1 reading its CRLF
        self._trailers = False

    # -- asyncio.BufferedProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's TCPTransport has the whole Transport interface
        # without subclassing asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return _read_buffer.view[: self._read_limit]

    def buffer_updated(self, nbytes: int) -> None:
        if self.complete:
            self.keep_alive = False  # nothing is expected between responses: never reuse this one
            return
        self.received = True
        self._buf += _read_buffer.view[:nbytes]
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
        self._stop_pause_timer()
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
            self._read_size(BODY_READ_SIZE)
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

    def _read_size(self, size: int) -> None:
        self._read_limit = size

    def _push(self, data: bytes) -> None:
        self.pieces.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
            self._pause_timer = self.loop.call_later(PAUSE_MAX_S, self._let_one_read_in)

    def _let_one_read_in(self) -> None:
        # The reader is still behind; the next read pauses the socket again (``_push``).
        self._pause_timer = None
        self._resume()

    def _resume(self) -> None:
        self._stop_pause_timer()
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def _stop_pause_timer(self) -> None:
        if self._pause_timer is not None:
            self._pause_timer.cancel()
            self._pause_timer = None

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

    async def read_piece(self, timeout_s: float | None, *, whole: bool = False) -> bytes | None:
        """The next chunk of the body (waits for one), or None once it has been read whole.

        ``whole``: all of the body that arrived and was not read yet, in one piece. A coalescing
        stream reader reads so (derender/coalesce.py): it sees at once every event that queued
        while it was busy derendering, and merges them. A reader that takes events one by one
        reads chunk by chunk instead, so what it holds parsed is one chunk's events.
        """
        while True:
            if self.pieces:
                pieces = self.pieces
                if whole and len(pieces) > 1:
                    piece = b"".join(pieces)
                    pieces.clear()
                else:
                    piece = pieces.pop(0)
                self.buffered -= len(piece)
                if self._paused and self.buffered <= HIGH_WATER // 2:
                    self._resume()
                return piece
            if self.complete:
                return None
            if self.lost is not None:
                raise _lost(self.lost, "in the middle of the response body")
            await self._wait(timeout_s, "waiting for the response body")

    def start(self, request: bytes) -> None:
        self._reset()
        assert self.transport is not None
        self._read_size(READ_SIZE)  # the last response may have been a body of known length
        self.transport.write(request)

    def reusable(self) -> bool:
        return (
            self.complete and self.keep_alive and self.lost is None and self.transport is not None
            and not self.transport.is_closing() and not self._buf
        )

    def close(self) -> None:
        self._stop_pause_timer()
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None], what: str) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout(f"timed out {what}"))


def _lost(exc: BaseException, where: str) -> httpx.TransportError:
    if isinstance(exc, httpx.TransportError):
        return exc
    return httpx.RemoteProtocolError(f"server closed the connection {where} ({exc!r})")
