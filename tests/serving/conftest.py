"""Fixtures of the serving tests; the fake upstreams themselves live in ``fakes.py``."""

from __future__ import annotations

from typing import AsyncIterator

import httpx
import pytest

from tests.serving.fakes import FakeUpstreams


@pytest.fixture
def upstreams() -> FakeUpstreams:
    return FakeUpstreams()


@pytest.fixture
async def mock_client(upstreams: FakeUpstreams) -> AsyncIterator[httpx.AsyncClient]:
    client = httpx.AsyncClient(transport=httpx.MockTransport(upstreams.handler))
    yield client
    await client.aclose()
