"""Token admission shared through the real Redis on 127.0.0.1 (db 13): leases on a clock that a
step of Redis's wall clock does not move, a FIFO queue per instance woken by pub/sub, waiters that
leave no member behind, and 503 with ``Retry-After`` when Redis is away. Two independent clients
stand for two processes."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import pytest
from redis.exceptions import ResponseError

from serving.pipeline.errors import AdmissionTimeout, AdmissionUnavailable, RequestError
from serving.pipeline.flow_control.admission import AdmissionSettings, LeaseGroup
from serving.pipeline.flow_control.redis_admission import RedisTokenAdmission
from tests.serving import shared_redis
from tests.serving.fakes import instance
from tests.serving.shared_redis import ShiftedTime
from tests.serving.shared_redis import keys_but_clock as keys

E1 = replace(instance("e1"), token_capacity=100)
E2 = replace(instance("e2"), token_capacity=100)
E3 = replace(instance("e2"), id=3, name="e3", token_capacity=100)


async def settle(*admissions: RedisTokenAdmission) -> None:
    for a in admissions:
        await a.aclose()
        assert a.inflight_tokens() == {} and a.waiting() == 0
        # No task left: subscriber, lease renewers, pending removals.
        assert a._listener is None and a._removals == set()
        assert all(t.done() for t in a._renewers.values())


async def test_a_release_in_one_process_wakes_a_waiter_in_another_by_pub_sub(redis_client: Any, prefix: str) -> None:
    other = shared_redis.client()
    before = asyncio.all_tasks()
    # The re-check is longer than the deadline: only the published wake-up can admit in time.
    a = RedisTokenAdmission(redis_client, AdmissionSettings(wait_s=5.0), prefix=prefix, recheck_s=60)
    b = RedisTokenAdmission(other, AdmissionSettings(wait_s=5.0), prefix=prefix, recheck_s=60)
    try:
        lease = await a.acquire(E1, 80)
        waiter = asyncio.create_task(b.acquire(E1, 50))
        while b.waiting() == 0 or await redis_client.zcard(f"{prefix}:queue:e1") == 0:
            await asyncio.sleep(0.01)
        assert not waiter.done()  # b sees a's tokens
        lease.release()
        async with asyncio.timeout(3):
            granted = await waiter
        assert b.inflight_tokens() == {"e1": 50}
        granted.release()
        await settle(a, b)
    finally:
        await other.aclose()
    assert await keys(redis_client, prefix) == []
    assert asyncio.all_tasks() - before - {asyncio.current_task()} == set()


async def test_a_timed_out_waiter_removes_its_member(redis_client: Any, prefix: str) -> None:
    a = RedisTokenAdmission(redis_client, AdmissionSettings(wait_s=0.3), prefix=prefix, recheck_s=0.1)
    held = await a.acquire(E1, 100)
    with pytest.raises(AdmissionTimeout):
        await a.acquire(E1, 10)
    assert await redis_client.zcard(f"{prefix}:queue:e1") == 0
    assert await redis_client.zcard(f"{prefix}:leases") == 1  # only ``held``
    held.release()
    await settle(a)
    assert await keys(redis_client, prefix) == []


async def test_a_cancelled_waiter_removes_its_member(redis_client: Any, prefix: str) -> None:
    a = RedisTokenAdmission(redis_client, AdmissionSettings(wait_s=5), prefix=prefix, recheck_s=0.1)
    held = await a.acquire(E1, 100)
    waiter = asyncio.create_task(a.acquire(E1, 10))
    while await redis_client.zcard(f"{prefix}:queue:e1") == 0:
        await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert await redis_client.zcard(f"{prefix}:queue:e1") == 0
    held.release()
    await settle(a)
    assert await keys(redis_client, prefix) == []


async def test_it_refuses_a_non_positive_amount_in_python_and_in_the_script(redis_client: Any, prefix: str) -> None:
    a = RedisTokenAdmission(redis_client, AdmissionSettings(wait_s=0.2), prefix=prefix)
    for amount in (0, -5):
        with pytest.raises(RequestError):
            await a.acquire(E1, amount)
    with pytest.raises(ResponseError, match="positive integer"):  # a caller that bypassed acquire
        await a._acquire(keys=a._keys("e1"), args=[a.channel, a.clock_step_ms, "x", -5, 100, -1, 1000, 1000, "0", "e1"])
    assert await keys(redis_client, prefix) == []
    async with await a.acquire(E1, 60):  # later acquires work: nothing is poisoned
        with pytest.raises(AdmissionTimeout):
            await a.acquire(E1, 60)
    await settle(a)
    assert await keys(redis_client, prefix) == []


async def test_lease_expiry_is_on_the_shared_leases_clock_not_the_process_clock(
    redis_client: Any, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = RedisTokenAdmission(redis_client, AdmissionSettings(), prefix=prefix, lease_ttl_s=15)
    monkeypatch.setattr(time, "time", lambda: 10.0)  # this process's wall clock is 56 years off
    lease = await a.acquire(E1, 10)
    clock_ms = float(await redis_client.hget(f"{prefix}:clock", "now"))
    expiry_ms = await redis_client.zscore(f"{prefix}:leases", lease.lease_id)
    assert expiry_ms - clock_ms == 15_000
    lease.release()
    await settle(a)
    assert await keys(redis_client, prefix) == []


async def test_a_step_of_redis_wall_clock_frees_no_lease(redis_client: Any, prefix: str) -> None:
    shift_key = f"{prefix}:test_time_shift"
    other = shared_redis.client()
    a = RedisTokenAdmission(ShiftedTime(redis_client, shift_key), AdmissionSettings(), prefix=prefix, recheck_s=0.1)
    b = RedisTokenAdmission(
        ShiftedTime(other, shift_key), AdmissionSettings(wait_s=0.5), prefix=prefix, recheck_s=0.1
    )
    try:
        held = await a.acquire(E1, 100)
        await redis_client.set(shift_key, 3600)  # Redis's clock steps an hour forward (NTP, a restored VM)
        with pytest.raises(AdmissionTimeout):
            await b.acquire(E1, 10)  # b still sees a's tokens: the lease outlived the step
        assert await redis_client.zscore(f"{prefix}:leases", held.lease_id) is not None
        held.release()
        async with asyncio.timeout(3):
            (await b.acquire(E1, 10)).release()  # and a release still frees them at once
        await settle(a, b)
    finally:
        await other.aclose()
        await redis_client.delete(shift_key)
    assert await keys(redis_client, prefix) == []


async def test_a_step_back_of_redis_wall_clock_does_not_hold_a_crashed_holders_tokens(
    redis_client: Any, prefix: str
) -> None:
    shift_key = f"{prefix}:test_time_shift"
    shifted = ShiftedTime(redis_client, shift_key)
    crashed = RedisTokenAdmission(shifted, AdmissionSettings(), prefix=prefix, lease_ttl_s=0.3)
    lease = await crashed.acquire(E1, 100)
    crashed._renewers.pop(lease.lease_id).cancel()  # the process dies: no release, no renewal
    await redis_client.set(shift_key, -3600)  # then Redis's clock steps an hour back
    survivor = RedisTokenAdmission(shifted, AdmissionSettings(wait_s=5.0), prefix=prefix, recheck_s=0.1)
    try:
        async with asyncio.timeout(4):  # not an hour: the leases' clock went on from where it was
            async with await survivor.acquire(E1, 100):
                assert survivor.inflight_tokens() == {"e1": 100}
        await settle(survivor)
    finally:
        await redis_client.delete(shift_key)
    assert await keys(redis_client, prefix) == []


async def test_a_crashed_holders_lease_comes_back_after_it_expires(redis_client: Any, prefix: str) -> None:
    crashed = RedisTokenAdmission(redis_client, AdmissionSettings(), prefix=prefix, lease_ttl_s=0.3)
    lease = await crashed.acquire(E1, 100)
    crashed._renewers.pop(lease.lease_id).cancel()  # the process dies: no release, no renewal
    survivor = RedisTokenAdmission(redis_client, AdmissionSettings(wait_s=5.0), prefix=prefix, recheck_s=0.1)
    async with asyncio.timeout(4):
        async with await survivor.acquire(E1, 100):
            assert survivor.inflight_tokens() == {"e1": 100}
    await settle(survivor)
    assert await keys(redis_client, prefix) == []


async def test_the_queue_is_fifo_per_instance_across_processes_and_spares_other_instances(
    redis_client: Any, prefix: str
) -> None:
    other = shared_redis.client()
    a = RedisTokenAdmission(redis_client, AdmissionSettings(wait_s=5.0), prefix=prefix, recheck_s=0.2)
    b = RedisTokenAdmission(other, AdmissionSettings(wait_s=5.0), prefix=prefix, recheck_s=0.2)
    try:
        held = await a.acquire(E1, 100)
        first = asyncio.create_task(b.acquire(E1, 60))
        while await redis_client.zcard(f"{prefix}:queue:e1") < 1:
            await asyncio.sleep(0.01)
        second = asyncio.create_task(a.acquire(E1, 10))  # would fit before ``first``; must not overtake
        while await redis_client.zcard(f"{prefix}:queue:e1") < 2:
            await asyncio.sleep(0.01)
        async with asyncio.timeout(1):  # e2 is not stalled by e1's queue
            (await b.acquire(E2, 100)).release()
        await asyncio.sleep(0.5)  # a few re-checks: ``second`` still waits behind ``first``
        assert not first.done() and not second.done()
        held.release()
        async with asyncio.timeout(3):
            got_first = await first
            got_second = await second
        assert b.inflight_tokens() == {"e1": 60} and a.inflight_tokens() == {"e1": 10}
        got_first.release()
        got_second.release()
        await settle(a, b)
    finally:
        await other.aclose()
    assert await keys(redis_client, prefix) == []


async def test_prompts_reserved_together_fail_fast_with_redis(redis_client: Any, prefix: str) -> None:
    a = RedisTokenAdmission(redis_client, AdmissionSettings(wait_s=30.0), prefix=prefix)
    async with asyncio.timeout(5):
        group = LeaseGroup()
        first = await a.acquire(E1, 60, group)
        with pytest.raises(AdmissionUnavailable):
            await a.acquire(E1, 60, group)
        assert await redis_client.zcard(f"{prefix}:queue:e1") == 0
        first.release()
    await settle(a)
    assert await keys(redis_client, prefix) == []


async def test_redis_away_is_503_with_retry_after() -> None:
    import redis.asyncio

    gone = redis.asyncio.Redis.from_url("redis://127.0.0.1:1/14", socket_connect_timeout=0.5, socket_timeout=0.5)
    a = RedisTokenAdmission(gone, AdmissionSettings(retry_after_s=2), prefix="motor:test:gone")
    with pytest.raises(AdmissionUnavailable) as info:
        await a.acquire(E1, 10)
    assert info.value.status == 503 and info.value.retry_after_s == 2
    await settle(a)
    await gone.aclose()


async def test_a_waiter_held_only_by_the_global_budget_holds_back_later_requests_across_processes(
    redis_client: Any, prefix: str
) -> None:
    other = shared_redis.client()
    settings = AdmissionSettings(global_budget=150, wait_s=5.0)
    a = RedisTokenAdmission(redis_client, settings, prefix=prefix, recheck_s=0.2)
    b = RedisTokenAdmission(other, settings, prefix=prefix, recheck_s=0.2)
    try:
        big = await a.acquire(E1, 100)
        budget_bound = asyncio.create_task(b.acquire(E2, 80))  # e2 is empty; the budget is not
        while await redis_client.zcard(f"{prefix}:budget_queue") == 0:
            await asyncio.sleep(0.01)
        later = asyncio.create_task(a.acquire(E3, 10))  # fits the budget now, but must not starve it
        while await redis_client.zcard(f"{prefix}:queue:e3") == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # a few re-checks: both still wait
        assert not budget_bound.done() and not later.done()
        big.release()
        async with asyncio.timeout(3):
            first = await budget_bound
            second = await later
        assert b.inflight_tokens() == {"e2": 80} and a.inflight_tokens() == {"e3": 10}
        first.release()
        second.release()
        await settle(a, b)
    finally:
        await other.aclose()
    assert await keys(redis_client, prefix) == []
