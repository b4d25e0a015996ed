"""What uvicorn keeps per connection while a client reads nothing (motorsite/uvicorn_protocol.py and
uvicorn's mark in motorsite/send_flow.py; issue 31's 64 KiB a silent stream).

uvicorn runs here in-process, as ``motorsite.stack`` starts it (uvloop, ``HeaderDeadlineProtocol``,
``send_flow`` installed), on a thread of its own, so that what its connections hold can be read
from the objects themselves; clients talk to it over a real socket on 127.0.0.1. The application
streams frames of ``FRAME`` bytes until its client leaves; a silent client (a small receive
buffer, nothing read) holds its stream back once the kernel's buffers are full.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import uvicorn
import uvloop

from motorsite import send_flow
from motorsite.uvicorn_protocol import HeaderDeadlineProtocol
from tests.still import wait_still

FRAME = b"data: " + b"x" * 600 + b"\n\n"
# uvicorn's chunked framing around a frame ("262\r\n" ... "\r\n").
FRAMING = 16
SILENT = 4  # silent clients held at once
POLL_S = 0.05
STILL_POLLS = 6  # no frame sent over this many polls: every silent stream is held back
WAIT_S = 30.0  # an upper bound for a state to be reached, never a timing assertion
T = TypeVar("T")


class App:
    """Streams ``FRAME`` until its client leaves (or ``stop``); counts what it sent."""

    def __init__(self) -> None:
        self.sent = 0
        self.stop = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        frames = 3 if scope["path"] == "/short" else None
        while not self.stop and (frames is None or frames > 0):
            await send({"type": "http.response.body", "body": FRAME, "more_body": True})
            self.sent += 1
            frames = None if frames is None else frames - 1
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class Served:
    """uvicorn on uvloop on a thread, listening on 127.0.0.1."""

    def __init__(self, app: App) -> None:
        send_flow.install()  # what motorsite.asgi does on import
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, lifespan="off", loop="none", http=HeaderDeadlineProtocol,
                                log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.server.serve([self.sock]),))

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn never started"
            time.sleep(POLL_S)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        self.loop.close()
        self.sock.close()

    def on_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the server's loop, between its callbacks."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:  # handed back to the test
                done.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return done.result(WAIT_S)

    def connections(self) -> list[HeaderDeadlineProtocol]:
        return self.on_loop(lambda: list(self.server.server_state.connections))  # type: ignore[arg-type]


def request(path: str) -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 2\r\n\r\n{{}}".encode()


def open_silent(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request("/stream"))
    return sock


def wait_held(app: App) -> None:
    """Poll until the application has sent nothing for a while: every stream waits in send()."""
    wait_still(lambda: app.sent, polls=STILL_POLLS, poll_s=POLL_S, wait_s=WAIT_S, never="the streams never stopped")


@contextlib.contextmanager
def held_streams(served: Served, app: App) -> Iterator[list[socket.socket]]:
    clients = [open_silent(served.port) for _ in range(SILENT)]
    try:
        wait_held(app)
        yield clients
    finally:
        app.stop = True
        for c in clients:
            c.close()


def warm_up(port: int) -> None:
    """One whole response read by its client: imports and caches, before anything is measured."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request("/short"))
        sock.settimeout(WAIT_S)
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            data += sock.recv(65536)


def test_a_silent_stream_leaves_at_most_one_frame_in_uvicorns_write_buffer() -> None:
    app = App()
    with Served(app) as served, held_streams(served, app):
        held = [c for c in served.connections() if c.cycle is not None and not c.cycle.response_complete]
        assert len(held) == SILENT
        for conn in held:
            assert served.on_loop(lambda conn=conn: conn.flow.write_paused)  # type: ignore[misc]
            # The frame that did not fit in the kernel's buffer, or what was left of it: no
            # other frame waits behind it (at a mark of 1 KiB, uvloop kept two or three).
            buffered = served.on_loop(conn.transport.get_write_buffer_size)
            assert 0 < buffered <= len(FRAME) + FRAMING, buffered


def test_a_connection_streaming_to_a_silent_client_holds_no_parser_and_a_small_dict() -> None:
    app = App()
    with Served(app) as served:
        warm_up(served.port)
        with held_streams(served, app):
            held = [c for c in served.connections() if c.cycle is not None and not c.cycle.response_complete]
            assert len(held) == SILENT
            for conn in held:
                # The request was read whole: its parser (0.9 KiB with llhttp's state and nine
                # bound callbacks) is made again at the connection's next byte.
                assert conn.parser is None
                # The instance dict still shares its keys with the class (0.3 KiB, not 1.5).
                assert served.on_loop(lambda conn=conn: conn.__dict__.__sizeof__()) < 512  # type: ignore[misc]


def test_what_uvicorn_holds_per_silent_connection_is_bounded() -> None:
    """The heap allocated by uvicorn's code and this protocol's for each held stream: the
    protocol and its state, the request cycle and scope, the flow control and message event,
    the task, the write buffer (uvloop's, charged to the line that wrote). Measured by
    tracemalloc from after a warm-up: 9.3 KiB a connection before ``uvicorn_protocol``'s lighter
    state and uvicorn's write mark of 0 (2026-12-06), 6.0-6.1 after (1.7 of it the frame left in
    uvloop's buffer and its write request)."""
    app = App()
    with Served(app) as served:
        warm_up(served.port)
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            with held_streams(served, app):
                after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
    ours = [tracemalloc.Filter(True, "*/uvicorn/*"), tracemalloc.Filter(True, "*/motorsite/uvicorn_protocol.py"),
            tracemalloc.Filter(True, "*/motorsite/send_flow.py")]
    grown = sum(s.size_diff for s in after.filter_traces(ours).compare_to(before.filter_traces(ours), "filename"))
    assert grown / SILENT <= 8 * 1024, grown / SILENT


def test_a_keep_alive_connection_holds_no_parser_between_requests_and_parses_the_next() -> None:
    """The parser dropped once a request is whole is made again at the next byte on the connection."""
    app = App()
    with Served(app) as served, socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.settimeout(WAIT_S)
        for _ in range(3):
            sock.sendall(request("/short"))
            data = b""
            while not data.endswith(b"0\r\n\r\n"):
                data += sock.recv(65536)
            assert data.startswith(b"HTTP/1.1 200 OK") and data.count(FRAME) == 3
            [conn] = served.connections()
            assert conn.parser is None
        sock.sendall(b"GARBAGE\r\n\r\n")  # a new parser refuses what the old one would have
        data = b""
        while not data.endswith(b"Invalid HTTP request received."):
            data += sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 400 Bad Request")
