"""The real Redis on 127.0.0.1 for the shared-state tests: db 14 (the integration stack uses 15),
a fresh key prefix per test, deleted afterwards (tests assert what they leave behind)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests import prerequisites

DB_URL = f"redis://127.0.0.1:{prerequisites.REDIS_PORT}/14"


def client() -> Any:
    import redis.asyncio

    return redis.asyncio.Redis.from_url(DB_URL, socket_timeout=5, socket_connect_timeout=2)


@pytest.fixture
async def redis_client() -> AsyncIterator[Any]:
    if not prerequisites.redis_answers():
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    c = client()
    yield c
    await c.aclose()


@pytest.fixture
async def prefix(redis_client: Any) -> AsyncIterator[str]:
    """A key prefix of this test's own; whatever is left under it is deleted afterwards."""
    p = f"motor:test:{uuid.uuid4().hex}"
    yield p
    left = await keys(redis_client, p)
    if left:
        await redis_client.delete(*left)


async def keys(redis_client: Any, prefix: str) -> list[str]:
    """Every key under ``prefix`` (tests assert a finished test leaves none)."""
    return sorted([k.decode() async for k in redis_client.scan_iter(match=f"{prefix}:*")])
