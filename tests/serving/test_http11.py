"""The upstream HTTP/1.1 client against real asyncio servers on 127.0.0.1: bodies by length, by
chunks and by close, keep-alive reuse and when a connection must not be reused, timeouts,
dropped connections, flow control for a reader that stops, and httpx's exception classes."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
import pytest

from serving.pipeline import http11, http11_wire
from serving.pipeline.http11 import Http11Client
from serving.pipeline.sse import iter_event_batches

# The coordinator's upstream client runs on asyncio's loop under Daphne and on uvloop under uvicorn.
pytestmark = pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])

Handler = Callable[["Request", asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    reader: asyncio.StreamReader  # a handler that waits for the client's close reads it to EOF


@dataclass
class Server:
    handler: Handler
    connections: int = 0
    requests: list[Request] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a connection saw EOF or a reset
    url: str = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ")
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                request = Request(method, path, headers, body, reader)
                self.requests.append(request)
                await self.handler(request, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()


@pytest.fixture
async def server() -> AsyncIterator[Callable[[Handler], Awaitable[Server]]]:
    started: list[asyncio.AbstractServer] = []

    async def start(handler: Handler) -> Server:
        srv = Server(handler)
        s = await asyncio.start_server(srv.serve, "127.0.0.1", 0)
        started.append(s)
        srv.url = f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}"
        return srv

    yield start
    for s in started:
        s.close()


async def json_reply(request: Request, writer: asyncio.StreamWriter) -> None:
    body = json.dumps({"echo": json.loads(request.body or b"null"), "path": request.path}).encode()
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def sse_reply(request: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    for i in range(3):
        writer.write(chunk(b'data: {"i": %d}\n\n' % i))
        await writer.drain()
    writer.write(chunk(b"data: [DONE]\n\n"))
    await writer.drain()
    writer.write(b"0\r\n\r\n")  # the body's terminator in a write of its own, as uvicorn sends it
    await writer.drain()


async def test_a_json_post_round_trips_and_its_connection_is_reused(server: Any) -> None:
    srv = await server(json_reply)
    client = Http11Client()
    for n in range(3):
        reply = await client.post(srv.url + "/v1/x?q=1", json={"n": n, "text": "héllo"}, headers={"X-Request-Id": f"r{n}"})
        assert reply.status_code == 200
        assert reply.json() == {"echo": {"n": n, "text": "héllo"}, "path": "/v1/x?q=1"}
    assert srv.connections == 1
    assert [r.headers["x-request-id"] for r in srv.requests] == ["r0", "r1", "r2"]
    assert srv.requests[0].headers["content-type"] == "application/json"
    assert srv.requests[0].headers["host"] == srv.url.removeprefix("http://")
    await client.aclose()


async def test_a_stream_is_read_whole_and_its_connection_reused_after_done(server: Any) -> None:
    srv = await server(sse_reply)
    client = Http11Client()
    for _ in range(2):
        async with client.stream("POST", srv.url + "/gen", json={"stream": True}) as reply:
            assert reply.status_code == 200
            body = b"".join([piece async for piece in reply.aiter_raw()])
        assert body == b'data: {"i": 0}\n\ndata: {"i": 1}\n\ndata: {"i": 2}\n\ndata: [DONE]\n\n'
    # The second stream may start before the first one's terminator arrived; wait until it did.
    async with client.stream("POST", srv.url + "/gen", json={}) as reply:
        async for piece in reply.aiter_raw():
            if piece.endswith(b"[DONE]\n\n"):
                break
    while not client._idle.get(("http", "127.0.0.1", int(srv.url.rsplit(":", 1)[1]))):
        await asyncio.sleep(0.01)  # the drain hands the connection back when the terminator lands
    await client.post(srv.url + "/gen", json={})
    assert srv.connections <= 2
    await client.aclose()


async def test_what_queued_while_the_reader_was_busy_comes_as_one_piece_of_events(server: Any) -> None:
    # Coalescing rests on this (derender/coalesce.py): the events an engine sent while the stream's
    # reader was away derendering come out of the connection at once, as one list of events.
    sent = asyncio.Event()

    async def burst(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(chunk(b'data: {"i": 0}\n\n'))
        await writer.drain()
        await sent.wait()
        for i in range(1, 6):
            writer.write(chunk(b'data: {"i": %d}\n\n' % i))
            await writer.drain()
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    client = Http11Client()
    async with client.stream("POST", (await server(burst)).url, json={}) as reply:
        reply.whole_reads = True  # as the engine client opens a stream for a coalescing reader
        batches = iter_event_batches(reply.aiter_raw())
        assert await anext(batches) == [{"i": 0}]
        sent.set()
        while len(reply._conn.pieces) < 6:  # the reader is busy: the connection buffers
            await asyncio.sleep(0.01)
        assert await anext(batches) == [{"i": i} for i in range(1, 6)]
        assert [b async for b in batches] == []
    await client.aclose()


async def test_a_stream_left_unread_closes_its_connection(server: Any) -> None:
    async def endless(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"data: {}\n\n"))
        await writer.drain()
        await request.reader.read()

    srv = await server(endless)
    client = Http11Client()
    async with client.stream("POST", srv.url, json={}) as reply:
        async for _ in reply.aiter_raw():
            break
    await asyncio.wait_for(srv.closed.wait(), 10)  # the server sees the close: vLLM aborts on it
    assert client._idle == {}


async def test_bodies_ending_with_the_close_and_chunk_extensions_are_read_whole(server: Any) -> None:
    async def until_close(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 500 Oops\r\ncontent-type: text/plain\r\n\r\nno length here")
        await writer.drain()
        writer.close()

    async def extensions(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n0\r\nx-trailer: 1\r\n\r\n")
        await writer.drain()

    client = Http11Client()
    reply = await client.post((await server(until_close)).url, json={})
    assert (reply.status_code, reply.text) == (500, "no length here")
    assert (await client.get((await server(extensions)).url)).content == b"abc"
    await client.aclose()


async def test_timeouts_and_failures_raise_httpx_classes_and_drop_the_connection(server: Any) -> None:
    async def silent(request: Request, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3600)

    async def cut(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"data: {}\n\n"))
        await writer.drain()
        writer.transport.abort()

    client = Http11Client()
    with pytest.raises(httpx.ReadTimeout):
        await client.post((await server(silent)).url, json={}, timeout=0.05)
    with pytest.raises(httpx.RemoteProtocolError):
        async with client.stream("POST", (await server(cut)).url, json={}) as reply:
            [piece async for piece in reply.aiter_raw()]
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    with pytest.raises(httpx.ConnectError):
        await client.post(f"http://127.0.0.1:{port}/", json={})
    with pytest.raises(httpx.RemoteProtocolError):
        await client.post((await server(_garbage)).url, json={})
    assert all(not conns for conns in client._idle.values())


async def _garbage(request: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(b"SPDY/9 what\r\n\r\n")
    await writer.drain()


async def test_a_cancelled_call_closes_its_connection(server: Any) -> None:
    async def silent(request: Request, writer: asyncio.StreamWriter) -> None:
        await request.reader.read()

    srv = await server(silent)
    client = Http11Client()
    task = asyncio.ensure_future(client.post(srv.url, json={}))
    while not srv.requests:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(srv.closed.wait(), 10)
    assert client._idle == {}


async def test_connection_close_and_old_idle_connections_are_not_reused(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def closing(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()

    client = Http11Client()
    srv = await server(closing)
    await client.post(srv.url, json={})
    await client.post(srv.url, json={})
    assert srv.connections == 2

    monkeypatch.setattr(http11, "KEEPALIVE_S", 0.0)  # every idle connection is too old
    srv = await server(json_reply)
    await client.post(srv.url, json={})
    await client.post(srv.url, json={})
    assert srv.connections == 2
    await client.aclose()


async def test_idle_connections_are_closed_once_too_old_to_reuse_and_keep_no_headers(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a burst the pool keeps a connection only while it could be reused: once idle for
    KEEPALIVE_S it is closed, not left open until a request meets it (requests take the newest)."""
    monkeypatch.setattr(http11, "KEEPALIVE_S", 0.2)
    srv = await server(json_reply)
    client = Http11Client()
    replies = await asyncio.gather(*(client.post(srv.url, json={"n": n}) for n in range(4)))
    assert [r.json()["echo"] for r in replies] == [{"n": n} for n in range(4)]
    assert replies[0].headers["content-type"] == "application/json"  # the reply keeps its own
    idle = client._idle[("http", "127.0.0.1", int(srv.url.rsplit(":", 1)[1]))]
    assert srv.connections == 4 and len(idle) == 4
    assert not any(conn.headers for conn in idle)
    conns = list(idle)
    async with asyncio.timeout(10):  # a bound on reaching the state, not a timing assertion
        while idle or not all(conn.transport is None or conn.transport.is_closing() for conn in conns):
            await asyncio.sleep(0.05)
    await client.aclose()


FLOOD_TOTAL = 8 * 1024 * 1024


async def flood(request: Request, writer: asyncio.StreamWriter) -> None:
    """An 8 MiB streamed (chunked) body of ``x``, written as fast as the client's window lets it;
    ``/known-length`` first answers 256 KiB with a ``Content-Length``."""
    if request.path == "/known-length":
        body = b"y" * (256 * 1024)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        return
    piece = b"x" * 4096
    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    for _ in range(FLOOD_TOTAL // len(piece)):
        writer.write(chunk(piece))
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def read_flood_after_it_pauses(client: Http11Client, url: str) -> None:
    """Stream the flood without reading until its socket pauses, check the bound, then read it all."""
    async with client.stream("POST", url, json={}) as reply:
        conn = reply._conn
        while not conn._paused:
            await asyncio.sleep(0.01)
        # The server is far from done, and the coordinator holds one window of it, not the rest.
        assert conn.buffered <= http11.HIGH_WATER + http11.READ_SIZE
        got = 0
        async for data in reply.aiter_raw():
            got += len(data)
            assert set(data) == {ord("x")}
    assert got == FLOOD_TOTAL


async def test_a_reader_that_stops_stops_the_socket_instead_of_buffering(server: Any) -> None:
    await read_flood_after_it_pauses(Http11Client(), (await server(flood)).url)


async def test_a_body_of_known_length_is_read_in_larger_pieces_and_a_stream_after_it_is_not(server: Any) -> None:
    # A Content-Length body is read whole by its caller: big reads cost fewer system calls. The
    # connection's next response, a stream, is read READ_SIZE at a time again, so its bound holds.
    srv = await server(flood)
    client = Http11Client()
    async with client.stream("POST", srv.url + "/known-length", json={}) as reply:
        sizes = [len(piece) async for piece in reply.aiter_raw()]
    assert sum(sizes) == 256 * 1024
    assert max(sizes) > http11.READ_SIZE
    # What queued while the reader was away comes in one piece: one read more than the pause point.
    assert max(sizes) <= http11.HIGH_WATER + http11_wire.BODY_READ_SIZE
    await read_flood_after_it_pauses(client, srv.url + "/stream")
    assert srv.connections == 1  # the same connection served both
    await client.aclose()


async def test_a_stopped_reader_still_lets_one_read_in_now_and_then(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A socket shut for minutes loses the tail of a finished engine's output (http11_wire's
    # docstring): a paused connection lets one more read in every PAUSE_MAX_S, then pauses again.
    monkeypatch.setattr(http11_wire, "PAUSE_MAX_S", 0.1)
    client = Http11Client()
    async with client.stream("POST", (await server(flood)).url, json={}) as reply:
        conn = reply._conn
        while not conn._paused:
            await asyncio.sleep(0.01)
        first, since = conn.buffered, conn.loop.time()
        async with asyncio.timeout(10):
            while conn.buffered == first:  # the timer let one more read in...
                await asyncio.sleep(0.01)
            while not conn._paused:  # ... and the read shut the socket again
                await asyncio.sleep(0.01)
        # At most one read per PAUSE_MAX_S: a bound a loaded machine only loosens (it was a fixed
        # sleep and a fixed count, which a slow turn of the loop could break either way).
        reads = (conn.loop.time() - since) / http11_wire.PAUSE_MAX_S + 1
        assert conn.buffered - first <= reads * http11.READ_SIZE
        got = 0
        async for data in reply.aiter_raw():
            got += len(data)
    assert got == FLOOD_TOTAL
    assert conn._pause_timer is None
    await client.aclose()


async def test_a_request_is_never_sent_twice_when_a_reused_connection_drops_under_it(server: Any) -> None:
    # Issue 31, finding 4: a generate or prefill may be running on the engine once it was written
    # (a non-streaming one sends nothing until it is done), so the failure goes to the caller (the
    # attempt policy), never to a second copy of the request on a new connection.
    # Keyed by the writer itself, held here: the id() of a writer already freed may come back for
    # the next connection's, which then looked like the old one (a CI run failed so).
    served: dict[asyncio.StreamWriter, int] = {}

    async def once_per_connection(request: Request, writer: asyncio.StreamWriter) -> None:
        served[writer] = served.get(writer, 0) + 1
        if served[writer] > 1:
            writer.transport.abort()  # the server went away just as the next request came in
            return
        await json_reply(request, writer)

    srv = await server(once_per_connection)
    client = Http11Client()
    assert (await client.post(srv.url, json={"n": 0})).json()["echo"] == {"n": 0}
    with pytest.raises(httpx.RemoteProtocolError):
        await client.post(srv.url, json={"n": 1})
    assert (await client.post(srv.url, json={"n": 2})).json()["echo"] == {"n": 2}  # a new connection
    assert [json.loads(r.body)["n"] for r in srv.requests] == [0, 1, 2]  # each sent once
    assert srv.connections == 2
    await client.aclose()


async def test_a_kept_alive_connection_the_server_closed_while_idle_is_replaced_before_the_write(server: Any) -> None:
    # The one case where a new connection is proof enough: the old one was seen closed (the loop
    # saw it, or its socket has the FIN waiting) before anything was written on it.
    closed = asyncio.Event()

    async def answer_then_close(request: Request, writer: asyncio.StreamWriter) -> None:
        await json_reply(request, writer)
        writer.close()
        await writer.wait_closed()
        closed.set()

    srv = await server(answer_then_close)
    client = Http11Client()
    for n in range(3):
        closed.clear()
        assert (await client.post(srv.url, json={"n": n})).json()["echo"] == {"n": n}
        await asyncio.wait_for(closed.wait(), 10)
    assert [json.loads(r.body)["n"] for r in srv.requests] == [0, 1, 2]
    assert srv.connections == 3
    await client.aclose()


class Payload(dict[str, Any]):
    """A request payload a test can hold a weak reference to (a plain dict takes none)."""


async def test_a_stream_does_not_hold_its_request_payload_once_it_was_written(server: Any) -> None:
    # A stream whose client reads nothing lasts as long as the client is silent; the generate
    # request it was opened with (a few KiB parsed) is no use to it after the write.
    import gc
    import weakref

    payload = Payload(prompt=list(range(100)))
    gone = weakref.ref(payload)
    client = Http11Client()
    async with client.stream("POST", (await server(sse_reply)).url, json=payload) as reply:
        del payload
        gc.collect()
        assert gone() is None
        assert [e async for b in iter_event_batches(reply.aiter_raw()) for e in b] == [{"i": i} for i in range(3)]
    await client.aclose()


async def test_a_paused_whole_read_stream_holds_what_it_buffered_as_one_piece(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A coalescing reader takes all that arrived at once anyway: while its socket is paused the
    # connection keeps one bytes object, not one per chunk (a dozen per held-back stream).
    events = 2000  # 48 KiB: the stream is still going after the first whole reads (4.5 KiB each)

    async def many(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(events):
            writer.write(chunk(b'data: {"i": %d}\n\n' % i))
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    # What each read that left the socket paused left held (pieces, bytes), checked when that
    # read was handled, whatever the loop ran next: under uvloop the read right after a waiting
    # reader's read (libuv reads on while the socket has bytes) comes before the woken reader
    # runs, and its piece goes with the batch being handed over.
    held: list[tuple[int, int]] = []
    paused = asyncio.Event()
    buffer_updated = http11_wire.Connection.buffer_updated

    def spy(self: http11_wire.Connection, nbytes: int) -> None:
        buffer_updated(self, nbytes)
        if self._paused and self._whole:  # (before the first whole read, nobody said so)
            held.append((len(self.pieces), self.buffered - sum(map(len, self.pieces[:1]))))
            paused.set()

    monkeypatch.setattr(http11_wire.Connection, "buffer_updated", spy)
    client = Http11Client()
    async with client.stream("POST", (await server(many)).url, json={}) as reply:
        reply.whole_reads = True
        conn = reply._conn
        batches = iter_event_batches(reply.aiter_raw())
        got = list(await anext(batches))
        while not held:
            if conn._paused:  # shut before the reader read whole: its next read opens it
                got.extend(await anext(batches))
            else:  # the socket reads and its reader is away (this task): the next read shuts it
                await asyncio.wait_for(paused.wait(), 60)
        async for batch in batches:
            got.extend(batch)
        assert got == [{"i": i} for i in range(events)]
    # Every pause held one piece with all that was buffered, not a bytes object per chunk.
    assert held and set(held) == {(1, 0)}
    await client.aclose()


async def test_a_stream_read_while_its_reader_is_away_holds_one_small_read_and_merges_the_rest_on_return(
    server: Any,
) -> None:
    # Issue 31: a stream whose client reads nothing held the engine connection read ahead to
    # HIGH_WATER + READ_SIZE (4 KiB, 8 a two-prompt stream). Now a read while the reader is away
    # takes TRICKLE_SIZE and shuts the socket; a whole reader back from away takes what queued in
    # the kernel meanwhile in one piece (coalescing merges as much as before).
    client = Http11Client()
    async with client.stream("POST", (await server(flood)).url, json={}) as reply:
        reply.whole_reads = True
        conn = reply._conn
        pieces = reply.aiter_raw()
        got = len(await anext(pieces))
        while not conn._paused:  # the reader is away; the server keeps sending
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        # (Nothing, when the reader took the last read with its piece.)
        assert conn.buffered <= http11_wire.TRICKLE_SIZE
        away = conn.buffered
        back = await anext(pieces)
        # One read of what queued, and the one let in while the reader was being woken.
        assert away + http11_wire.TRICKLE_SIZE < len(back) <= away + http11_wire.WHOLE_READ_SIZE + http11_wire.TRICKLE_SIZE
        got += len(back)
        async for data in pieces:
            got += len(data)
    assert got == FLOOD_TOTAL
    await client.aclose()
