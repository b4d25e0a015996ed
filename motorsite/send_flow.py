"""The ASGI server's ``send()`` waits while the client reads nothing, and gives up cleanly.

Daphne hands each ``http.response.body`` to Twisted's ``Request.write`` and returns at once: the
bytes go to the transport's write buffer, which has no limit. A stream whose client reads nothing
would pull the whole answer from the engines into this process at full speed (issue 31: 8 silent
streams, n 8, 2,000 tokens, grew the coordinator by 12 MiB). Twisted has the mechanism: a
transport pauses its registered streaming producer once its write buffer passes ``bufferSize``
(64 KiB, ``twisted.internet.abstract.FileDescriptor``) and resumes it once the buffer has
drained, and ``HTTPChannel`` passes both on to the producer registered on its current request.
Daphne registers none. Here every response registers one, and ``send()`` of a body with more to
come waits while it is paused, as uvicorn's does (its ``FlowControl``). Daphne's mark is
``WRITE_BUFFER_BYTES``, uvicorn's ``UVICORN_WRITE_BUFFER_BYTES``: a silent client holds at most
that and one chunk in the server.

A send abandoned while it waits (the edge's stall deadline cancels it, ``MOTOR_CLIENT_STALL_S``)
drops the connection, under both servers: that response can no longer be completed, and the
server would otherwise keep the socket and its full buffer until the client reads or leaves
(uvicorn closes such a connection only once its buffer has been flushed).

Read against Daphne 4.2.3 on Twisted 26.10, uvicorn 0.54 (httptools and h11); nothing here runs under a server
that is not imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import sys
from typing import Any

# Where the flow of a Daphne response is kept, on its request object.
_FLOW = "_motor_send_flow"
# The server's write buffer per connection past which send() waits (both servers' default is
# 64 KiB). The kernel's socket buffer is in front of it (autotuned to megabytes for a client that
# reads), so a small one costs a reading client nothing, and a silent one holds this much here:
# 4 KiB rather than 8 took 3 KiB off a silent stream under Daphne and 11 under uvicorn (whose
# chunked framing copies every body), 1 KiB rather than 4 another 5 and 8 (bench/slow_reader.py
# at 8 streams). A frame larger than the mark still goes whole: send() waits after it.
WRITE_BUFFER_BYTES = 1024
# uvicorn's mark (its transports, uvloop's and asyncio's, write at once whatever the socket takes
# and keep only the rest): 0, so send() waits as soon as one frame did not fit in the kernel's
# buffer, and a silent client holds that frame's rest here and nothing more. A client that reads
# never meets it. At 1 KiB uvloop kept three or four frames a stream, each in a write request of
# its own (0.7 KiB of bookkeeping apiece: bench/slow_reader.py, issue 31's sixth round). Twisted,
# under Daphne, buffers every write until the reactor's next turn, so a mark of 0 there would make
# every send wait a turn: Daphne keeps WRITE_BUFFER_BYTES.
UVICORN_WRITE_BUFFER_BYTES = 0


class SendFlow:
    """The push producer registered on one Daphne response: paused while the transport's buffer is full.

    Twisted calls ``pauseProducing``/``resumeProducing``/``stopProducing`` from the reactor, which
    under Daphne is the asyncio loop, so the waiter is resolved in the loop's own thread.
    """

    __slots__ = ("paused", "_waiter")

    def __init__(self, paused: bool) -> None:
        self.paused = paused
        self._waiter: asyncio.Future[None] | None = None

    def pauseProducing(self) -> None:  # Twisted's IPushProducer names
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def stopProducing(self) -> None:
        # The connection is gone: nothing to wait for (the server reports the disconnect).
        self.resumeProducing()

    async def resumed(self) -> None:
        while self.paused:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter


def _attach(request: Any) -> None:
    """Register a flow on a Daphne request whose response has started (and is still connected)."""
    channel = getattr(request, "channel", None)
    if channel is None or request.finished or request.producer is not None:
        return
    # A previous response on this keep-alive connection may still fill the buffer: then the
    # channel is waiting for the transport already, and resumes this producer when it drains.
    flow = SendFlow(paused=bool(getattr(channel, "_waitingForTransport", False)))
    # FileDescriptor pauses its producer past bufferSize (a class attribute, 64 KiB): this connection's own.
    channel.transport.bufferSize = WRITE_BUFFER_BYTES
    request.registerProducer(flow, True)
    setattr(request, _FLOW, flow)


def _detach(request: Any) -> None:
    flow = request.__dict__.pop(_FLOW, None)
    if flow is not None and request.producer is flow and getattr(request, "channel", None) is not None:
        request.unregisterProducer()


def _patch_daphne(server_class: Any, request_class: Any) -> None:
    handle_reply = server_class.handle_reply
    finish = request_class.finish

    async def handle_reply_flowing(self: Any, protocol: Any, message: Any) -> None:
        await handle_reply(self, protocol, message)
        kind = message.get("type")
        if kind == "http.response.start":
            _attach(protocol)
        elif kind == "http.response.body" and message.get("more_body", False):
            flow = getattr(protocol, _FLOW, None)
            if flow is not None and flow.paused:
                try:
                    await flow.resumed()
                except asyncio.CancelledError:
                    channel = getattr(protocol, "channel", None)
                    if channel is not None:
                        channel.transport.abortConnection()
                    raise

    def finish_flowing(self: Any) -> None:
        # Unregistered before Twisted's finish, which would log a producer left registered (and
        # the next request on the connection could not register its own).
        _detach(self)
        finish(self)

    server_class.handle_reply = handle_reply_flowing
    request_class.finish = finish_flowing


def _reset(transport: Any) -> None:
    """Abort an asyncio transport with a reset, as Twisted's ``abortConnection`` does.

    ``abort()`` drops the process's buffer, but a plain close still leaves the socket's kernel
    buffer (megabytes once autotuned) to be delivered to the client that reads nothing: a zero
    linger time makes the close discard it.
    """
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _patch_uvicorn(cycle_class: Any) -> None:
    send = cycle_class.send

    async def send_or_abort(self: Any, message: Any) -> None:
        if message.get("type") == "http.response.start" and not self.disconnected:
            self.transport.set_write_buffer_limits(high=UVICORN_WRITE_BUFFER_BYTES)
        try:
            await send(self, message)
        except asyncio.CancelledError:
            # Cancelled in the drain wait: abandoned while the client reads nothing.
            if self.flow.write_paused and not self.disconnected:
                _reset(self.transport)
            raise

    cycle_class.send = send_or_abort


def install() -> None:
    """Patch the ASGI server this process runs under (Daphne, uvicorn); a no-op under any other. Idempotent.

    Called when the ASGI application is imported: by then the server's modules are imported.
    """
    server = sys.modules.get("daphne.server")
    protocol = sys.modules.get("daphne.http_protocol")
    if server is not None and protocol is not None and not getattr(server.Server, "_motor_send_flow", False):
        _patch_daphne(server.Server, protocol.WebRequest)
        server.Server._motor_send_flow = True
    if "uvicorn" in sys.modules:
        # Both of uvicorn's parsers are in the lock file; which one serves is its --http choice.
        from uvicorn.protocols.http import h11_impl, httptools_impl

        for module in (httptools_impl, h11_impl):
            cycle = module.RequestResponseCycle
            if not getattr(cycle, "_motor_send_flow", False):
                _patch_uvicorn(cycle)
                cycle._motor_send_flow = True
