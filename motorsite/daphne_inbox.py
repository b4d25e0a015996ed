"""Daphne's per-request input queue, without an ``asyncio.Queue``.

Daphne hands each request's messages (body chunks, ``http.disconnect``) to the application through
an ``asyncio.Queue`` made in ``Server.create_application``; the application's ``receive`` is its
``get``. The queue lives as long as the request, and its three deques and an ``asyncio.Event``
(a fourth) weigh 2.8 KiB, which a stream whose client reads nothing keeps for as long as it is
held back (``bench/slow_reader.py``). Daphne only ever calls ``put_nowait`` (and tests the queue
for truth) and the application ``get``: ``Inbox`` is those two, unbounded as Daphne's queue is.

Read against Daphne 4.2.3 (``create_application`` is copied from it, with the queue swapped).
"""

from __future__ import annotations

import asyncio
import sys
from functools import partial
from typing import Any


class Inbox:
    """``put_nowait`` and ``get`` of an unbounded ``asyncio.Queue``, for one request."""

    __slots__ = ("_items", "_getters")

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._getters: list[asyncio.Future[None]] = []  # receive() calls waiting for a message

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        self._wake_next()

    async def get(self) -> Any:
        while not self._items:
            getter = asyncio.get_running_loop().create_future()
            self._getters.append(getter)
            try:
                await getter
            except BaseException:
                if getter in self._getters:
                    self._getters.remove(getter)
                if self._items and getter.done() and not getter.cancelled():
                    # Woken, then cancelled before it ran: the message is for the next getter.
                    self._wake_next()
                raise
        return self._items.pop(0)

    def _wake_next(self) -> None:
        while self._getters:
            getter = self._getters.pop(0)
            if not getter.done():
                getter.set_result(None)
                return


def _create_application(self: Any, protocol: Any, scope: dict[str, Any]) -> Inbox | None:
    # Daphne 4.2.3's Server.create_application, with an Inbox for its asyncio.Queue.
    assert "application_instance" not in self.connections[protocol]
    inbox = Inbox()
    scope.setdefault("asgi", {"version": "3.0"})
    application_instance = self.application(
        scope=scope, receive=inbox.get, send=partial(self.handle_reply, protocol),
    )
    if protocol not in self.connections:
        return None
    self.connections[protocol]["application_instance"] = asyncio.ensure_future(
        application_instance, loop=asyncio.get_event_loop(),
    )
    return inbox


def install() -> None:
    """Make Daphne's server hand each request an ``Inbox``; a no-op where Daphne's server is not imported. Idempotent."""
    server = sys.modules.get("daphne.server")
    if server is None or getattr(server.Server, "_motor_inbox", False):
        return
    server.Server.create_application = _create_application
    server.Server._motor_inbox = True
