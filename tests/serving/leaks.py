"""The one leak check of the data-plane tests: nothing held, nothing open, no task left behind.

Used by the fixtures that end every pipeline, relay and router test (``test_pipeline.py``,
``test_relay.py``, ``router_fakes.assert_no_leaks``).
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from serving.pipeline.placement.scheduler import Scheduler
from tests.serving.loopback import fake_side_tasks


def _is_asyncgen_finalizer(task: asyncio.Task[Any]) -> bool:
    # The loop closes a dropped, suspended async generator in a task of its own. httpx's nested
    # aiter_lines/aiter_text/aiter_raw generators end up there after iter_event_batches stops at [DONE].
    return type(task.get_coro()).__name__ == "async_generator_athrow"


async def assert_nothing_held(
    scheduler: Scheduler, before: set[asyncio.Task[Any]], *open_streams: set[Any]
) -> None:
    """Assert no load, no admitted tokens or waiters, every given stream set empty, no stray task.

    ``before`` is ``asyncio.all_tasks()`` from the start of the test. Raises AssertionError.
    """
    assert scheduler.load.snapshot() == {}
    assert scheduler.admission.inflight_tokens() == {}  # every lease released
    assert scheduler.admission.waiting() == 0
    for streams in open_streams:
        assert streams == set()  # every upstream stream closed
    gc.collect(1)  # young cyclic garbage (dropped generators) is finalized now, inside this test
    stray: set[asyncio.Task[Any]] = set()
    for _ in range(20):  # bounded loop turns (no wall clock) for finalizers to finish
        stray = asyncio.all_tasks() - before - {asyncio.current_task()} - fake_side_tasks()  # type: ignore[operator]
        if not stray or not all(_is_asyncgen_finalizer(t) for t in stray):
            break
        await asyncio.sleep(0)
    assert not stray, stray  # a producer, an orphaned generate or a hung close is a leak
