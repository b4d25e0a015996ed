"""The composition root chooses the shared implementations when ``REDIS_URL`` is set, and the
per-process ones without it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from serving import runtime, stream_reports
from serving.pipeline import metrics
from serving.pipeline.flow_control import rate_limit
from serving.pipeline.flow_control.admission import TokenAdmission
from serving.pipeline.flow_control.redis_admission import RedisTokenAdmission
from serving.pipeline.resilience.breaker import BreakerBoard
from serving.pipeline.resilience.shared_breaker import SharedBreakerBoard
from tests.serving import shared_redis
from tests.serving.fakes import instance


@pytest.fixture
def restore_limiter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Undo what ``runtime.build()`` installs process-wide: the rate limiter, and the metrics
    registry's hook, which it points at the new runtime's dashboard reporter. Left pointing there,
    every metric recorded by a later test woke a thread that writes to the test database (its
    writer is not the one ``tests/conftest.py`` silences). The built reporters write nowhere, as
    the process's own do, for the notifications that reach them before the restore."""
    for writer in ("_write", "_write_dashboard"):
        monkeypatch.setattr(stream_reports, writer, lambda _payload: None)
    before, on_record = rate_limit.LIMITER, metrics.REGISTRY.on_record
    yield
    rate_limit.install(before)
    metrics.REGISTRY.on_record = on_record


async def test_with_redis_url_admission_limits_and_breakers_are_shared(
    settings: Any, restore_limiter: None, redis_client: Any
) -> None:
    settings.REDIS_URL = shared_redis.DB_URL
    built = runtime.build()
    assert isinstance(built.admission, RedisTokenAdmission)
    assert isinstance(built.breakers, SharedBreakerBoard) and built.scheduler.breakers is built.breakers
    assert isinstance(built.rate_limiter, rate_limit.RedisTokenRateLimiter) and rate_limit.LIMITER is built.rate_limiter
    # The built admission really talks to that Redis (and leaves nothing behind).
    lease = await built.admission.acquire(replace(instance("e1"), token_capacity=100), 10)
    assert await redis_client.zscore("motor:admission:leases", lease.lease_id) is not None
    lease.release()
    assert isinstance(built.admission, RedisTokenAdmission)
    await built.admission.aclose()
    assert await redis_client.zscore("motor:admission:leases", lease.lease_id) is None
    await built.admission.redis.aclose()


def test_without_redis_url_each_process_keeps_its_own(settings: Any, restore_limiter: None) -> None:
    settings.REDIS_URL = ""
    built = runtime.build()
    assert type(built.admission) is TokenAdmission and type(built.breakers) is BreakerBoard
    assert type(built.rate_limiter) is rate_limit.TokenRateLimiter and rate_limit.LIMITER is built.rate_limiter
