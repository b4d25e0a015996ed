"""A TCP proxy on 127.0.0.1 that drops an engine's connection in the middle of a stream.

Put in front of an engine (the coordinator's instance URL names the proxy), it forwards bytes
both ways untouched. Proxies share one ``Cut``: while it is armed, the first event-stream
response any of them relays is cut after exactly ``after_bytes`` of it (head included), both
sockets closed, as a crashed engine or a broken network would; the cut disarms itself. Exactly:
on a loaded machine one read may bring the head and a dozen events at once, and cutting before
that read would cut before the head (the coordinator then retries the request instead of
relaying the stream it has begun). What the client sees is a
chunked response ending early, so the coordinator relays the stream to another instance.

Every byte sent towards the engine is also kept (``sent``), so a test can assert what an engine
received, on every connection and attempt.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from types import TracebackType

BUFFER = 65536


@dataclass
class Cut:
    """One-shot: armed by a test, taken by the first event stream that passes ``after_bytes``."""

    after_bytes: int = 0
    armed: bool = False
    cuts: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def arm(self, after_bytes: int) -> None:
        with self._lock:
            self.after_bytes, self.armed = after_bytes, True

    def take(self, seen: int) -> int | None:
        """None: no cut (yet). Otherwise the cut is taken: how many of the ``seen`` bytes of the
        response go through before it (``after_bytes``; fewer only if it was armed late)."""
        with self._lock:
            if not self.armed or seen < self.after_bytes:
                return None
            self.armed = False
            self.cuts += 1
            return self.after_bytes


class CuttingProxy:
    """Listens on a free port of 127.0.0.1; each connection is piped to ``upstream_port``."""

    def __init__(self, upstream_port: int, cut: Cut) -> None:
        self.upstream_port = upstream_port
        self.cut = cut
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._sent: list[bytearray] = []  # per connection, in the order they were accepted

    def sent(self) -> list[bytes]:
        """What the proxy has forwarded to the engine so far: each connection's bytes, in order."""
        with self._lock:
            return [bytes(b) for b in self._sent]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> CuttingProxy:
        self._spawn(self._accept)
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._closed = True
        # close() alone does not wake a thread blocked in accept() on Linux (each proxy's exit
        # then waited out the join's 10 s); shutdown() does.
        _close(self._listener)
        with self._lock:
            for s in list(self._sockets):
                _close(s)
        for t in self._threads:
            t.join(timeout=10)

    def _spawn(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                _close(client)
                continue
            sent = bytearray()
            with self._lock:
                self._sockets.update((client, upstream))
                self._sent.append(sent)
            state = _Exchange()
            self._spawn(self._requests, client, upstream, state, sent)
            self._spawn(self._responses, upstream, client, state)

    def _requests(self, client: socket.socket, upstream: socket.socket, state: _Exchange, sent: bytearray) -> None:
        while data := _recv(client):
            state.new_request()  # keep-alive: the next response is a new one
            with self._lock:
                sent += data
            if not _send(upstream, data):
                break
        self._drop(client, upstream)

    def _responses(self, upstream: socket.socket, client: socket.socket, state: _Exchange) -> None:
        while data := _recv(upstream):
            if state.relayed(data) and (through := self.cut.take(state.stream_bytes)) is not None:
                # This read's part before the cut goes through, then both sockets close.
                _send(client, data[: max(0, len(data) - (state.stream_bytes - through))])
                break
            if not _send(client, data):
                break
        self._drop(client, upstream)

    def _drop(self, *socks: socket.socket) -> None:
        with self._lock:
            for s in socks:
                self._sockets.discard(s)
                _close(s)


class _Exchange:
    """The response of the current request on one connection: is it an event stream, how far."""

    def __init__(self) -> None:
        self.head = b""
        self.stream = False
        self.stream_bytes = 0

    def new_request(self) -> None:
        self.head, self.stream, self.stream_bytes = b"", False, 0

    def relayed(self, data: bytes) -> bool:
        """Count ``data``; whether this response is an event stream."""
        if not self.stream:
            self.head += data
            self.stream = b"text/event-stream" in self.head.lower()
        if self.stream:
            self.stream_bytes += len(data)
        return self.stream


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(BUFFER)
    except OSError:
        return b""


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
