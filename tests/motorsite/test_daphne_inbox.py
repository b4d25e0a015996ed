"""``motorsite.daphne_inbox.Inbox``: Daphne's per-request queue as Daphne and the application use it.

Through the real server, every Daphne test of the front door and the streaming edge reads its
body and disconnects through it; these hold the order and the hand-over a cancelled ``receive``
must not lose, which no socket test can time.
"""

from __future__ import annotations

import asyncio

import pytest

from motorsite import daphne_inbox
from motorsite.daphne_inbox import Inbox


async def test_messages_come_out_in_order_and_a_waiting_receive_gets_the_next() -> None:
    inbox = Inbox()
    assert inbox  # Daphne tests its queue for truth before it puts a message
    inbox.put_nowait({"n": 1})
    inbox.put_nowait({"n": 2})
    assert [await inbox.get(), await inbox.get()] == [{"n": 1}, {"n": 2}]
    waiting = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    assert not waiting.done()
    inbox.put_nowait({"type": "http.disconnect"})
    assert await waiting == {"type": "http.disconnect"}


async def test_a_receive_cancelled_after_it_was_woken_passes_the_message_on() -> None:
    inbox = Inbox()
    first = asyncio.ensure_future(inbox.get())
    second = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    inbox.put_nowait("body")  # wakes the first getter ...
    first.cancel()  # ... which is cancelled before it runs
    assert await second == "body"
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_a_cancelled_receive_leaves_no_waiter_behind() -> None:
    inbox = Inbox()
    waiting = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    inbox.put_nowait("later")
    assert await inbox.get() == "later"
    assert inbox._getters == []


def test_daphnes_server_hands_requests_an_inbox() -> None:
    from daphne.server import Server

    daphne_inbox.install()
    server = Server.__new__(Server)
    server.connections = {"protocol": {}}
    server.application = lambda scope, receive, send: asyncio.sleep(0)

    async def create() -> object:
        queue = server.create_application("protocol", {"type": "http"})
        await server.connections["protocol"]["application_instance"]
        return queue

    assert isinstance(asyncio.run(create()), Inbox)
