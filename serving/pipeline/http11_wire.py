"""One HTTP/1.1 client connection as an ``asyncio.Protocol``: the response parser (llhttp, through
``httptools``) and read-side flow control (``http11.py``).

Parsing is llhttp's, in its strict mode (no leniency flag is set): it refuses what RFC 9112 calls
malformed, among others chunk sizes that are not plain hex (``-1``, ``+5``, ``0_5``, ``0x5``), a
``Content-Length`` that repeats or is not plain digits, ``Transfer-Encoding`` together with
``Content-Length``, folded (obs-fold) header lines, control characters in a header, bare-LF line
ends, and bytes after a ``Connection: close`` response. On top of it this module refuses what
llhttp would take but the coordinator never asks for: an HTTP version other than 1.0/1.1, a 101
(no upgrade was asked for), and any transfer coding other than exactly ``chunked`` (llhttp reads a
body of ``gzip, chunked``, or of an unknown coding, until the close; nothing here decodes them).
Interim ``1xx`` answers are skipped, as RFC 9110 15.2 asks; the final answer follows them.

Every buffer is bounded: the response head (interim answers included) by ``MAX_HEAD_BYTES``; the
chunk framing and trailers between two body bytes by ``MAX_FRAMING_BYTES`` (llhttp hands over a
header or trailer only once its line ends, so ``httptools`` keeps the partial line: these are what
it can grow to); a body read whole by its caller by ``body_limit`` (``Connection.start``), checked
against a declared ``Content-Length`` before any of it is read.

A streamed body (an engine stream: chunked or until the close, with no caller's limit) is read
from its socket only while its reader waits for it: a read that comes while the reader is away
(derendering what it took) takes at most ``TRICKLE_SIZE`` bytes and shuts the socket until the
reader is back, so a stream whose client reads nothing holds about that per connection in this
process; the rest waits in the engine, held back by TCP. A reader that takes all that arrived
at once (``read_piece``'s ``whole``: derender coalescing) finds the rest of what queued while it
was away in the kernel, and its read takes up to ``WHOLE_READ_SIZE`` of it: one derender call
merges as much as when the socket was read ahead (before 2026-12-06 a stream was read until
``HIGH_WATER`` bytes waited, ``READ_SIZE`` at a time, and a silent client's stream held up to
their sum per connection). Shutting and opening the socket costs two system calls, paid only
while the reader is behind. Any other body stops reading once ``HIGH_WATER`` bytes wait unread.
A body of known length (``Content-Length``: render, derender and non-streaming generate
replies) is read whole by its caller anyway, so it is read ``BODY_READ_SIZE`` at a time: a long
prompt's render reply (200 KiB of token ids for 32k tokens) takes a sixteenth of the reads.

It never keeps its socket shut for longer than ``PAUSE_MAX_S`` at a time, though: an engine that
has finished hands its last bytes to the kernel, and its server (uvicorn, vLLM's keep-alive of 5 s)
closes the connection a few seconds later; the kernel then keeps that orphaned socket, with the
tail of the output unsent, only while its zero-window probes back off, and kills it (the next
read here gets a reset, the tail is lost) once they reach two minutes. Letting one more read in
every ``PAUSE_MAX_S`` keeps the window moving, so the orphan lives until it is read, at the cost
of at most ``TRICKLE_SIZE`` (a streamed body; ``READ_SIZE`` another) more held per ``PAUSE_MAX_S``
of a client's silence. A paused connection is never reused (``reusable``): its next request would
wait up to ``PAUSE_MAX_S`` for its head; a streamed body read to its ``[DONE]`` lets its socket
read again so that its last chunk comes in and it can be pooled (``Http11Client.stream``).

It is an ``asyncio.BufferedProtocol`` so that the read size is its own on every loop: asyncio's
selector loop and uvloop (uvicorn's loop when it is installed) both fill the buffer it hands out,
where uvloop's plain ``data_received`` reads up to 256 KiB at once and has no knob for it.
"""

from __future__ import annotations

import asyncio
import select
import sys
import threading
from typing import Any, cast

import httptools
import httpx

# An engine's SSE event is a few hundred bytes, so a reader that keeps up at a real engine's pace
# never nears these; they bound what a stream whose client reads nothing holds per connection
# (issue 11: 64 KiB a stream; at 4 KiB + 4 KiB the two connections of a two-prompt stream held 18
# of its 80 KiB, at 2 + 2 they hold 9 of 64). They also bound what one coalescing read merges, up
# to about a dozen events a derender call: enough under load (bench/coalesce.py: a few calls for
# 65 engine chunks at 64 streams). At 1 + 1 KiB a silent stream held 8-10 KiB less with coalescing
# on, but a 64-token request at 64 streams took 12 derender calls instead of 7-8 (2026-12-06).
HIGH_WATER = 2 * 1024
# Header names, and the values of SHARED_VALUES, kept once per process by their bytes (at most
# _SHARED_MAX each, whatever an upstream sends): ``Connection.on_header``.
SHARED_VALUES = frozenset({"content-type", "transfer-encoding", "server", "connection", "content-encoding"})
_SHARED_MAX = 256
_HEADER_NAMES: dict[bytes, str] = {}
_HEADER_VALUES: dict[bytes, str] = {}
# The most one socket read hands over for a response head and a streamed body (asyncio's default
# is 256 KiB).
READ_SIZE = 2 * 1024
# ... and for a body of known length, which its caller reads whole: 0.5 ms against 1.4 ms for a
# 218 KiB body read 4 KiB at a time (2-CPU EPYC).
BODY_READ_SIZE = 64 * 1024
# A stream's body is read only while its reader waits for it (``Connection._pull``): a read that
# comes while the reader is busy (derendering what it took) takes at most this much and shuts the
# socket, so a stream whose client reads nothing holds about this per connection, the rest
# waiting in the kernel. Under an engine event (a few hundred bytes): the event is read whole
# once its reader is back.
TRICKLE_SIZE = 512
# What a waiting whole reader's read takes: what one coalescing read merged when the socket was
# read ahead to ``HIGH_WATER`` (2026-12-06: up to ``HIGH_WATER`` + ``READ_SIZE``), so a derender
# call covers as many events as before.
WHOLE_READ_SIZE = HIGH_WATER + READ_SIZE
# The longest a connection keeps its socket shut before it lets one more read in (see above).
PAUSE_MAX_S = 10.0
# A response head: uvicorn's and vLLM's are under 300 bytes; h11, uvicorn's own parser, refuses
# a head past 16 KiB. The room left is for a proxy's headers in between, never for a body.
MAX_HEAD_BYTES = 64 * 1024
# Chunk-size lines, chunk extensions and trailers with no body byte between them: a chunk line is
# a dozen bytes and uvicorn sends no trailers, so 8 KiB only ever trips on an upstream that feeds
# framing instead of data (or an endless trailer line, which httptools would otherwise keep whole).
# Both are checked after each read: what the parser holds stays under the limit plus one read.
MAX_FRAMING_BYTES = 8 * 1024


class _ReadBuffer(threading.local):
    """The buffer every connection of a thread's loop reads into. One is enough: both loops fill
    it and hand it to ``buffer_updated`` in one callback, before any other connection reads, and
    ``buffer_updated`` hands it to the parser, which copies out what it keeps. One per connection
    would hold 2 KiB more per open stream (issue 11's memory budget), 64 KiB while a body of known
    length is read."""

    def __init__(self) -> None:
        self.view = memoryview(bytearray(max(READ_SIZE, BODY_READ_SIZE)))


_read_buffer = _ReadBuffer()


class Malformed(ValueError):
    """What a parser callback raises on a response this client refuses; ``httptools`` wraps it."""


class Connection(asyncio.BufferedProtocol):
    """One keep-alive connection; parses one response at a time into body pieces.

    The parser's callbacks (``on_*``) are called by ``httptools`` from ``buffer_updated``.
    Slotted: a connection per open stream, and an instance dict of this many attributes would
    weigh a kilobyte of the 64 KiB a silent stream may hold (issue 11).
    """

    __slots__ = (
        "loop", "transport", "lost", "idle_since", "_waiter", "_paused", "_pause_timer", "_read_limit",
        "on_complete", "body_limit", "status", "headers", "head_done", "complete", "keep_alive", "pieces",
        "buffered", "_body_bytes", "_framing", "_interim", "_until_close", "_parser", "_whole", "_pull",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._pause_timer: asyncio.TimerHandle | None = None
        self._read_limit = READ_SIZE
        self.on_complete: Any = None  # called once the current response has been read whole
        self.body_limit: int | None = None  # the most body this response may have (None: a stream)
        # A parser only while a response is on its way (``start`` to ``_finish``): one weighs
        # 0.85 KiB with its bound callbacks, and an idle kept-alive connection needs none (issue
        # 11's 64 KiB a silent stream counts the pool's connections too). Making one takes 0.3 us.
        self._parser: httptools.HttpResponseParser | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.complete = False
        self.keep_alive = True
        # A list, not a deque: it holds a few pieces at most, and an empty deque weighs 0.7 KiB
        # (per connection, per open stream: issue 11's memory budget).
        self.pieces: list[bytes] = []
        self.buffered = 0
        self._body_bytes = 0
        self._framing = 0  # bytes fed since the last body byte (or since the head ended)
        self._interim = False  # the answer being parsed is a 1xx, to be skipped
        self._until_close = False  # the body ends when the server closes (no length, not chunked)
        self._whole = False  # its reader takes all that arrived at once (``read_piece``'s ``whole``)
        # A streamed body (no length, no caller's limit: an engine stream): read only while its
        # reader waits (``TRICKLE_SIZE``). Off for a head, and for a reply read whole anyway.
        self._pull = False

    # -- asyncio.BufferedProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's TCPTransport has the whole Transport interface
        # without subclassing asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._pull:
            if not self._reader_waits():
                return _read_buffer.view[:TRICKLE_SIZE]
            return _read_buffer.view[: WHOLE_READ_SIZE if self._whole else READ_SIZE]
        return _read_buffer.view[: self._read_limit]

    def _reader_waits(self) -> bool:
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def buffer_updated(self, nbytes: int) -> None:
        if self.complete:
            self.keep_alive = False  # nothing is expected between responses: never reuse this one
            return
        parser = self._parser
        if parser is None:
            self.keep_alive = False  # bytes no request asked for (or after the close): never reuse
            return
        self._framing += nbytes
        waits = self._reader_waits()
        try:
            parser.feed_data(_read_buffer.view[:nbytes])
            if self._framing > (MAX_FRAMING_BYTES if self.head_done else MAX_HEAD_BYTES):
                raise Malformed("response head too large" if not self.head_done else "chunk framing or trailers too large")
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("malformed response: an upgrade no request asked for"))
            return
        except (httptools.HttpParserError, Malformed) as exc:
            cause = exc.__context__ if isinstance(exc.__context__, Malformed) else exc
            self._fail(httpx.RemoteProtocolError(f"malformed response: {cause}"))
            return
        if self._pull and self.pieces and not waits and not self.complete and not self._paused:
            # Read while its reader is away: nothing more until it is back (``read_piece``).
            self._pause()
        if self._paused and self._whole and len(self.pieces) > 1:
            # Its reader is behind and will take them joined anyway: held as one piece meanwhile,
            # not a bytes object per chunk (33 bytes each and the allocator's rounding, a dozen
            # per paused stream). Done here, once per pause: the socket reads no more until then.
            self.pieces = [b"".join(self.pieces)]
        self._wake()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self._until_close and not self.complete and self.lost is None:
            self._finish()  # a body delimited by the close itself
        if self.lost is None:
            self.lost = exc or ConnectionResetError("connection closed")
        self._stop_pause_timer()
        self._wake()
        # The parser holds this connection's bound callbacks: a cycle only the collector would
        # free. Nothing is parsed after the close.
        self._parser = None

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:
            # Bytes after the response in the same read: out of step. The response stands (the
            # reader checks ``complete`` before ``lost``); the connection goes.
            raise Malformed("bytes after the end of the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            return  # a trailer: bounded by MAX_FRAMING_BYTES, of no use to any caller
        # Shared: an engine stream keeps its headers while it lasts, and these repeat on every
        # connection. Looked up by their bytes, not decoded and interned on every derender answer.
        key = _HEADER_NAMES.get(name)
        if key is None:
            key = sys.intern(name.decode("latin-1").lower())
            if len(_HEADER_NAMES) < _SHARED_MAX:
                _HEADER_NAMES[name] = key
        if key in SHARED_VALUES:
            text = _HEADER_VALUES.get(value)
            if text is None:
                text = sys.intern(value.decode("latin-1"))
                if len(_HEADER_VALUES) < _SHARED_MAX:
                    _HEADER_VALUES[value] = text
        else:
            text = value.decode("latin-1")
        known = self.headers.get(key)
        # A repeated field is one list (RFC 9110 5.3); llhttp refuses a repeated Content-Length.
        self.headers[key] = text if known is None else f"{known}, {text}"

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None  # called by the parser itself
        status = parser.get_status_code()
        if parser.get_http_version() not in ("1.1", "1.0"):
            raise Malformed(f"HTTP/{parser.get_http_version()} answer to an HTTP/1.1 request")
        if status < 200:
            if status == 101:
                raise Malformed("101 Switching Protocols: no upgrade was asked for")
            self._interim = True  # 100, 102, 103: informational, the final answer follows
            self.headers = {}
            return
        headers = self.headers
        coding = headers.get("transfer-encoding")
        if coding is not None:
            # Whole-value match, not a substring: "xchunked" or "gzip, chunked" would be a body
            # this client cannot decode (llhttp reads those until the close).
            if coding.strip().lower() != "chunked":
                raise Malformed(f"unsupported transfer coding {coding[:80]!r}")
            self._pull = self.body_limit is None
        elif "content-length" in headers:
            length = int(headers["content-length"])  # llhttp took only plain digits, once
            if self.body_limit is not None and length > self.body_limit:
                raise Malformed(f"a body of {length} bytes, over this reply's limit of {self.body_limit}")
            self._read_size(BODY_READ_SIZE)
        elif status not in (204, 304):
            self._until_close = True
            self._pull = self.body_limit is None
        self.status = status
        self.keep_alive = parser.should_keep_alive() and not self._until_close
        self.head_done = True
        self._framing = 0

    def on_body(self, body: bytes) -> None:
        self._framing = 0
        self._body_bytes += len(body)
        if self.body_limit is not None and self._body_bytes > self.body_limit:
            raise Malformed(f"a body over this reply's limit of {self.body_limit} bytes")
        self._push(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._finish()

    # -- flow control

    def _read_size(self, size: int) -> None:
        self._read_limit = size

    def _push(self, data: bytes) -> None:
        self.pieces.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER and not self._paused and not self._pull:
            self._pause()

    def _pause(self) -> None:
        if self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
            self._pause_timer = self.loop.call_later(PAUSE_MAX_S, self._let_one_read_in)

    def _let_one_read_in(self) -> None:
        # The reader is still behind; the next read pauses the socket again (``_push``).
        self._pause_timer = None
        self._resume()

    def resume(self) -> None:
        """Read the socket again (a streamed body's reader that will read no more, before the
        connection drains its last chunk to be pooled)."""
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
        # Dropped here, still running: it lives until ``feed_data`` returns, so bytes after the
        # response in the same read still reach ``on_message_begin``.
        self._parser = None
        if self._pull:
            self._pull = False
            self._resume()  # all of it is in: the connection may be pooled
        if self.on_complete is not None:
            callback, self.on_complete = self.on_complete, None
            callback(self)

    def _fail(self, exc: BaseException) -> None:
        self.lost = exc
        self.keep_alive = False
        self._stop_pause_timer()
        if self.transport is not None:
            self.transport.abort()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the caller's side

    async def _wait(self, deadline: float | None, what: str) -> None:
        waiter = self._waiter = self.loop.create_future()
        timer = None
        if deadline is not None:
            timer = self.loop.call_at(deadline, _expire, waiter, what)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def read_head(self, deadline: float | None) -> None:
        """Wait for the final response head until ``deadline`` (the loop's clock), not restarted
        by bytes that arrive in the meantime."""
        while not self.head_done:
            if self.lost is not None:
                raise _lost(self.lost, "before the response head")
            await self._wait(deadline, "waiting for the response head")

    async def read_piece(self, deadline: float | None, *, whole: bool = False) -> bytes | None:
        """The next chunk of the body (waits for one until ``deadline``), or None once it has
        been read whole.

        ``whole``: all of the body that arrived and was not read yet, in one piece. A coalescing
        stream reader reads so (derender/coalesce.py): it sees at once every event that queued
        while it was busy derendering, and merges them. A reader that takes events one by one
        reads chunk by chunk instead, so what it holds parsed is one chunk's events.
        """
        self._whole = whole
        polled = False
        while True:
            if self.pieces:
                if (whole and self._pull and self._paused and not polled and self.lost is None
                        and self._kernel_has_bytes()):
                    # What arrived while it was away may be more than the one read let in: a
                    # coalescing reader takes it all at once, so it waits for one read more (up
                    # to WHOLE_READ_SIZE and a trickle after it, as a reader that waited).
                    polled = True
                    self._resume()
                    await self._wait(deadline, "waiting for the response body")
                    continue
                pieces = self.pieces
                if whole and len(pieces) > 1:
                    piece = b"".join(pieces)
                    pieces.clear()
                else:
                    piece = pieces.pop(0)
                self.buffered -= len(piece)
                if self._paused and not self._pull and self.buffered <= HIGH_WATER // 2:
                    self._resume()
                return piece
            if self.complete:
                return None
            if self.lost is not None:
                raise _lost(self.lost, "in the middle of the response body")
            if self._paused and self._pull:
                self._resume()
            polled = True  # woken by a read: what it brought is this call's, no read more
            await self._wait(deadline, "waiting for the response body")

    def start(self, request: bytes, *, body_limit: int | None = None) -> None:
        self._reset()
        self._parser = httptools.HttpResponseParser(self)
        self.body_limit = body_limit
        assert self.transport is not None
        self._read_size(READ_SIZE)  # the last response may have been a body of known length
        self.transport.write(request)

    def reusable(self) -> bool:
        """The last response was read whole, the server keeps the connection, and this side's
        socket reads (a paused one would hold the next response back for up to PAUSE_MAX_S)."""
        return (
            self.complete and self.keep_alive and self.lost is None and not self._paused
            and self.transport is not None and not self.transport.is_closing()
        )

    def _kernel_has_bytes(self) -> bool:
        return self._socket_readable(unknown=False)

    def _socket_readable(self, *, unknown: bool) -> bool:
        """Whether the socket has something to read now (one zero-timeout poll); ``unknown``
        when there is no socket to ask or asking it fails."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return unknown
        try:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return unknown

    def dropped(self) -> bool:
        """True when an idle connection's socket has something to read: the server's FIN or
        reset (it closed the connection), or bytes no request asked for. Asked right before a
        request is written on a kept-alive connection: the event loop may not have seen the close
        yet, and a request written after it would fail with no way to tell whether the server
        got it. (urllib3 asks the same before it reuses a connection.)"""
        return self._socket_readable(unknown=True)

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
