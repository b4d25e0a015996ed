"""The pool's window of streaming derender calls (serving/pipeline/render/window.py).

A burst of streams larger than what one sidecar answers within the render config's
``timeout_ms`` must not fail any of them: the calls past the window wait in the coordinator,
where the deadline has not started, instead of in the sidecar's queue, where it has (issue 32:
at 256 streams on the simulated fleet, first chunks failed with 504 after 5 s in one sidecar's
queue). The fake sidecar answers one derender call at a time, as a saturated one does."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from serving.pipeline.render.pool import PoolState, RenderPool
from serving.pipeline.render.window import CALLS_PER_SIDECAR, Window
from serving.pipeline.service import EventStream
from tests.serving.fakes import StreamPlan
from tests.serving.router_fakes import Rig, chat_body, engine, snapshot_with
from tests.serving.test_render_pool import POOL, pipeline

# One call at a time, this long each: STREAMS first chunks take STREAMS * SERVICE_S in the
# sidecar's queue, twice the deadline; a window's worth takes under a third of it (the rest of the
# deadline is room for this process's own event loop, which serves all the streams too).
SERVICE_S = 0.05
STREAMS = 120
DEADLINE_S = 3.0


async def outcome(stream: EventStream) -> str:
    """"ok", or the first error a client read in the stream."""
    async for frame in stream.frames():
        for line in frame.decode().splitlines():
            if line.startswith("data: {") and "error" in (chunk := json.loads(line[6:])):
                return str(chunk["error"].get("code"))
    return "ok"


async def test_a_burst_of_streams_past_what_one_sidecar_answers_in_time_fails_none(rig: Rig) -> None:
    assert STREAMS * SERVICE_S >= 2 * DEADLINE_S and CALLS_PER_SIDECAR * SERVICE_S <= DEADLINE_S / 3
    rig.upstreams.default_plan = StreamPlan(tokens=1)
    worker = asyncio.Lock()  # FIFO: the sidecar's one busy worker
    in_sidecar = most = 0

    async def saturated(request: httpx.Request, body: Any) -> httpx.Response:
        nonlocal in_sidecar, most
        in_sidecar += 1
        most = max(most, in_sidecar)
        try:
            async with worker:
                await asyncio.sleep(SERVICE_S)
                return rig.upstreams._derender(request, body)
        finally:
            in_sidecar -= 1

    rig.upstreams.override("render", "derender", saturated)
    state = PoolState()
    snapshot = snapshot_with(engine("e1"), engine("e2"), members=POOL[:1], base_url=POOL[0].base_url,
                             timeout_s=DEADLINE_S)
    serving = pipeline(rig, snapshot, state)
    pool = serving.render
    assert isinstance(pool, RenderPool) and pool.timeout_s == DEADLINE_S
    # Opened a few at a time (their renders share the deadline and are not what is tested), then
    # read all at once: every stream's first derender call comes in one burst.
    streams: list[EventStream] = []
    for first in range(0, STREAMS, 10):
        streams += await asyncio.gather(*(serving.chat(chat_body(stream=True, max_tokens=1), f"b{i}")
                                          for i in range(first, first + 10)))
    outcomes = await asyncio.gather(*(outcome(s) for s in streams))
    assert outcomes.count("ok") == STREAMS, sorted(set(outcomes))
    assert most <= CALLS_PER_SIDECAR  # the sidecar never held more than the window
    window = state.windows.of(pool.base_urls)
    assert window.held == 0 and window.waiting == 0


async def test_the_window_lets_its_size_in_and_the_rest_in_arrival_order() -> None:
    window = Window(2)
    order: list[int] = []
    release = asyncio.Event()

    async def hold(i: int) -> None:
        async with window.slot():
            order.append(i)
            await release.wait()

    tasks = [asyncio.create_task(hold(i)) for i in range(5)]
    await asyncio.sleep(0)
    assert order == [0, 1] and window.held == 2 and window.waiting == 3
    tasks[2].cancel()  # a waiter that leaves gives up its place, not a slot
    release.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [0, 1, 3, 4] and window.held == 0 and window.waiting == 0


async def test_a_waiter_cancelled_after_its_turn_came_passes_the_turn_on() -> None:
    window = Window(1)
    go = asyncio.Event()
    entered: list[str] = []

    async def hold(name: str) -> None:
        async with window.slot():
            entered.append(name)
            await go.wait()

    async def first() -> None:
        await hold("a")
        b.cancel()  # the release just handed the slot to b, which has not run yet

    a = asyncio.create_task(first())
    await asyncio.sleep(0)
    b = asyncio.create_task(hold("b"))
    c = asyncio.create_task(hold("c"))
    await asyncio.sleep(0)
    assert window.waiting == 2
    go.set()
    await asyncio.gather(a, b, c, return_exceptions=True)
    assert entered == ["a", "c"] and b.cancelled() and window.held == 0


@pytest.mark.parametrize("size", [0, 1])
def test_a_window_holds_at_least_one(size: int) -> None:
    assert Window(size).size == 1
