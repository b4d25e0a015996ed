"""Token admission: per-instance capacity, a global budget, a bounded FIFO queue with a deadline,
and leases released exactly once; in process and shared through the real Redis on 127.0.0.1."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import AsyncIterator

import pytest

from serving.pipeline.errors import AdmissionTimeout, QueueFull
from serving.pipeline.flow_control.admission import AdmissionSettings, RedisTokenAdmission, TokenAdmission
from tests import prerequisites
from tests.serving.fakes import instance

E1 = replace(instance("e1"), token_capacity=100)
E2 = replace(instance("e2"), token_capacity=100)


async def test_it_admits_within_capacity_and_releases_once() -> None:
    adm = TokenAdmission()
    lease = await adm.acquire(E1, 60)
    assert adm.inflight_tokens() == {"e1": 60}
    lease.release()
    lease.release()  # idempotent: a second release must not free someone else's tokens
    assert adm.inflight_tokens() == {}


async def test_a_full_instance_makes_requests_wait_fifo_until_release() -> None:
    adm = TokenAdmission()
    first = await adm.acquire(E1, 80)
    waiter_a = asyncio.create_task(adm.acquire(E1, 50))
    waiter_b = asyncio.create_task(adm.acquire(E1, 10))  # fits now, but must not overtake a
    await asyncio.sleep(0)
    assert adm.waiting() == 2 and not waiter_a.done() and not waiter_b.done()
    first.release()
    a, b = await waiter_a, await waiter_b
    assert adm.inflight_tokens() == {"e1": 60}
    a.release()
    b.release()
    assert adm.inflight_tokens() == {} and adm.waiting() == 0


async def test_an_oversized_request_is_admitted_on_an_idle_instance() -> None:
    adm = TokenAdmission()
    async with await adm.acquire(E1, 500):
        assert adm.inflight_tokens() == {"e1": 500}
    assert adm.inflight_tokens() == {}


async def test_the_global_budget_spans_instances() -> None:
    adm = TokenAdmission(AdmissionSettings(global_budget=120, wait_s=0.05))
    lease = await adm.acquire(E1, 100)
    with pytest.raises(AdmissionTimeout) as info:
        await adm.acquire(E2, 50)  # e2 is empty, but the coordinator-wide budget is not
    assert info.value.status == 503
    lease.release()
    assert adm.inflight_tokens() == {} and adm.waiting() == 0


async def test_a_full_queue_is_429_with_retry_after() -> None:
    adm = TokenAdmission(AdmissionSettings(queue_size=1, retry_after_s=3))
    held = await adm.acquire(E1, 100)
    waiter = asyncio.create_task(adm.acquire(E1, 100))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull) as info:
        await adm.acquire(E1, 100)
    assert info.value.status == 429 and info.value.retry_after_s == 3
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    held.release()
    assert adm.inflight_tokens() == {} and adm.waiting() == 0


async def test_a_waiter_cancelled_after_being_granted_gives_the_tokens_back() -> None:
    adm = TokenAdmission()
    held = await adm.acquire(E1, 100)
    waiter = asyncio.create_task(adm.acquire(E1, 100))
    await asyncio.sleep(0)
    held.release()  # grants the waiter synchronously...
    waiter.cancel()  # ...which is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert adm.inflight_tokens() == {} and adm.waiting() == 0


async def test_concurrent_requests_leave_zero_in_flight() -> None:
    adm = TokenAdmission(AdmissionSettings(global_budget=150))

    async def one(i: int) -> None:
        async with await adm.acquire(E1 if i % 2 else E2, 40 + i):
            await asyncio.sleep(0)
            if i % 5 == 0:
                raise ValueError("request failed")

    results = await asyncio.gather(*(one(i) for i in range(30)), return_exceptions=True)
    assert sum(isinstance(r, ValueError) for r in results) == 6
    assert adm.inflight_tokens() == {} and adm.waiting() == 0


# -- Redis ----------------------------------------------------------------------------------------


@pytest.fixture
async def redis_client() -> AsyncIterator[object]:
    if not prerequisites.redis_answers():
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    import redis.asyncio

    client = redis.asyncio.Redis.from_url("redis://127.0.0.1:6379/15")
    yield client
    await client.aclose()


async def test_redis_admission_is_shared_between_processes(redis_client: object) -> None:
    prefix = f"motor:test:{uuid.uuid4().hex}"
    settings = AdmissionSettings(wait_s=0.2)
    a = RedisTokenAdmission(redis_client, settings, prefix=prefix, poll_s=0.01)
    b = RedisTokenAdmission(redis_client, settings, prefix=prefix, poll_s=0.01)
    lease = await a.acquire(E1, 80)
    with pytest.raises(AdmissionTimeout):
        await b.acquire(E1, 50)  # the other "process" sees a's tokens
    lease.release()
    await a.aclose()
    async with await b.acquire(E1, 50):
        assert b.inflight_tokens() == {"e1": 50}
    await b.aclose()
    assert await redis_client.zcard(f"{prefix}:instance:e1") == 0  # type: ignore[attr-defined]
    assert a.inflight_tokens() == {} and b.inflight_tokens() == {}


async def test_a_crashed_holders_lease_comes_back_after_it_expires(redis_client: object) -> None:
    prefix = f"motor:test:{uuid.uuid4().hex}"
    crashed = RedisTokenAdmission(redis_client, AdmissionSettings(), prefix=prefix, lease_ttl_s=0.3)
    lease = await crashed.acquire(E1, 100)
    # The process dies: no release, no renewal.
    crashed._renewers.pop(lease.lease_id).cancel()

    survivor = RedisTokenAdmission(redis_client, AdmissionSettings(wait_s=5.0), prefix=prefix, poll_s=0.02)
    async with await survivor.acquire(E1, 100):
        assert survivor.inflight_tokens() == {"e1": 100}
    await survivor.aclose()
    assert await redis_client.zcard(f"{prefix}:global") == 0  # type: ignore[attr-defined]
