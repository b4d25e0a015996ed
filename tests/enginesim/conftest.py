"""Fixtures for the simulator tests: an in-process client and real uvicorn servers.

``httpx.ASGITransport`` buffers whole responses, so streaming, disconnect and dropped
connection tests run against real servers on 127.0.0.1 (one thread each, per session).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio

from enginesim import SimConfig, create_app
from enginesim.testing import LiveServer

# Small vocabulary and context keep "length at context end" short; ids 0-3 play the
# tokenizer's special tokens and 2 is eos.
TEST_CONFIG = SimConfig(
    served_model_names=("tiny", "tiny-alias"),
    vocab_size=512,
    eos_token_ids=(2,),
    special_token_ids=frozenset({0, 1, 2, 3}),
    max_model_len=64,
    seed=0,
)


@pytest.fixture(scope="session")
def _fast_server() -> Iterator[LiveServer]:
    server = LiveServer(TEST_CONFIG)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def _slow_server() -> Iterator[LiveServer]:
    # 20 ms per token: a 1000-token request is still running when a test aborts or
    # disconnects, yet reading a few tokens stays quick.
    server = LiveServer(dataclasses.replace(TEST_CONFIG, tpot_ms=20.0, max_model_len=4096))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def fast_server(_fast_server: LiveServer) -> LiveServer:
    _fast_server.reset()
    return _fast_server


@pytest.fixture
def slow_server(_slow_server: LiveServer) -> LiveServer:
    _slow_server.reset()
    return _slow_server


@pytest_asyncio.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """In-process client for the JSON endpoints (``app.state.engine`` via ``client.app``)."""
    app = create_app(TEST_CONFIG)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://sim"
    ) as c:
        yield c


@pytest_asyncio.fixture
async def live_client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as c:
        yield c
