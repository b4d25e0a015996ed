"""Circuit breaker transitions, table-driven (after Saleor's breaker_board tests), on a fake clock."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from serving.pipeline.resilience.breaker import BreakerBoard, State
from tests.serving.fakes import instance

E1 = instance("e1")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def board(clock: Clock, sink: list[tuple[Any, ...]] | None = None) -> BreakerBoard:
    record = (lambda *args: sink.append(args)) if sink is not None else None
    return BreakerBoard(threshold=3, base_open_s=10, max_open_s=35, clock=clock, wall=lambda: 5000.0, sink=record)


# Each step: (action, expected state after it). Actions: "ok" (a request succeeds), "fail" (an
# engine fault), "wait N" (the clock moves N seconds), "begin" / "begin-refused" (claim a request).
TABLE = {
    "two failures stay closed": [("fail", "closed"), ("fail", "closed"), ("ok", "closed"), ("fail", "closed")],
    "three consecutive failures open": [("fail", "closed"), ("fail", "closed"), ("fail", "open")],
    "open refuses until its time passed": [
        ("fail", "closed"), ("fail", "closed"), ("fail", "open"), ("begin-refused", "open"),
        ("wait 9", "open"), ("begin-refused", "open"), ("wait 1", "half_open"),
    ],
    "one half-open trial, success closes": [
        ("fail", "closed"), ("fail", "closed"), ("fail", "open"), ("wait 10", "half_open"),
        ("begin", "half_open"), ("begin-refused", "half_open"), ("ok", "closed"), ("begin", "closed"),
    ],
    "failed trial reopens with doubled time, capped": [
        ("fail", "closed"), ("fail", "closed"), ("fail", "open"), ("wait 10", "half_open"),
        ("begin", "half_open"), ("fail", "open"), ("wait 19", "open"), ("wait 1", "half_open"),
        ("begin", "half_open"), ("fail", "open"), ("wait 34", "open"), ("wait 1", "half_open"),  # 40 -> cap 35
    ],
}


@pytest.mark.parametrize("steps", TABLE.values(), ids=TABLE.keys())
def test_breaker_transitions(steps: list[tuple[str, str]]) -> None:
    clock = Clock()
    b = board(clock)
    for action, expected in steps:
        if action == "ok":
            b.success(E1)
        elif action == "fail":
            b.failure(E1, "boom")
        elif action.startswith("wait"):
            clock.now += float(action.split()[1])
        elif action == "begin":
            assert b.begin(E1), action
        elif action == "begin-refused":
            assert not b.begin(E1), action
        assert b.state(E1).value == expected, (action, expected)


def test_every_transition_reaches_the_sink_with_wall_clock_open_until() -> None:
    clock, sink = Clock(), []
    b = board(clock, sink)
    for _ in range(3):
        b.failure(E1, "connect refused")
    clock.now += 10
    assert b.begin(E1)
    b.success(E1)
    assert sink == [
        (E1.id, "open", "connect refused", 3, 5010.0, 10, 0),
        (E1.id, "half_open", "open time passed", 3, None, 10, 0),
        (E1.id, "closed", "trial succeeded", 0, None, 0.0, 0),
    ]


def test_a_released_trial_lets_the_next_request_try() -> None:
    clock = Clock()
    b = board(clock)
    for _ in range(3):
        b.failure(E1, "x")
    clock.now += 10
    assert b.begin(E1) and not b.allows(E1)
    b.release(E1)  # the trial ended with a 4xx: no verdict on the engine
    assert b.allows(E1) and b.state(E1) is State.HALF_OPEN


async def test_in_one_process_concurrent_claims_send_one_half_open_trial() -> None:
    import asyncio

    clock = Clock()
    b = board(clock)
    for _ in range(3):
        b.failure(E1, "x")
    assert not await b.claim(E1)
    clock.now += 10
    assert await asyncio.gather(*(b.claim(E1) for _ in range(5))) == [True, False, False, False, False]
    b.failure(E1, "trial failed")
    assert b.state(E1) is State.OPEN and not await b.claim(E1)
    clock.now += 20  # the doubled open time
    assert await b.claim(E1) and not await b.claim(E1)
    b.success(E1)
    assert all(await asyncio.gather(*(b.claim(E1) for _ in range(3))))  # closed: no trial to claim


def test_a_higher_epoch_from_an_operator_is_adopted() -> None:
    clock = Clock()
    b = board(clock)
    for _ in range(3):
        b.failure(E1, "x")
    assert not b.allows(E1)
    reset = replace(E1, breaker_state="closed", breaker_epoch=1)
    assert b.allows(reset) and b.state(reset) is State.CLOSED
    forced = replace(E1, breaker_state="open", breaker_epoch=2)
    assert not b.allows(forced) and b.state(forced) is State.OPEN
    assert not b.allows(replace(forced, breaker_state="closed"))  # same epoch: a stale write-back is ignored


def test_an_instance_first_seen_open_starts_open() -> None:
    b = board(Clock())
    assert not b.allows(replace(E1, breaker_state="open", breaker_epoch=4))


def test_the_sink_gets_the_operator_epoch_the_breaker_adopted() -> None:
    sink: list[tuple[Any, ...]] = []
    b = board(Clock(), sink)
    reset = replace(E1, breaker_state="closed", breaker_epoch=4)
    for _ in range(3):
        b.failure(reset, "boom")
    assert sink[-1][0:2] == (E1.id, "open") and sink[-1][-1] == 4  # the write-back is compared with it


def test_a_failing_sink_never_breaks_the_request() -> None:
    def broken(*_: Any) -> None:
        raise RuntimeError("database down")

    b = BreakerBoard(threshold=1, sink=broken)
    b.failure(E1, "x")
    assert b.state(E1) is State.OPEN
