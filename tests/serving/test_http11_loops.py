"""The upstream client outlives the event loops it served: one it no longer serves is not held.

A client keeps connections and an idle-connection sweep per loop (``Http11Client._sweeps``). A
loop closed while its sweep was pending never runs that timer, so the client must not be what
keeps the loop (and through it its selector, tasks and handles) alive: tests run one loop each,
and ``serving.pipeline.http`` keeps a client per loop only as long as the loop lives.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Callable

import pytest
import uvloop

from serving.pipeline import http11
from serving.pipeline.http11 import Http11Client


async def kept_then_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer the first request keep-alive, the second with ``connection: close``."""
    for close in (False, True):
        try:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)  # the client's ``{}``
        except (asyncio.IncompleteReadError, ConnectionError):
            break
        writer.write(b"HTTP/1.1 200 OK\r\n%scontent-length: 2\r\n\r\n{}" % (b"connection: close\r\n" if close else b""))
        await writer.drain()
    writer.close()


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_a_loop_closed_with_its_sweep_pending_is_not_held_by_the_client(
    new_loop: Callable[[], asyncio.AbstractEventLoop], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http11, "KEEPALIVE_S", 3600.0)  # the sweep is still pending when the loop closes
    client = Http11Client()
    loop = new_loop()

    async def use() -> None:
        server = await asyncio.start_server(kept_then_closed, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        await client.post(url, json={})  # kept alive: pooled, and the loop's sweep is set
        await client.post(url, json={})  # the pooled connection, closed after this reply
        server.close()
        await server.wait_closed()

    loop.run_until_complete(use())
    # The state under test: no connection of the loop left in the pool, its sweep still pending.
    assert not any(client._idle.values())
    assert len(client._sweeps) == 1
    loop.close()
    gone = weakref.ref(loop)
    del loop
    gc.collect()
    assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
    assert len(client._sweeps) == 0
    asyncio.run(client.aclose())
