"""Token admission in process: per-instance capacity, a global budget, a bounded FIFO queue per
instance with a deadline, prompts reserved together, and leases released exactly once (the Redis
implementation: test_redis_admission.py)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from serving.pipeline.errors import AdmissionTimeout, AdmissionUnavailable, QueueFull, RequestError
from serving.pipeline.flow_control.admission import (
    AdmissionSettings,
    Lease,
    LeaseGroup,
    TokenAdmission,
    admission_turn,
)
from serving.pipeline.snapshot import InstanceView
from tests.serving.fakes import instance

E1 = replace(instance("e1"), token_capacity=100)
E2 = replace(instance("e2"), token_capacity=100)
E3 = replace(instance("e2"), id=3, name="e3", token_capacity=100)


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
    # Every request was admitted: the six the test fails itself fail, no other raised anything.
    assert [type(r) for r in results] == [ValueError if i % 5 == 0 else type(None) for i in range(30)]
    assert adm.inflight_tokens() == {} and adm.waiting() == 0


async def test_it_refuses_a_non_positive_amount() -> None:
    adm = TokenAdmission()
    for amount in (0, -5, True):
        with pytest.raises(RequestError) as info:
            await adm.acquire(E1, amount)
        assert info.value.status == 400
    assert adm.inflight_tokens() == {} and adm.waiting() == 0
    async with await adm.acquire(E1, 100):  # capacity still applies: nothing went negative
        assert adm.has_room(E1, 1) is False


async def test_a_waiter_for_a_full_instance_does_not_stall_another_instance() -> None:
    adm = TokenAdmission()
    held = await adm.acquire(E1, 100)
    waiter = asyncio.create_task(adm.acquire(E1, 50))
    await asyncio.sleep(0)
    assert adm.waiting() == 1 and adm.has_room(E2, 10) and not adm.has_room(E1, 10)
    other = asyncio.create_task(adm.acquire(E2, 10))
    await asyncio.sleep(0)
    assert other.done()  # granted at once, not queued behind e1's waiter
    other.result().release()
    held.release()
    (await waiter).release()
    assert adm.inflight_tokens() == {} and adm.waiting() == 0


async def test_the_wake_loop_skips_a_head_that_does_not_fit_and_grants_another_instance() -> None:
    adm = TokenAdmission()
    on_e1, on_e2 = await adm.acquire(E1, 80), await adm.acquire(E2, 100)
    first = asyncio.create_task(adm.acquire(E1, 50))  # e1 stays too full for it
    second = asyncio.create_task(adm.acquire(E2, 50))
    third = asyncio.create_task(adm.acquire(E1, 10))  # fits e1, but FIFO behind ``first``
    await asyncio.sleep(0)
    on_e2.release()
    await asyncio.sleep(0)
    assert second.done() and not first.done() and not third.done()
    second.result().release()
    on_e1.release()
    for lease in (await first, await third):
        lease.release()
    assert adm.inflight_tokens() == {} and adm.waiting() == 0


async def test_a_waiter_held_only_by_the_global_budget_holds_back_later_requests() -> None:
    adm = TokenAdmission(AdmissionSettings(global_budget=150))
    big = await adm.acquire(E1, 100)
    budget_bound = asyncio.create_task(adm.acquire(E2, 80))  # e2 is empty; the budget is not
    await asyncio.sleep(0)
    later = asyncio.create_task(adm.acquire(E3, 10))  # would fit, but must not starve the first
    await asyncio.sleep(0)
    assert not budget_bound.done() and not later.done() and adm.waiting() == 2
    big.release()
    for lease in (await budget_bound, await later):
        lease.release()
    assert adm.inflight_tokens() == {} and adm.waiting() == 0


async def test_prompts_reserved_together_fail_fast_instead_of_waiting_on_themselves() -> None:
    adm = TokenAdmission(AdmissionSettings(wait_s=30.0, retry_after_s=2))
    async with asyncio.timeout(5):  # watchdog: waiting out wait_s would be the bug
        group = LeaseGroup()
        first = await adm.acquire(E1, 60, group)
        with pytest.raises(AdmissionUnavailable) as info:
            await adm.acquire(E1, 60, group)  # only this request's own first prompt is in the way
        assert info.value.status == 503 and info.value.retry_after_s == 2
        assert adm.waiting() == 0  # it never queued, so it stalled nobody
        second = await adm.acquire(E2, 60, group)  # what fits is still granted together
        first.release()
        second.release()
    assert adm.inflight_tokens() == {} and adm.waiting() == 0


async def test_a_request_holding_nothing_in_its_lease_group_may_still_wait() -> None:
    adm = TokenAdmission()
    other = await adm.acquire(E1, 100)
    waiting = asyncio.create_task(adm.acquire(E1, 60, LeaseGroup()))  # holds nothing yet: may wait its turn
    await asyncio.sleep(0)
    assert adm.waiting() == 1
    other.release()
    (await waiting).release()
    assert adm.inflight_tokens() == {} and adm.waiting() == 0


async def test_streams_opened_together_take_their_leases_one_at_a_time() -> None:
    # The prompts of a stream open concurrently. One waiting for a full instance must not let a
    # sibling hold another instance meanwhile: two such requests, each holding one instance and
    # waiting for the other's, would both wait out the deadline.
    adm = TokenAdmission(AdmissionSettings(wait_s=30.0))
    other = await adm.acquire(E1, 100)  # E1 is full
    granted: list[str] = []

    group = LeaseGroup()

    async def open_prompt(instance: InstanceView) -> Lease:
        async with admission_turn(group):
            lease = await adm.acquire(instance, 60, group)
        granted.append(instance.name)
        return lease

    async with asyncio.timeout(5):
        waiting = asyncio.create_task(open_prompt(E1))
        sibling = asyncio.create_task(open_prompt(E2))  # E2 has room, but it is not its turn
        for _ in range(10):
            await asyncio.sleep(0)
        assert adm.waiting() == 1 and granted == [] and adm.inflight_tokens() == {"e1": 100}
        other.release()
        leases = [await waiting, await sibling]
    assert granted == ["e1", "e2"]
    for lease in leases:
        lease.release()
    assert adm.inflight_tokens() == {} and adm.waiting() == 0
