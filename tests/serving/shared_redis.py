"""The real Redis on 127.0.0.1 for the shared-state tests: db 13 (none of tests/integration's, which
runs at the same time under ``make test``: tests/sessions.py), a fresh key prefix per test, deleted
afterwards (tests assert what they leave behind)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests import prerequisites

DB = 13
DB_URL = f"redis://127.0.0.1:{prerequisites.REDIS_PORT}/{DB}"


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


async def keys_but_clock(redis_client: Any, prefix: str) -> list[str]:
    """What is left under ``prefix`` besides ``<prefix>:clock``, the clock of
    ``serving.pipeline.redis_clock`` (one small hash that stays)."""
    return [k for k in await keys(redis_client, prefix) if k != f"{prefix}:clock"]


# A step of Redis's wall clock, played without touching the machine's clock: the scripts of a
# client wrapped in ShiftedTime see ``redis.call('TIME')`` plus the seconds stored in a key the
# test sets. Nothing else changes; it is the real Redis underneath (whose own key expiry, which
# a script cannot see, keeps the real clock).
SHIFTED_TIME = (
    "(function() local t = redis.call('TIME') "
    "return {tostring(tonumber(t[1]) + tonumber(redis.call('GET', '%s') or '0')), t[2]} end)()"
)


class ShiftedTime:
    def __init__(self, client: Any, shift_key: str) -> None:
        self._client = client
        self._shift_key = shift_key

    def register_script(self, script: str) -> Any:
        return self._client.register_script(script.replace("redis.call('TIME')", SHIFTED_TIME % self._shift_key))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class RedisGate:
    """A TCP proxy on 127.0.0.1 in front of the test Redis that a test shuts and opens again.

    Shut, it cuts every connection through it and closes each new one at once, which a client
    sees as Redis unreachable; opened, it forwards bytes both ways untouched. Use as
    ``async with RedisGate() as gate`` and talk to Redis through ``gate.client()``.
    """

    def __init__(self) -> None:
        self.is_open = True
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> RedisGate:
        self._server = await asyncio.start_server(self._serve, prerequisites.HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.shut()
        await self._server.wait_closed()

    def client(self) -> Any:
        import redis.asyncio

        return redis.asyncio.Redis.from_url(
            f"redis://{prerequisites.HOST}:{self.port}/{DB}", socket_timeout=2, socket_connect_timeout=2
        )

    def shut(self) -> None:
        self.is_open = False
        for writer in list(self._writers):
            writer.close()

    def open(self) -> None:
        self.is_open = True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.is_open:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(prerequisites.HOST, prerequisites.REDIS_PORT)
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._writers -= {writer, up_writer}
            writer.close()
            up_writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
