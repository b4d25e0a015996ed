"""Fan-in of sub-streams that live and die together (vLLM's ``merge_async_iterators``).

Producers run under one ``asyncio.TaskGroup`` and feed a bounded queue, so a slow reader makes
them wait; the first failure cancels the others and is raised to the reader; a reader that
leaves cancels and awaits every producer before the sources are closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import TypeVar

from serving.pipeline.errors import MotorError

T = TypeVar("T")

# Bounded queue between per-prompt producers and the client: a slow reader makes producers wait.
# Each item is a derendered chunk (1-2 KiB parsed); a client that keeps up finds at most one or two
# queued, and each producer holds one more while it waits to put it, so this only bounds what a
# silent client holds (64 held 80 KiB of them per stream, 8 held 19 KiB of a two-prompt stream).
MERGE_QUEUE_SIZE = 2


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first leaf exception of ``group`` (a TaskGroup's failure is its first producer's)."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return first_error(exc)
        return exc
    return group


async def fan_in(
    sources: Sequence[Callable[[], AsyncGenerator[T, None]]],
    *,
    on_stop: Callable[[list[int], BaseException], None] = lambda _failed, _exc: None,
    handed_on: bool = False,
) -> AsyncGenerator[T, None]:
    """Items of every source as they come; raises the first source's ``MotorError``.

    ``on_stop(failed_indexes, exc)`` is told when the fan-in ends early (a failure, or the
    reader left), after every producer stopped.

    ``handed_on``: a source is resumed after yielding an item only once the reader of the
    fan-in has taken that item and asked for the next one, as if it read the source itself. A
    derender session commits a chunk when it is resumed, so its commit is the moment the client
    was handed the chunk, not the moment the chunk entered the queue. The other sources go on
    meanwhile: each holds at most one item the client has not taken.
    """
    queue: asyncio.Queue[tuple[T, asyncio.Future[None] | None] | None] = asyncio.Queue(MERGE_QUEUE_SIZE)
    failed: list[int] = []
    loop = asyncio.get_running_loop()

    async def produce(index: int) -> None:
        try:
            async with aclosing(sources[index]()) as items:
                async for item in items:
                    taken = loop.create_future() if handed_on else None
                    await queue.put((item, taken))
                    if taken is not None:
                        await taken
        except MotorError:
            failed.append(index)
            raise

    async def run_all() -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for i in range(len(sources)):
                    tg.create_task(produce(i))
        except asyncio.CancelledError:
            # The consumer is gone and cancelled us: nobody reads a sentinel, and putting one
            # into a full queue would block this task (and the client's cleanup) forever.
            raise
        except BaseException:
            await queue.put(None)
            raise
        await queue.put(None)

    runner = asyncio.create_task(run_all())
    try:
        while (entry := await queue.get()) is not None:
            item, taken = entry
            yield item
            if taken is not None and not taken.done():
                taken.set_result(None)  # the reader came back for more: the item was handed on
        await runner  # re-raises a producer's failure
    except BaseException as exc:
        runner.cancel()
        # Wait for the producers to stop without taking on their outcome. asyncio.wait raises
        # only our own cancellation, which must propagate (``except BaseException: pass``
        # around ``await runner`` swallowed it).
        await asyncio.wait([runner])
        if not runner.cancelled():
            runner.exception()  # retrieved: re-raised below as exc, or superseded by it
        on_stop(failed, exc)
        if isinstance(exc, BaseExceptionGroup):
            raise first_error(exc) from exc
        raise
