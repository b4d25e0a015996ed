"""Circuit breakers shared through the real Redis on 127.0.0.1 (db 13): one threshold and one
state for every process, operator overrides that win, open times and trial claims on a clock in
Redis that a step of Redis's wall clock does not move, trial releases that survive Redis being
away, and the local board as the fallback while Redis is away. Two independent clients stand for
two processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from serving.pipeline.resilience.breaker import State
from serving.pipeline.resilience.shared_breaker import SharedBreakerBoard
from tests.serving import shared_redis
from tests.serving.fakes import instance
from tests.serving.shared_redis import RedisGate, ShiftedTime
from tests.serving.shared_redis import keys_but_clock as keys

E1 = instance("e1")


class Sink:
    def __init__(self) -> None:
        self.flips: list[tuple[int, str]] = []

    def __call__(self, instance_id: int, new_state: str, *rest: Any) -> None:
        self.flips.append((instance_id, new_state))


@pytest.fixture
async def two(redis_client: Any, prefix: str) -> AsyncIterator[tuple[SharedBreakerBoard, SharedBreakerBoard, Sink, Sink]]:
    other = shared_redis.client()
    before = asyncio.all_tasks()
    sink_a, sink_b = Sink(), Sink()
    a = SharedBreakerBoard(redis_client, prefix=prefix, refresh_s=0, threshold=3, base_open_s=0.3, sink=sink_a)
    b = SharedBreakerBoard(other, prefix=prefix, refresh_s=0, threshold=3, base_open_s=0.3, sink=sink_b)
    yield a, b, sink_a, sink_b
    await a.flush()
    await b.flush()
    await other.aclose()
    assert asyncio.all_tasks() - before - {asyncio.current_task()} == set()  # no worker left behind
    assert await keys(redis_client, prefix) in ([], [f"{prefix}:{E1.id}"])  # only the breaker's own hash


async def synced(*boards: SharedBreakerBoard) -> None:
    for board in boards:
        board.allows(E1)  # a re-read (refresh_s=0)
        await board.flush()


async def test_a_breaker_one_process_opens_keeps_the_other_away(two: Any) -> None:
    a, b, sink_a, sink_b = two
    for _ in range(3):
        a.failure(E1, "boom")
    await a.flush()
    assert a.state(E1) is State.OPEN
    assert b.allows(E1)  # b has not heard yet...
    await synced(b)
    assert not b.allows(E1) and not b.begin(E1)  # ...now it has
    assert sink_a.flips == [(E1.id, "open")] and sink_b.flips == []  # written back once


async def test_failures_in_two_processes_count_toward_one_threshold(two: Any) -> None:
    a, b, sink_a, sink_b = two
    a.failure(E1, "boom")
    a.failure(E1, "boom")
    await a.flush()
    b.failure(E1, "boom")  # b's first failure is the fleet's third
    await b.flush()
    await synced(a)
    assert a.state(E1) is State.OPEN and b.state(E1) is State.OPEN
    assert sink_b.flips == [(E1.id, "open")] and sink_a.flips == []


async def test_the_open_time_passes_on_redis_clock_and_one_trial_closes_it_everywhere(two: Any) -> None:
    a, b, sink_a, sink_b = two
    for _ in range(3):
        a.failure(E1, "boom")
    await a.flush()
    await asyncio.sleep(0.4)  # base_open_s is 0.3
    await synced(b)
    assert b.state(E1) is State.HALF_OPEN and b.begin(E1)
    b.success(E1)
    await b.flush()
    await synced(a)
    assert a.state(E1) is State.CLOSED and a.allows(E1)
    assert sink_b.flips == [(E1.id, "closed")]


async def test_operator_overrides_win_over_shared_state(two: Any) -> None:
    a, b, _, _ = two
    for _ in range(3):
        a.failure(E1, "boom")
    await a.flush()
    reset = replace(E1, breaker_state="closed", breaker_epoch=1)  # the operator reset it
    assert b.allows(reset)  # b's snapshot already has the reset: adopted and written with its epoch
    await b.flush()
    a.failure(E1, "boom")  # a's verdict from before it saw the reset: ignored by the script
    await a.flush()
    assert a.state(E1) is State.CLOSED and a.allows(E1)  # and a took the operator's state from Redis
    await synced(b)
    assert b._breakers[E1.id].failures == 0
    forced = replace(E1, breaker_state="open", breaker_epoch=2)  # then forced it open
    assert not a.allows(forced)
    await a.flush()
    await synced(b)
    assert b.state(E1) is State.OPEN


async def test_without_redis_the_board_falls_back_to_its_local_state_machine() -> None:
    import redis.asyncio

    gone = redis.asyncio.Redis.from_url("redis://127.0.0.1:1/14", socket_connect_timeout=0.5, socket_timeout=0.5)
    sink = Sink()
    board = SharedBreakerBoard(gone, prefix="motor:test:gone", threshold=3, sink=sink)
    for _ in range(3):
        board.failure(E1, "boom")
    await board.flush()
    assert board.state(E1) is State.OPEN and not board.begin(E1)
    assert sink.flips == [(E1.id, "open")]  # its own flip, reported as a per-process board does
    await gone.aclose()


async def test_a_success_on_a_healthy_breaker_costs_no_redis_call(two: Any) -> None:
    a, _, _, _ = two
    a.refresh_s = 3600  # no re-reads either: count the verdicts alone
    calls: list[Any] = []
    script = a._script

    async def counted(**kwargs: Any) -> Any:
        calls.append(kwargs["args"][0])
        return await script(**kwargs)

    a._script = counted  # type: ignore[method-assign]
    a.allows(E1)  # the first sight reads once
    await a.flush()
    for _ in range(5):
        a.success(E1)
    await a.flush()
    assert calls == ["read"]
    a.failure(E1, "boom")
    a.success(E1)  # this one resets a counted failure: Redis must hear it
    await a.flush()
    assert calls == ["read", "failure", "success"]


async def tripped_and_waited(two: Any) -> None:
    """Trip E1 through ``a`` and let its open time (0.3 s on Redis's clock) pass; both see half-open."""
    a, b, _, _ = two
    for _ in range(3):
        a.failure(E1, "boom")
    await a.flush()
    await asyncio.sleep(0.4)
    await synced(a, b)
    assert a.state(E1) is State.HALF_OPEN and b.state(E1) is State.HALF_OPEN


async def test_processes_send_one_half_open_trial_between_them(two: Any, redis_client: Any, prefix: str) -> None:
    a, b, _, _ = two
    await tripped_and_waited(two)
    won = await asyncio.gather(a.claim(E1), b.claim(E1), a.claim(E1), b.claim(E1))
    assert sorted(won) == [False, False, False, True]
    winner, loser = (a, b) if won[0] else (b, a)
    assert not await loser.claim(E1)  # still held by the other's trial
    assert f"{prefix}:{E1.id}:trial" in await keys(redis_client, prefix)

    winner.failure(E1, "trial failed")  # open again, time doubled: nobody tries before it passes
    await winner.flush()
    assert await keys(redis_client, prefix) == [f"{prefix}:{E1.id}"]  # the claim went with the verdict
    await synced(loser)
    assert loser.state(E1) is State.OPEN and not await loser.claim(E1)

    await asyncio.sleep(0.7)
    await synced(a, b)
    won = await asyncio.gather(b.claim(E1), a.claim(E1))
    assert sorted(won) == [False, True]
    winner = b if won[0] else a
    winner.success(E1)
    await winner.flush()
    await synced(a, b)
    assert a.state(E1) is State.CLOSED and b.state(E1) is State.CLOSED
    assert await a.claim(E1) and await b.claim(E1)  # closed: both send, no claim taken
    a.success(E1)
    b.success(E1)


async def test_a_released_trial_claim_lets_another_process_try(two: Any, redis_client: Any, prefix: str) -> None:
    a, b, _, _ = two
    await tripped_and_waited(two)
    assert await a.claim(E1) and not await b.claim(E1)
    a.release(E1)  # the trial ended without a verdict on the engine (a 4xx, cancelled)
    await a.flush()
    assert await b.claim(E1) and not await a.claim(E1)
    b.success(E1)
    await b.flush()
    assert await keys(redis_client, prefix) == [f"{prefix}:{E1.id}"]


async def test_a_dead_processes_trial_claim_expires(two: Any, redis_client: Any, prefix: str) -> None:
    a, b, _, _ = two
    a.trial_claim_s = 0.2
    await tripped_and_waited(two)
    assert await a.claim(E1) and not await b.claim(E1)  # a "dies" here: no verdict ever comes
    await asyncio.sleep(0.3)
    assert await b.claim(E1)
    a.release(E1)  # a's late end does not delete b's claim: the key holds b's token now
    await a.flush()
    assert f"{prefix}:{E1.id}:trial" in await keys(redis_client, prefix)
    b.success(E1)
    await b.flush()
    assert await keys(redis_client, prefix) == [f"{prefix}:{E1.id}"]


async def test_without_redis_the_trial_is_claimed_per_process() -> None:
    import redis.asyncio

    gone = redis.asyncio.Redis.from_url("redis://127.0.0.1:1/14", socket_connect_timeout=0.5, socket_timeout=0.5)
    now = [1000.0]
    board = SharedBreakerBoard(gone, prefix="motor:test:gone", threshold=3, base_open_s=5, clock=lambda: now[0])
    for _ in range(3):
        board.failure(E1, "boom")
    await board.flush()
    now[0] += 5
    assert await board.claim(E1) and not await board.claim(E1)  # the local slot: one per process
    board.success(E1)
    await board.flush()
    assert board.state(E1) is State.CLOSED
    await gone.aclose()


async def test_a_full_queue_never_drops_a_trial_release(two: Any, redis_client: Any, prefix: str) -> None:
    a, b, _, _ = two
    await tripped_and_waited(two)
    # A third process whose queue to Redis holds two ops, and Redis slower than its verdicts: every
    # op below is queued before its worker runs once.
    c = SharedBreakerBoard(redis_client, prefix=prefix, refresh_s=0, threshold=3, base_open_s=0.3, max_pending=2)
    await synced(c)
    assert await c.claim(E1) and not await a.claim(E1) and not await b.claim(E1)
    c.release(E1)  # the trial ended without a verdict (a 4xx, cancelled): its claim must go
    for n in range(5):
        c.allows(replace(E1, id=100 + n, name=f"x{n}"))  # re-reads of other instances fill the queue
    assert [op.kind for op in c._ops] == ["unclaim", "read"]  # the bound holds; the re-reads gave way
    await c.flush()
    assert await keys(redis_client, prefix) == [f"{prefix}:{E1.id}"]  # the claim is gone...
    assert await b.claim(E1)  # ...so another process sends the trial now, not in 600 s
    b.success(E1)


async def test_a_step_forward_of_redis_wall_clock_does_not_end_an_open_period(redis_client: Any, prefix: str) -> None:
    shift_key = f"{prefix}:test_time_shift"
    other = shared_redis.client()
    a = SharedBreakerBoard(ShiftedTime(redis_client, shift_key), prefix=prefix, refresh_s=0, base_open_s=60)
    b = SharedBreakerBoard(ShiftedTime(other, shift_key), prefix=prefix, refresh_s=0, base_open_s=60)
    try:
        for _ in range(3):
            a.failure(E1, "boom")
        await a.flush()
        await redis_client.set(shift_key, 3600)  # Redis's clock steps an hour forward
        await synced(b)
        # Still open for about its minute, everywhere: no trial is sent to the failing engine.
        assert b.state(E1) is State.OPEN and not await b.claim(E1)
        assert 58 <= b._breakers[E1.id].open_until - b._clock() <= 60
    finally:
        await a.aclose()
        await b.aclose()
        await other.aclose()
        await redis_client.delete(shift_key)


async def test_a_step_back_of_redis_wall_clock_does_not_hold_an_open_period(redis_client: Any, prefix: str) -> None:
    shift_key = f"{prefix}:test_time_shift"
    other = shared_redis.client()
    a = SharedBreakerBoard(ShiftedTime(redis_client, shift_key), prefix=prefix, refresh_s=0, base_open_s=0.3)
    b = SharedBreakerBoard(ShiftedTime(other, shift_key), prefix=prefix, refresh_s=0, base_open_s=0.3)
    try:
        for _ in range(3):
            a.failure(E1, "boom")
        await a.flush()
        await redis_client.set(shift_key, -3600)  # Redis's clock steps an hour back
        await synced(b)  # (the clock stands still across the step: it goes on from here)
        await asyncio.sleep(0.4)
        await synced(b)
        assert b.state(E1) is State.HALF_OPEN  # after its 0.3 s, not an hour
        assert await b.claim(E1)
        b.success(E1)
    finally:
        await a.aclose()
        await b.aclose()
        await other.aclose()
        await redis_client.delete(shift_key)


async def test_a_step_forward_of_redis_wall_clock_does_not_end_a_live_trials_claim(
    redis_client: Any, prefix: str
) -> None:
    # (SET PX kept the claim on Redis's own key expiry, which ShiftedTime cannot move: this pins
    # that the claim now lives on the breakers' clock rather than replaying main's failure.)
    shift_key = f"{prefix}:test_time_shift"
    other = shared_redis.client()
    a = SharedBreakerBoard(ShiftedTime(redis_client, shift_key), prefix=prefix, refresh_s=0, base_open_s=0.3)
    b = SharedBreakerBoard(ShiftedTime(other, shift_key), prefix=prefix, refresh_s=0, base_open_s=0.3)
    try:
        await tripped_and_waited((a, b, None, None))
        assert await a.claim(E1)
        await redis_client.set(shift_key, 3600)  # an hour forward while a's trial runs (claim: 600 s)
        assert not await b.claim(E1)  # one trial, still
        a.success(E1)
        await a.flush()
        assert f"{prefix}:{E1.id}:trial" not in await keys(redis_client, prefix)  # the verdict released it
    finally:
        await a.aclose()
        await b.aclose()
        await other.aclose()
        await redis_client.delete(shift_key)


async def test_a_trial_release_that_meets_redis_away_is_sent_again_when_it_is_back(
    two: Any, redis_client: Any, prefix: str
) -> None:
    a, b, _, _ = two
    await tripped_and_waited(two)
    async with RedisGate() as gate:
        through_gate = gate.client()
        c = SharedBreakerBoard(through_gate, prefix=prefix, refresh_s=0, base_open_s=0.3)
        c.release_retry_s = 0.05  # the first retry's delay (then doubling)
        await synced(c)
        assert await c.claim(E1) and not await b.claim(E1)
        gate.shut()  # Redis unreachable from c just as its trial ends without a verdict
        c.release(E1)
        await c.flush()
        assert f"{prefix}:{E1.id}:trial" in await keys(redis_client, prefix)  # the release failed...
        assert not await b.claim(E1)
        gate.open()
        async with asyncio.timeout(5):  # ...and is sent again once Redis answers, not in 600 s
            while f"{prefix}:{E1.id}:trial" in await keys(redis_client, prefix):
                await asyncio.sleep(0.05)
        assert await b.claim(E1)
        b.success(E1)
        await c.aclose()
        assert c._unreleased == {} and c._retrier is None
        await through_gate.aclose()


async def test_a_trial_claim_of_the_previous_version_holds_until_it_expires(two: Any, redis_client: Any, prefix: str) -> None:
    a, b, _, _ = two
    await tripped_and_waited(two)
    # A process not yet upgraded claimed the trial as it did (SET NX PX), and is still running it.
    await redis_client.set(f"{prefix}:{E1.id}:trial", "old-process", nx=True, px=300)
    assert not await a.claim(E1)  # held: not a Redis error, so not a local trial either
    await asyncio.sleep(0.4)  # Redis expired it (the old process died mid-trial)
    assert await a.claim(E1)
    a.success(E1)
