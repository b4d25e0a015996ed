"""The production upstream client (``Http11Client``) against a hostile upstream on 127.0.0.1
(issue 31, findings 4 and 5): malformed answers refused, every buffer bounded, deadlines that a
trickle of bytes does not push on, no paused connection back in the pool, no header injection, and
no request sent twice."""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import replace
from typing import Any, AsyncIterator

import httpx
import pytest

from serving.pipeline import http11_wire, sse
from serving.pipeline.engine.client import EngineClient
from serving.pipeline.errors import EngineError
from serving.pipeline.http11 import Http11Client
from serving.pipeline.http11_wire import Connection
from serving.pipeline.sse import SSEProtocolError, iter_event_batches
from tests.serving.fakes import instance
from tests.serving.hostile_upstream import HOLD, HostileUpstream, Seen, Step, hostile

pytestmark = pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])

# Every test runs under this watchdog: a client that waits forever fails the test instead of hanging.
WATCHDOG_S = 30.0
OK_JSON = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.fixture
async def upstreams() -> AsyncIterator[list[HostileUpstream]]:
    started: list[HostileUpstream] = []
    yield started
    for up in started:
        await up.stop()


async def start(started: list[HostileUpstream], script: Any) -> HostileUpstream:
    up = await hostile(script)
    started.append(up)
    return up


def pooled(client: Http11Client) -> int:
    return sum(len(conns) for conns in client._idle.values())


# -- finding 5: what RFC 9112 calls malformed is refused -------------------------------------------

MALFORMED = {
    # chunk sizes that are not plain hex (int(x, 16) took every one of them)
    "chunk size -1": CHUNKED_HEAD + b"-1\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "chunk size +5": CHUNKED_HEAD + b"+2\r\n{}\r\n0\r\n\r\n",
    "chunk size 0_5": CHUNKED_HEAD + b"0_2\r\n{}\r\n0\r\n\r\n",
    "chunk size 0x5": CHUNKED_HEAD + b"0x2\r\n{}\r\n0\r\n\r\n",
    "chunk size with a space": CHUNKED_HEAD + b"2 \r\n{}\r\n0\r\n\r\n",
    "chunk data not followed by CRLF": CHUNKED_HEAD + b"2\r\n{}XX0\r\n\r\n",
    # framing the last of two lengths won, or a length beside chunked kept alive
    "two Content-Lengths": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}x",
    "a Content-Length list": b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\n{}",
    "a signed Content-Length": b"HTTP/1.1 200 OK\r\ncontent-length: +2\r\n\r\n{}",
    "Transfer-Encoding and Content-Length": (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    ),
    # transfer codings matched by substring
    "Transfer-Encoding xchunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: xchunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "Transfer-Encoding gzip, chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "Transfer-Encoding chunked, gzip": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    # header lines
    "a folded header": b"HTTP/1.1 200 OK\r\nx-a: 1\r\n x-b: folded\r\ncontent-length: 2\r\n\r\n{}",
    "a space before the colon": b"HTTP/1.1 200 OK\r\ncontent-length : 2\r\n\r\n{}",
    "a control character in a value": b"HTTP/1.1 200 OK\r\nx-a: a\x01b\r\ncontent-length: 2\r\n\r\n{}",
    "bare LF line ends": b"HTTP/1.1 200 OK\ncontent-length: 2\n\n{}",
    # status lines
    "HTTP/2.0 in an HTTP/1.1 status line": b"HTTP/2.0 200 OK\r\ncontent-length: 2\r\n\r\n{}",
    "a four-digit status": b"HTTP/1.1 2000 OK\r\ncontent-length: 2\r\n\r\n{}",
    "not HTTP": b"SPDY/9 what\r\n\r\n",
    "101 with no upgrade asked for": b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n{}",
}


@pytest.mark.parametrize("answer", list(MALFORMED.values()), ids=list(MALFORMED))
async def test_it_refuses_a_malformed_answer_and_drops_the_connection(upstreams: Any, answer: bytes) -> None:
    up = await start(upstreams, [answer, HOLD])
    client = Http11Client()
    async with asyncio.timeout(WATCHDOG_S):
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(up.url, json={}, timeout=5.0)
        while not up.closed:  # the server sees the close
            await asyncio.sleep(0.01)
    assert pooled(client) == 0
    await client.aclose()


async def test_it_skips_interim_1xx_answers_and_reads_the_final_one(upstreams: Any) -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n"
    up = await start(upstreams, [interim, OK_JSON])
    client = Http11Client()
    async with asyncio.timeout(WATCHDOG_S):
        for _ in range(2):
            reply = await client.post(up.url, json={})
            assert (reply.status_code, reply.json(), "link" in reply.headers) == (200, {}, False)
    assert up.connections == 1  # and the connection stays in step
    await client.aclose()


async def test_bytes_after_the_answer_leave_the_answer_but_not_the_connection(upstreams: Any) -> None:
    up = await start(upstreams, [OK_JSON + b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nXX"])
    client = Http11Client()
    async with asyncio.timeout(WATCHDOG_S):
        for _ in range(2):
            assert (await client.post(up.url, json={})).json() == {}
    assert up.connections == 2
    await client.aclose()


# -- finding 5: every buffer is bounded ----------------------------------------------------------


# The counts are checked after each read, so what is held stays under a limit plus one read.
OVER = 2 * http11_wire.READ_SIZE
BOUNDS = {
    "a head with no end": b"HTTP/1.1 200 OK\r\nx-a: " + b"a" * (http11_wire.MAX_HEAD_BYTES + OVER),
    "a head of many headers": b"HTTP/1.1 200 OK\r\n" + b"x-a: 1\r\n" * ((http11_wire.MAX_HEAD_BYTES + OVER) // 8),
    "endless interim answers": b"HTTP/1.1 100 Continue\r\n\r\n" * ((http11_wire.MAX_HEAD_BYTES + OVER) // 25),
    "a trailer line with no end": CHUNKED_HEAD + b"2\r\n{}\r\n0\r\nx-t: " + b"a" * (http11_wire.MAX_FRAMING_BYTES + OVER),
    "endless trailers": CHUNKED_HEAD + b"2\r\n{}\r\n0\r\n" + b"x-t: 1\r\n" * ((http11_wire.MAX_FRAMING_BYTES + OVER) // 8),
    "chunk extensions instead of data": CHUNKED_HEAD + b"1;" + b"e" * (http11_wire.MAX_FRAMING_BYTES + OVER),
}


@pytest.mark.parametrize("answer", list(BOUNDS.values()), ids=list(BOUNDS))
async def test_heads_trailers_and_framing_are_bounded(upstreams: Any, answer: bytes) -> None:
    up = await start(upstreams, [answer, HOLD])
    client = Http11Client()
    async with asyncio.timeout(WATCHDOG_S):
        with pytest.raises(httpx.RemoteProtocolError, match="too large"):
            await client.post(up.url, json={}, timeout=10.0)
    assert pooled(client) == 0
    await client.aclose()


REPLY_LIMIT = 1000
OVERSIZED = {
    # refused on the declared length, before any of the body is read
    "a declared length": [b"HTTP/1.1 200 OK\r\ncontent-length: 5000\r\n\r\n", HOLD],
    "a chunked body": [CHUNKED_HEAD + chunk(b"x" * 600) + chunk(b"x" * 600), HOLD],
    "a body until the close": [b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 1200, HOLD],
}


@pytest.mark.parametrize("script", list(OVERSIZED.values()), ids=list(OVERSIZED))
async def test_a_reply_read_whole_is_bounded(upstreams: Any, script: list[Step | str]) -> None:
    up = await start(upstreams, script)
    client = Http11Client(max_reply_bytes=REPLY_LIMIT)
    async with asyncio.timeout(WATCHDOG_S):
        with pytest.raises(httpx.RemoteProtocolError, match="limit"):
            await client.post(up.url, json={}, timeout=10.0)
        async with client.stream("POST", up.url, json={}, timeout=10.0) as reply:  # an error body on a stream
            with pytest.raises(httpx.RemoteProtocolError, match="limit"):
                await reply.aread()
    await client.aclose()


async def test_an_sse_line_without_its_end_is_bounded(upstreams: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "MAX_LINE_BYTES", 4096)
    endless = [CHUNKED_HEAD + chunk(b'data: {"a": "'), *[chunk(b"a" * 1000) for _ in range(8)], HOLD]
    up = await start(upstreams, endless)
    client = Http11Client()
    async with asyncio.timeout(WATCHDOG_S):
        async with client.stream("POST", up.url, json={}) as reply:
            with pytest.raises(SSEProtocolError, match="without its end"):
                [b async for b in iter_event_batches(reply.aiter_raw())]
    await client.aclose()


# -- finding 5: deadlines that a trickle does not push on -------------------------------------------


def trickled(data: bytes, every_s: float) -> list[Step | str]:
    steps: list[Step | str] = []
    for i in range(len(data)):
        steps += [data[i : i + 1], every_s]
    return steps


async def test_a_reply_trickled_a_byte_at_a_time_times_out_as_a_whole(upstreams: Any) -> None:
    # 100 body bytes 50 ms apart: each arrives well within the deadline, the whole never does.
    up = await start(upstreams, [b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n", *trickled(b"x" * 100, 0.05)])
    client = Http11Client()
    async with asyncio.timeout(WATCHDOG_S):
        with pytest.raises(httpx.ReadTimeout):
            await client.post(up.url, json={}, timeout=0.5)
    await client.aclose()


async def test_a_head_trickled_a_byte_at_a_time_times_out(upstreams: Any) -> None:
    head = b"HTTP/1.1 200 OK\r\n" + b"x-slow: " + b"s" * 100 + b"\r\ncontent-length: 2\r\n\r\n{}"
    up = await start(upstreams, trickled(head, 0.05))
    client = Http11Client()
    async with asyncio.timeout(WATCHDOG_S):
        with pytest.raises(httpx.ReadTimeout):
            async with client.stream("POST", up.url, json={}, timeout=0.5):
                pass
    await client.aclose()


async def test_a_stream_whose_event_never_ends_times_out_though_bytes_keep_coming(upstreams: Any) -> None:
    event = b'data: {"token_ids": [' + b"1," * 50 + b"1]}"
    script = [CHUNKED_HEAD, *[chunk(b) if isinstance(b, bytes) else b for b in trickled(event, 0.05)]]
    up = await start(upstreams, [*script, chunk(b"\n\n"), chunk(sse.DONE), b"0\r\n\r\n"])
    client = Http11Client()
    async with asyncio.timeout(WATCHDOG_S):
        async with client.stream("POST", up.url, json={}, timeout=0.5) as reply:
            with pytest.raises(httpx.ReadTimeout):
                [b async for b in iter_event_batches(reply.aiter_raw())]
    await client.aclose()


async def test_a_stream_of_steady_events_outlives_its_per_event_deadline(upstreams: Any) -> None:
    # 30 events 0.1 s apart under a 1 s deadline: the deadline is per event, not for the stream.
    events: list[Step | str] = []
    for i in range(30):
        events += [chunk(b'data: {"i": %d}\n\n' % i), 0.1]
    up = await start(upstreams, [CHUNKED_HEAD, *events, chunk(sse.DONE), b"0\r\n\r\n"])
    client = Http11Client()
    async with asyncio.timeout(WATCHDOG_S):
        async with client.stream("POST", up.url, json={}, timeout=1.0) as reply:
            got = [e["i"] async for batch in iter_event_batches(reply.aiter_raw()) for e in batch]
    assert got == list(range(30))
    await client.aclose()


# -- finding 5: a paused or half-read connection never goes back to the pool ---------------------------


async def test_a_connection_paused_with_a_reply_unread_is_not_pooled(
    upstreams: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reused, it would hold its next answer back for up to PAUSE_MAX_S (10 s in production).
    monkeypatch.setattr(http11_wire, "PAUSE_MAX_S", 0.5)
    body = b"y" * (60 * 1024)
    up = await start(upstreams, [b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body])
    client = Http11Client()
    async with asyncio.timeout(WATCHDOG_S):
        async with client.stream("POST", up.url, json={}) as reply:
            conn = reply._conn
            while not conn.complete:
                await asyncio.sleep(0.01)
            assert conn._paused and conn.buffered > http11_wire.HIGH_WATER
            async for _ in reply.aiter_raw():
                break  # the reader leaves with most of the body unread
        assert pooled(client) == 0
        assert len((await client.post(up.url, json={})).content) == len(body)
    assert up.connections == 2
    await client.aclose()


# -- outgoing header values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{"X-Request-Id": "r1\r\nX-Evil: 1"}, {"X-Request-Id": "r1\nx"}, {"X-Request-Id": "r1\rx"}, {"X-A:": "1"},
     {"X-Request-Id": "r\x00"}],
    ids=["CRLF", "LF", "CR", "colon in the name", "NUL"],
)
async def test_it_refuses_to_send_a_header_that_would_split_the_request(
    upstreams: Any, headers: dict[str, str]
) -> None:
    up = await start(upstreams, [OK_JSON])
    client = Http11Client()
    with pytest.raises(ValueError, match="refusing to send header"):
        await client.post(up.url, json={}, headers=headers)
    with pytest.raises(ValueError, match="refusing to send header"):
        async with client.stream("POST", up.url, json={}, headers=headers):
            pass
    assert (await client.post(up.url, json={})).json() == {}
    assert len(up.requests) == 1  # nothing of the refused ones reached the server
    await client.aclose()


# -- finding 4: a request is written once ------------------------------------------------------------


async def test_an_idle_connection_the_server_closed_is_seen_before_anything_is_written() -> None:
    # The proof the client rests on when it opens a new connection in place of a kept-alive one:
    # the server's FIN is waiting on the socket, although the loop has not run to see it.
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    _, conn = await loop.create_connection(lambda: Connection(loop), sock=ours)
    assert not conn.dropped()
    theirs.close()  # no await in between: the event loop cannot have seen it
    assert conn.dropped()
    conn.close()


def generate_reply(seen: Seen) -> list[Step | str]:
    body = json.dumps({"request_id": json.loads(seen.body)["request_id"], "choices": [{"index": 0, "token_ids": [1]}]})
    return [b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body.encode())]


async def test_a_generate_whose_reused_connection_drops_is_an_engine_failure_sent_once(upstreams: Any) -> None:
    # The engine takes the second generate and goes away before it answers (it may have run it).
    # The failure is the attempt policy's (EngineError: a new attempt elsewhere, the breaker
    # counts it), never a second copy of the request on a new connection.
    answered: list[str] = []

    def engine(seen: Seen) -> list[Step | str]:
        if answered:
            return [None]  # closes without a byte of an answer
        answered.append(json.loads(seen.body)["request_id"])
        return generate_reply(seen)

    up = await start(upstreams, engine)
    client = Http11Client()
    engines = EngineClient(client)
    e1 = replace(instance("e1"), url=up.url)
    async with asyncio.timeout(WATCHDOG_S):
        assert (await engines.generate(e1, {"request_id": "r1", "sampling_params": {"max_tokens": 1}}))["choices"]
        with pytest.raises(EngineError):
            await engines.generate(e1, {"request_id": "r2", "sampling_params": {"max_tokens": 1}})
    assert [json.loads(s.body)["request_id"] for s in up.requests] == ["r1", "r2"]
    await client.aclose()
