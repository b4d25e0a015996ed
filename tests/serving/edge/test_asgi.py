"""The edge's ASGI plumbing alone: the disconnect watch, the body reader, the depth bound, the mount."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from serving.edge.asgi import (
    BodyTooLarge,
    ClientGone,
    ClientStalled,
    DisconnectWatch,
    PrefixMount,
    read_body,
    send_stream,
)
from serving.edge.bodies import nests_deeper, parse_object
from serving.pipeline.errors import RequestError


class Inbox:
    """An ASGI ``receive`` fed by the test."""

    def __init__(self, *messages: dict[str, Any]) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        for m in messages:
            self.queue.put_nowait(m)

    async def __call__(self) -> dict[str, Any]:
        return await self.queue.get()


async def test_the_watch_cancels_the_handler_on_disconnect_and_absorbs_only_its_own_cancel() -> None:
    inbox = Inbox()
    before = asyncio.all_tasks()
    reached_cleanup = False

    async def handler() -> None:
        nonlocal reached_cleanup
        async with DisconnectWatch(inbox):
            try:
                inbox.queue.put_nowait({"type": "http.disconnect"})
                await asyncio.Event().wait()
            finally:
                reached_cleanup = True
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]

    async with asyncio.timeout(5):
        await asyncio.create_task(handler())  # returns normally: nobody to answer
    assert reached_cleanup
    assert asyncio.all_tasks() == before


async def test_a_cancel_from_elsewhere_still_propagates() -> None:
    inbox = Inbox()
    started = asyncio.Event()

    async def handler() -> None:
        async with DisconnectWatch(inbox):
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(handler())
    await started.wait()
    task.cancel()  # the server shutting down, not the client leaving
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_disconnect_once_the_response_is_complete_cancels_nothing() -> None:
    inbox = Inbox()

    async def handler() -> str:
        async with DisconnectWatch(inbox) as watch:
            watch.complete = True
            # uvicorn answers receive() with http.disconnect as soon as the response is complete.
            inbox.queue.put_nowait({"type": "http.disconnect"})
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        return "sent"

    async with asyncio.timeout(5):
        assert await asyncio.create_task(handler()) == "sent"


async def test_the_watch_leaves_an_enclosing_timeout_working() -> None:
    inbox = Inbox()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            async with DisconnectWatch(inbox):
                await asyncio.Event().wait()


async def test_a_send_that_waits_past_the_stall_deadline_cuts_the_stream() -> None:
    """The client reads the first frame, then nothing: the server's send waits until the deadline.

    The stream's generator is closed in the request's task, and the disconnect the server then
    reports (it drops the connection of the abandoned send) cancels nothing.
    """
    inbox = Inbox()
    before = asyncio.all_tasks()
    sent: list[dict[str, Any]] = []
    closed = False

    async def frames() -> Any:
        nonlocal closed
        try:
            while True:
                yield b"data: {}\n\n"
        finally:
            closed = True

    async def send(message: dict[str, Any]) -> None:
        if len(sent) == 2:  # the status and the first frame went out
            try:
                await asyncio.Event().wait()  # the client's buffers are full
            except asyncio.CancelledError:
                inbox.queue.put_nowait({"type": "http.disconnect"})
                raise
        sent.append(message)

    async def handler() -> None:
        async with DisconnectWatch(inbox) as watch:
            with pytest.raises(ClientStalled):
                await send_stream(send, frames(), (), watch, stall_s=0.01)
            assert closed
            for _ in range(3):
                await asyncio.sleep(0)  # the watch reads the disconnect: no cancel lands here

    async with asyncio.timeout(5):
        await asyncio.create_task(handler())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert asyncio.all_tasks() == before


async def test_a_cancel_from_elsewhere_during_a_waiting_send_is_no_stall() -> None:
    inbox = Inbox()
    waiting = asyncio.Event()

    async def frames() -> Any:
        yield b"data: {}\n\n"

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            waiting.set()
            await asyncio.Event().wait()

    async def handler() -> None:
        async with DisconnectWatch(inbox) as watch:
            await send_stream(send, frames(), (), watch, stall_s=60)

    task = asyncio.create_task(handler())
    await waiting.wait()
    task.cancel()  # the server shutting down
    with pytest.raises(asyncio.CancelledError):
        await task
    loop = asyncio.get_running_loop()
    assert all(h.cancelled() for h in loop._scheduled)  # type: ignore[attr-defined]  # the deadline's timer went


def scope(headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    return {"type": "http", "headers": headers or []}


async def test_read_body_joins_chunks_and_stops_at_the_last() -> None:
    inbox = Inbox(
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"", "more_body": True},
        {"type": "http.request", "body": b"c", "more_body": False},
        {"type": "http.disconnect"},  # left for the watch
    )
    assert await read_body(scope(), inbox, 3) == b"abc"
    assert inbox.queue.qsize() == 1


async def test_read_body_refuses_over_the_cap_and_notices_a_client_leaving() -> None:
    with pytest.raises(BodyTooLarge):
        await read_body(scope([(b"content-length", b"4")]), Inbox(), 3)
    with pytest.raises(BodyTooLarge):
        await read_body(scope(), Inbox({"type": "http.request", "body": b"abcd"}), 3)
    with pytest.raises(ClientGone):
        await read_body(scope(), Inbox({"type": "http.request", "body": b"a", "more_body": True}, {"type": "http.disconnect"}), 3)


@pytest.mark.parametrize(
    ("value", "limit", "deeper"),
    [
        ({}, 1, False),
        ({"a": []}, 1, True),
        ({"a": []}, 2, False),
        ({"a": [1, 2, {"b": [[]]}]}, 4, True),
        ({"a": [1, 2, {"b": [[]]}]}, 5, False),
        ({"a": [[]] * 50, "b": "[[[[["}, 3, False),  # wide, not deep; brackets in strings are text
    ],
)
def test_nests_deeper(value: dict[str, Any], limit: int, deeper: bool) -> None:
    assert nests_deeper(value, limit) is deeper


def test_parse_object_bounds_depth_even_when_brackets_are_few_in_number() -> None:
    assert parse_object(b'{"a": "[[[[[[[[[[[["}', max_depth=2) == {"a": "[[[[[[[[[[[["}
    with pytest.raises(RequestError, match="nests deeper than 2"):
        parse_object(b'{"a": [[]]}', max_depth=2)


async def test_the_mount_splits_on_the_prefix_and_nothing_else() -> None:
    seen: list[tuple[str, str]] = []

    def app(name: str) -> Any:
        async def call(scope: dict[str, Any], receive: Any, send: Any) -> None:
            seen.append((name, scope.get("path", scope["type"])))

        return call

    mount = PrefixMount("/v1", app("edge"), app("django"))
    for path in ("/v1", "/v1/models", "/v1x", "/admin/", "/v"):
        await mount({"type": "http", "path": path}, Inbox(), Inbox())
    await mount({"type": "lifespan"}, Inbox(), Inbox())
    assert seen == [
        ("edge", "/v1"), ("edge", "/v1/models"), ("django", "/v1x"), ("django", "/admin/"), ("django", "/v"),
        ("django", "lifespan"),
    ]
