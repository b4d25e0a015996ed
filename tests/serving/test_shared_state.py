"""Shared live state through the real Redis on 127.0.0.1 (db 13): the tokens-per-minute window
across clients, and two separate OS processes sharing admission leases, a key's window and a
breaker, as two coordinator processes do with ``REDIS_URL``."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import ResponseError

from serving.pipeline.errors import AdmissionUnavailable, RequestError
from serving.pipeline.flow_control.admission import AdmissionSettings
from serving.pipeline.flow_control.rate_limit import KeyLimit, RedisTokenRateLimiter, TokenRateLimited
from serving.pipeline.flow_control.redis_admission import RedisTokenAdmission
from serving.pipeline.resilience.breaker import State
from serving.pipeline.resilience.shared_breaker import SharedBreakerBoard
from tests.serving import shared_redis
from tests.serving.fakes import instance
from tests.serving.shared_redis import ShiftedTime, keys, keys_but_clock

ROOT = Path(__file__).resolve().parents[2]
KEY = KeyLimit("d" * 64, "team-d", 100)
E1 = replace(instance("e1"), token_capacity=100)


async def test_the_tokens_per_minute_window_is_shared_between_clients(redis_client: Any, prefix: str) -> None:
    other = shared_redis.client()
    try:
        a = RedisTokenRateLimiter(redis_client, prefix=f"{prefix}:tpm")
        b = RedisTokenRateLimiter(other, prefix=f"{prefix}:tpm")
        await a.acharge(KEY, 60)
        assert await b.aused(KEY.key_id) == 60
        with pytest.raises(TokenRateLimited) as info:
            await b.acharge(KEY, 50)  # 110 > 100 across both
        assert info.value.status == 429 and 58 <= info.value.retry_after_s <= 60
        with pytest.raises(TokenRateLimited, match="Request too large"):
            await b.acharge(KEY, 101)
        await b.acharge(KEY, 40)
        assert await a.aused(KEY.key_id) == 100
    finally:
        await other.aclose()
    # Every key of the window expires on its own once idle (an idle key costs nothing); the
    # windows' clock, one small hash, stays.
    assert f"{prefix}:tpm:clock" in await keys(redis_client, prefix)
    for k in await keys_but_clock(redis_client, f"{prefix}:tpm"):
        assert 0 < await redis_client.pttl(k) <= 61_000


async def test_a_refund_in_the_shared_window_frees_exactly_its_charge_for_every_client(
    redis_client: Any, prefix: str
) -> None:
    other = shared_redis.client()
    try:
        a = RedisTokenRateLimiter(redis_client, prefix=f"{prefix}:tpm")
        b = RedisTokenRateLimiter(other, prefix=f"{prefix}:tpm")
        await a.acharge(KEY, 60, "first")
        await a.acharge(KEY, 30, "second")
        await b.arefund(KEY, "first")  # another process refunds what this one charged
        await b.arefund(KEY, "first")  # twice: nothing more
        await b.arefund(KEY, "never-charged")
        assert await a.aused(KEY.key_id) == 30
        await b.acharge(KEY, 70)  # the room the refund freed
        with pytest.raises(TokenRateLimited):
            await a.acharge(KEY, 1)
        await a.arefund(KEY, "second")
        assert await b.aused(KEY.key_id) == 70
    finally:
        await other.aclose()


async def test_the_shared_window_refuses_a_non_positive_amount_and_uses_redis_clock(
    redis_client: Any, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    limiter = RedisTokenRateLimiter(redis_client, prefix=f"{prefix}:tpm", window_s=0.5)
    for amount in (0, -7):
        with pytest.raises(RequestError):
            await limiter.acharge(KEY, amount)
    with pytest.raises(ResponseError, match="positive integer"):
        await limiter._charge(keys=limiter._keys(KEY.key_id), args=[500, "x", -7, 100])
    assert await keys_but_clock(redis_client, f"{prefix}:tpm") == []
    monkeypatch.setattr(time, "time", lambda: 0.0)  # this process's wall clock plays no part
    await limiter.acharge(KEY, 100)
    await asyncio.sleep(0.6)  # the window slides on Redis's clock
    await limiter.acharge(KEY, 100)
    assert await limiter.aused(KEY.key_id) == 100


async def test_a_step_back_of_redis_wall_clock_keeps_no_charge_in_the_window(redis_client: Any, prefix: str) -> None:
    shift_key = f"{prefix}:test_time_shift"
    limiter = RedisTokenRateLimiter(ShiftedTime(redis_client, shift_key), prefix=f"{prefix}:tpm", window_s=1.0)
    try:
        await limiter.acharge(KEY, 100)
        await redis_client.set(shift_key, -3600)  # Redis's clock steps an hour back
        with pytest.raises(TokenRateLimited) as info:
            await limiter.acharge(KEY, 10)
        assert info.value.retry_after_s == 1  # the window's second, not an hour and a second
        async with asyncio.timeout(5):  # and a second later the key may spend its limit again
            while True:
                try:
                    await limiter.acharge(KEY, 100)
                    break
                except TokenRateLimited:
                    await asyncio.sleep(0.1)
    finally:
        await redis_client.delete(shift_key)


async def test_a_step_forward_of_redis_wall_clock_frees_no_more_than_one_window(redis_client: Any, prefix: str) -> None:
    shift_key = f"{prefix}:test_time_shift"
    limiter = RedisTokenRateLimiter(ShiftedTime(redis_client, shift_key), prefix=f"{prefix}:tpm")
    try:
        await limiter.acharge(KEY, 100)
        await redis_client.set(shift_key, 3600)  # an hour forward: the window empties, as after an idle minute
        await limiter.acharge(KEY, 100)
        with pytest.raises(TokenRateLimited) as info:  # but the minute after the step counts in full
            await limiter.acharge(KEY, 10)
        assert 58 <= info.value.retry_after_s <= 60
    finally:
        await redis_client.delete(shift_key)


async def test_the_shared_window_answers_503_when_redis_is_away() -> None:
    import redis.asyncio

    gone = redis.asyncio.Redis.from_url("redis://127.0.0.1:1/14", socket_connect_timeout=0.5, socket_timeout=0.5)
    with pytest.raises(AdmissionUnavailable) as info:
        await RedisTokenRateLimiter(gone, retry_after_s=2).acharge(KEY, 10)
    assert info.value.status == 503 and info.value.retry_after_s == 2
    await gone.aclose()


# The other coordinator process: holds a lease, charges the key and trips the breaker, then
# releases its lease when told to.
CHILD = textwrap.dedent("""
    import asyncio, sys
    from dataclasses import replace
    import redis.asyncio
    from serving.pipeline.flow_control.admission import AdmissionSettings
    from serving.pipeline.flow_control.rate_limit import KeyLimit, RedisTokenRateLimiter
    from serving.pipeline.flow_control.redis_admission import RedisTokenAdmission
    from serving.pipeline.resilience.shared_breaker import SharedBreakerBoard
    from tests.serving.fakes import instance

    async def main(url, prefix):
        client = redis.asyncio.Redis.from_url(url)
        e1 = replace(instance("e1"), token_capacity=100)
        admission = RedisTokenAdmission(client, AdmissionSettings(), prefix=prefix + ":admission")
        lease = await admission.acquire(e1, 80)
        await RedisTokenRateLimiter(client, prefix=prefix + ":tpm").acharge(KeyLimit("d" * 64, "team-d", 100), 60)
        board = SharedBreakerBoard(client, prefix=prefix + ":breaker")
        for _ in range(3):
            board.failure(e1, "boom")
        await board.flush()
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        lease.release()
        await admission.aclose()
        await client.aclose()
        print("released", flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")


async def test_two_processes_share_leases_the_tokens_per_minute_window_and_breakers(
    redis_client: Any, prefix: str
) -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, shared_redis.DB_URL, prefix, cwd=ROOT,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdin is not None and child.stdout is not None
    admission = RedisTokenAdmission(redis_client, AdmissionSettings(wait_s=10), prefix=f"{prefix}:admission", recheck_s=30)
    try:
        async with asyncio.timeout(30):
            assert (await child.stdout.readline()).strip() == b"ready"
            # Leases: the other process holds 80 of e1's 100 tokens.
            waiter = asyncio.create_task(admission.acquire(E1, 50))
            while await redis_client.zcard(f"{prefix}:admission:queue:e1") == 0:
                await asyncio.sleep(0.01)
            # Tokens per minute: the other process charged 60 of the key's 100.
            with pytest.raises(TokenRateLimited):
                await RedisTokenRateLimiter(redis_client, prefix=f"{prefix}:tpm").acharge(KEY, 50)
            # Breakers: the other process tripped e1's.
            board = SharedBreakerBoard(redis_client, prefix=f"{prefix}:breaker")
            board.allows(E1)
            await board.flush()
            assert board.state(E1) is State.OPEN and not board.begin(E1)
            assert not waiter.done()
            child.stdin.write(b"release\n")
            await child.stdin.drain()
            assert (await child.stdout.readline()).strip() == b"released"
            lease = await waiter  # woken by the other process's release
            assert admission.inflight_tokens() == {"e1": 50}
            lease.release()
            await admission.aclose()
            assert await child.wait() == 0
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    # No lease or waiter left (the leases' clock, one small hash, stays).
    assert [k for k in await keys(redis_client, prefix) if ":admission:" in k] == [f"{prefix}:admission:clock"]
    assert admission.inflight_tokens() == {} and admission.waiting() == 0
