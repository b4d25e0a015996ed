"""Client disconnects through the whole ASGI stack (Channels' router, the /v1 edge).

Driven with ``channels.testing.ApplicationCommunicator`` because ``httpx.ASGITransport`` buffers
whole responses and never sends ``http.disconnect`` mid-stream. Every test runs under an
``asyncio.timeout`` watchdog and ends by asserting that the engine streams were closed and
aborted, the load counters released, and no task left behind.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

import httpx
import pytest
from channels.testing import ApplicationCommunicator

from motorsite.asgi import application
from serving import runtime, snapshots
from tests.serving.fakes import MODEL, FakeUpstreams, StreamPlan
from tests.serving.loopback import Loopback, LoopbackClient

pytestmark = pytest.mark.django_db(transaction=True)

WATCHDOG_S = 5


@pytest.fixture(autouse=True)
def fresh_snapshot(settings: Any) -> Iterator[None]:
    settings.MOTOR_API_KEYS = []
    settings.MOTOR_OPEN_ACCESS = True  # open unless a test closes it
    snapshots.invalidate()
    yield
    snapshots.invalidate()


@pytest.fixture
def upstream(db_upstreams: FakeUpstreams) -> FakeUpstreams:
    upstreams = db_upstreams
    # Every engine stream sends two events, then blocks until it is closed: only a disconnect ends it.
    upstreams.default_plan = StreamPlan(end="hang", after=2)
    return upstreams


def http_scope(path: str) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000), "server": ("testserver", 80),
    }


async def assert_nothing_left(upstream: FakeUpstreams, tasks_before: set[asyncio.Task[Any]], loopback: Loopback) -> None:
    """No engine stream open, no load held, no task of the request still running.

    The engines are served over 127.0.0.1 (``loopback.py``): a stream the coordinator closed is
    closed at the fake once the loopback has seen its connection go (``settle``), and the
    loopback's own connection tasks are the fake engines', not the request's."""
    await loopback.settle()
    assert upstream.open_streams == set()
    assert runtime.load.snapshot() == {}
    assert runtime.inflight_tokens() == {}
    assert asyncio.all_tasks() - tasks_before - loopback.tasks() == set()


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "stream": True, **extra}


async def start(path: str, body: dict[str, Any]) -> tuple[ApplicationCommunicator, str]:
    """Send a streaming request and wait for its 200; returns the communicator and request id."""
    communicator = ApplicationCommunicator(application, http_scope(path))
    await communicator.send_input({"type": "http.request", "body": json.dumps(body).encode(), "more_body": False})
    head = await communicator.receive_output(WATCHDOG_S)
    assert head["type"] == "http.response.start" and head["status"] == 200, head
    return communicator, dict(head["headers"])[b"x-request-id"].decode()


async def first_chunk(communicator: ApplicationCommunicator) -> bytes:
    message = await communicator.receive_output(WATCHDOG_S)
    assert message["type"] == "http.response.body" and message["more_body"], message
    assert message["body"].startswith(b"data: {")
    return message["body"]


async def hang_up(communicator: ApplicationCommunicator) -> None:
    await communicator.send_input({"type": "http.disconnect"})
    # Returns once the edge has returned: the request's task was cancelled and its cleanup awaited.
    await communicator.wait(timeout=WATCHDOG_S)


def assert_aborted(upstream: FakeUpstreams, engine_ids: set[str]) -> None:
    """Each engine stream was closed, and aborted once on the engine that ran it."""
    assert upstream.open_streams == set()
    assert sorted(upstream.closed_streams) == sorted(engine_ids)
    ran_on = {c.body["request_id"]: c.host for c in upstream.calls_of("generate")}
    assert sorted(upstream.aborted_ids()) == sorted((ran_on[rid], f"generate-tokens-{rid}") for rid in engine_ids)
    assert all(len(c.body["request_ids"]) == 1 for c in upstream.calls_of("abort"))


async def test_it_closes_and_aborts_the_engine_stream_when_a_chat_client_hangs_up(upstream: FakeUpstreams, mock_client: LoopbackClient) -> None:
    tasks_before = asyncio.all_tasks()
    async with asyncio.timeout(WATCHDOG_S):
        communicator, request_id = await start("/v1/chat/completions", chat())
        await first_chunk(communicator)
        engine_id = f"chatcmpl-{request_id}"
        assert upstream.open_streams == {engine_id}  # the engine is still generating, blocked

        await hang_up(communicator)

    # All done inside the handler's own task: nothing to wait for once it returned.
    assert_aborted(upstream, {engine_id})
    assert [c.body for c in upstream.calls_of("abort")] == [{"request_ids": [f"generate-tokens-{engine_id}"]}]
    await assert_nothing_left(upstream, tasks_before, mock_client.loopback)


async def test_it_closes_and_aborts_every_prompt_stream_when_a_completions_client_hangs_up(
    upstream: FakeUpstreams, mock_client: LoopbackClient,
) -> None:
    tasks_before = asyncio.all_tasks()
    async with asyncio.timeout(WATCHDOG_S):
        body = {"model": MODEL, "prompt": ["a", "b"], "stream": True}
        communicator, request_id = await start("/v1/completions", body)
        await first_chunk(communicator)
        engine_ids = {f"cmpl-{request_id}-0", f"cmpl-{request_id}-1"}
        assert upstream.open_streams == engine_ids

        await hang_up(communicator)

    assert_aborted(upstream, engine_ids)
    await assert_nothing_left(upstream, tasks_before, mock_client.loopback)  # the merge's producer tasks included


async def test_it_cleans_up_a_client_that_hangs_up_after_the_status_before_any_chunk(upstream: FakeUpstreams, mock_client: LoopbackClient) -> None:
    upstream.default_plan = StreamPlan(end="hang", after=0)  # the engine accepted, then says nothing
    tasks_before = asyncio.all_tasks()
    async with asyncio.timeout(WATCHDOG_S):
        communicator, request_id = await start("/v1/chat/completions", chat())
        assert communicator.output_queue.empty()

        await hang_up(communicator)

    assert communicator.output_queue.empty()
    assert_aborted(upstream, {f"chatcmpl-{request_id}"})
    await assert_nothing_left(upstream, tasks_before, mock_client.loopback)


async def test_it_cleans_up_a_client_that_hangs_up_before_the_response_is_sent(upstream: FakeUpstreams, mock_client: LoopbackClient) -> None:
    """The engines accepted, the pipeline returned its stream, the client left as the status was sent.

    The server's ``send`` yields to the loop while the disconnect is queued, so the cancellation
    lands there: ``frames()`` never runs and cannot abort the engines itself; the edge closes the
    stream in the same task.
    """
    tasks_before = asyncio.all_tasks()
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    inbox.put_nowait({"type": "http.request", "body": json.dumps(chat()).encode(), "more_body": False})
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            inbox.put_nowait({"type": "http.disconnect"})
            await asyncio.sleep(0)  # the watch reads the disconnect and cancels the request ...
            await asyncio.sleep(0)  # ... which is delivered here, before anything was written
        sent.append(message)

    async with asyncio.timeout(WATCHDOG_S):
        await application(http_scope("/v1/chat/completions"), inbox.get, send)

    assert sent == []  # not even the status went out
    (generate,) = upstream.calls_of("generate")
    assert_aborted(upstream, {generate.body["request_id"]})
    await assert_nothing_left(upstream, tasks_before, mock_client.loopback)


async def test_it_cancels_render_when_the_client_hangs_up_before_the_status(upstream: FakeUpstreams, mock_client: LoopbackClient) -> None:
    """A disconnect while the pipeline still works (here: render has not answered) cancels it at once.

    Channels' ``AsyncHttpConsumer`` would notice only after the handler returned (django/channels#1249);
    the edge watches ``receive`` while the handler runs.
    """
    render_waiting = asyncio.Event()
    render_cancelled = asyncio.Event()

    async def slow_render(request: httpx.Request, body: Any) -> httpx.Response:
        render_waiting.set()
        try:
            await asyncio.Event().wait()  # never answers
        except asyncio.CancelledError:
            render_cancelled.set()
            raise
        raise AssertionError("unreachable")

    upstream.override("render", "render", slow_render)
    tasks_before = asyncio.all_tasks()
    async with asyncio.timeout(WATCHDOG_S):
        communicator = ApplicationCommunicator(application, http_scope("/v1/chat/completions"))
        await communicator.send_input({"type": "http.request", "body": json.dumps(chat()).encode()})
        await render_waiting.wait()

        await hang_up(communicator)

    await mock_client.loopback.settle()  # the coordinator's close reaches the fake render over its socket
    assert render_cancelled.is_set()
    assert communicator.output_queue.empty()  # nobody to answer
    assert upstream.calls_of("generate") == []
    await assert_nothing_left(upstream, tasks_before, mock_client.loopback)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_client_that_hangs_up_while_sending_its_body_is_not_served(upstream: FakeUpstreams, mock_client: LoopbackClient, path: str) -> None:
    tasks_before = asyncio.all_tasks()
    async with asyncio.timeout(WATCHDOG_S):
        communicator = ApplicationCommunicator(application, http_scope(path))
        await communicator.send_input({"type": "http.request", "body": b'{"model": ', "more_body": True})
        await hang_up(communicator)

    assert communicator.output_queue.empty()
    assert upstream.calls == []
    await assert_nothing_left(upstream, tasks_before, mock_client.loopback)
