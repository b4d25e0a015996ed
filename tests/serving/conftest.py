"""Fixtures of the serving tests; the fake upstreams themselves live in ``fakes.py``."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import httpx
import pytest
import uvloop

from tests.pd_sims import engine_http, http, load  # noqa: F401  (fixtures of the P/D topology tests)
from tests.serving.fakes import ENGINE_URLS, MODEL, FakeUpstreams
from tests.serving.live_edge import _daphne, served  # noqa: F401  (the app behind Daphne and uvicorn on a socket)
from tests.serving.loopback import LoopbackClient
from tests.serving.router_fakes import Rig, assert_no_leaks, make_rig
from tests.serving.shared_redis import prefix, redis_client  # noqa: F401  (fixtures of the Redis-backed tests)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    """The event loops a test module runs on: asyncio's, and uvloop too for a module that asks with
    ``pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])``. uvicorn runs the coordinator on
    uvloop when it is installed, and uvloop's transports are not asyncio's classes."""
    marker = item.get_closest_marker("asyncio")
    if marker is not None and "loop_factories" in marker.kwargs:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


@pytest.fixture
def upstreams() -> FakeUpstreams:
    return FakeUpstreams()


@pytest.fixture
async def mock_client(upstreams: FakeUpstreams) -> AsyncIterator[LoopbackClient]:
    """The production upstream client, its connections to the fakes on 127.0.0.1 (``loopback.py``)."""
    client = LoopbackClient(upstreams.handler)
    yield client
    await client.aclose()


@pytest.fixture
async def render_fake_client(upstreams: FakeUpstreams) -> AsyncIterator[LoopbackClient]:
    """The production upstream client with only the render sidecar faked (on 127.0.0.1): the
    engines are real servers (simulators). Its connections live on the loop of the server a
    test drives (Daphne's thread, or the test's own under uvicorn)."""
    client = LoopbackClient(upstreams.handler, fakes={"render.test"})
    yield client
    await client.aclose()


@pytest.fixture
async def rig(upstreams: FakeUpstreams) -> AsyncIterator[Rig]:
    """A pipeline over fake upstreams with the default breakers; ends by asserting nothing leaked."""
    before = asyncio.all_tasks()
    r = make_rig(upstreams)
    yield r
    await assert_no_leaks(r, before)  # closes the client first


@pytest.fixture
async def v1() -> AsyncIterator[httpx.AsyncClient]:
    """A client of the whole ASGI application (``motorsite.asgi``), as a server calls it: ``/v1``
    reaches the edge, everything else Django. ``ASGITransport`` buffers whole responses; the
    disconnect tests drive the application with ``ApplicationCommunicator`` instead."""
    from motorsite.asgi import application

    transport = httpx.ASGITransport(app=application)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield client


def create_db_fleet() -> None:
    """The fakes' fleet as database rows: the served model (its vocabulary known), the render
    config and one instance per fake engine, so the snapshot the views build matches ``fakes``."""
    from catalog.models import RenderConfig, ServedModel
    from fleet.models import EngineInstance

    model = ServedModel.objects.create(name=MODEL, model_path="/models/tiny", max_model_len=2048, vocab_size=151936)
    RenderConfig.objects.create(host="render.test", port=8100, timeout_ms=5000)
    for name, url in ENGINE_URLS.items():
        EngineInstance.objects.create(name=name, url=url, served_model=model)


@pytest.fixture
def db_upstreams(
    transactional_db: None, upstreams: FakeUpstreams, mock_client: LoopbackClient, monkeypatch: pytest.MonkeyPatch,
) -> FakeUpstreams:
    """The fake upstreams behind a database fleet (``create_db_fleet``): what ``/v1`` serves end to end."""
    create_db_fleet()
    monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: mock_client)
    return upstreams
