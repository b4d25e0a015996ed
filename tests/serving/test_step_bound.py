"""``StepBound``: a per-step deadline of a stream on one timer, as ``asyncio.timeout`` per step would be.

The engine read's stall bound (``GuardedEvents``) and a chunk's derender bound
(``StreamingRenderSession``) use it: a stream of many short steps arms the loop's timer once,
not once per step (issue 32: about 35 k instructions a timer). The deadlines are what
``asyncio.timeout`` entered at each step's start would give.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from serving.pipeline.derender.session import StreamingRenderSession
from serving.pipeline.engine.leg import GuardedEvents
from serving.pipeline.errors import EngineError
from serving.pipeline.step_bound import StepBound


def count_timers(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The ``when`` of every timer the running loop arms from now on."""
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    call_at = loop.call_at

    def counted(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        armed.append(when)
        return call_at(when, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", counted)
    return armed


async def test_many_short_steps_arm_one_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    armed = count_timers(monkeypatch)
    bound = StepBound(60.0)
    for _ in range(50):
        async with bound:
            await asyncio.sleep(0)
    bound.close()
    assert len(armed) == 1


async def test_a_step_past_its_bound_raises_timeout_and_leaves_the_task_uncancelled() -> None:
    bound = StepBound(0.05)
    async with bound:  # a short step first: the deadline is the slow step's own start plus the bound
        await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        async with bound:
            await asyncio.sleep(30)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    async with bound:  # usable again
        await asyncio.sleep(0)
    bound.close()


async def test_steps_that_together_outlast_the_bound_each_within_it_pass() -> None:
    bound = StepBound(0.2)
    for _ in range(6):  # 0.3 s or more in all, 0.05 s a step
        async with bound:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.01)
    bound.close()


async def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    bound = StepBound(60.0)

    async def step() -> None:
        async with bound:
            await asyncio.sleep(30)

    task = asyncio.ensure_future(step())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    bound.close()


class _Guard:
    """What ``GuardedEvents`` asks of its guard: the boundary's inbound mapping, the breaker's ear."""

    def __init__(self) -> None:
        self.boundary = self
        self.failed: list[EngineError] = []

    def inbound_event(self, event: dict[str, Any], instance: Any) -> dict[str, Any]:
        return event

    def _failed_mid_stream(self, instance: Any, exc: EngineError) -> None:
        self.failed.append(exc)


class _Instance:
    name = "engine-1"


async def _events(count: int, stall_after: int | None = None) -> AsyncIterator[list[dict[str, Any]]]:
    for i in range(count):
        if i == stall_after:
            await asyncio.sleep(30)
        await asyncio.sleep(0)
        yield [{"i": i}]


async def test_guarded_events_arm_one_stall_timer_for_a_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    armed = count_timers(monkeypatch)
    events = GuardedEvents(cast(Any, _Guard()), _events(40), cast(Any, _Instance()), 60.0)
    got = [batch async for batch in events]
    await events.aclose()
    assert [b[0]["i"] for b in got] == list(range(40))
    assert len(armed) == 1  # asyncio.timeout per read armed 41


async def test_guarded_events_still_end_a_stalled_stream() -> None:
    guard = _Guard()
    events = GuardedEvents(cast(Any, guard), _events(10, stall_after=3), cast(Any, _Instance()), 0.05)
    got = []
    with pytest.raises(EngineError) as info:
        async for batch in events:
            got.append(batch)
    await events.aclose()
    assert len(got) == 3 and "sent nothing for 0.05s" in str(info.value)
    assert isinstance(info.value.__cause__, TimeoutError) and guard.failed == [info.value]


async def test_a_sessions_chunks_arm_one_bound_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.serving.test_streaming_session import PROMPT, FakeRender, event

    armed = count_timers(monkeypatch)
    session = StreamingRenderSession(cast(Any, FakeRender()), "chat", {"model": "tiny", "messages": []}, PROMPT,
                                     request_id="r1", public_id="chatcmpl-1")
    for token in range(30):
        session.commit(await session.derender(event(token)))
    assert len(armed) == 1  # asyncio.timeout per chunk armed 30
    session.release_bound()
