"""The upstream HTTP/1.1 client against real asyncio servers on unix sockets (a render sidecar
started with ``vllm launch render --uds``): the ``http+unix://`` URL, ``Host: localhost``, pooling,
streams, deadlines and refusals as over TCP."""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
import pytest

from serving.pipeline.http11 import Http11Client, unix_base_url
from tests.serving.test_http11 import Handler, Request, Server, json_reply, sse_reply

pytestmark = pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])


@pytest.fixture
async def unix_server() -> AsyncIterator[Callable[..., Awaitable[Server]]]:
    started: list[asyncio.AbstractServer] = []
    with tempfile.TemporaryDirectory(prefix="motor-h11-") as tmp:

        async def start(handler: Handler, name: str = "render.sock") -> Server:
            srv = Server(handler)
            path = os.path.join(tmp, name)
            started.append(await asyncio.start_unix_server(srv.serve, path))
            srv.url = unix_base_url(path)
            return srv

        yield start
        for s in started:
            s.close()


async def test_a_json_post_goes_over_the_socket_with_a_sane_host_and_its_connection_is_reused(unix_server: Any) -> None:
    srv = await unix_server(json_reply)
    client = Http11Client()
    for n in range(3):
        reply = await client.post(srv.url + "/v1/chat/completions/render?q=1", json={"n": n})
        assert reply.status_code == 200
        assert reply.json() == {"echo": {"n": n}, "path": "/v1/chat/completions/render?q=1"}
    assert srv.connections == 1
    # A socket's path is no host name: uvicorn (and httpx's uds transport) see localhost.
    assert [r.headers["host"] for r in srv.requests] == ["localhost"] * 3
    await client.aclose()


async def test_a_stream_is_read_whole_over_the_socket(unix_server: Any) -> None:
    srv = await unix_server(sse_reply)
    client = Http11Client()
    async with client.stream("POST", srv.url + "/v1/chat/completions/derender", json={"stream": True}) as reply:
        assert reply.status_code == 200
        body = b"".join([piece async for piece in reply.aiter_raw()])
    assert body == b'data: {"i": 0}\n\ndata: {"i": 1}\n\ndata: {"i": 2}\n\ndata: [DONE]\n\n'
    await client.aclose()


async def test_a_path_keeps_its_case_and_odd_characters(unix_server: Any) -> None:
    srv = await unix_server(json_reply, name="Render Side%car.sock")
    assert "%2F" in srv.url and "Render%20Side%25car.sock" in srv.url
    client = Http11Client()
    assert (await client.post(srv.url + "/x", json=1)).json() == {"echo": 1, "path": "/x"}
    await client.aclose()


async def test_a_missing_or_dead_socket_is_a_refusal_and_a_silent_one_a_timeout(unix_server: Any) -> None:
    client = Http11Client()
    with tempfile.TemporaryDirectory(prefix="motor-h11-") as tmp:
        with pytest.raises(httpx.ConnectError, match="unix:/"):
            await client.post(unix_base_url(os.path.join(tmp, "none.sock")) + "/x", json={})

    async def silent(request: Request, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3600)

    with pytest.raises(httpx.ReadTimeout):
        await client.post((await unix_server(silent)).url + "/x", json={}, timeout=0.05)
    assert all(not conns for conns in client._idle.values())
    await client.aclose()

