"""Fan-in of sub-streams that live and die together (vLLM's ``merge_async_iterators``).

One task per source feeds a bounded buffer, so a slow reader makes them wait; the first failure
cancels the others and is raised to the reader; a reader that leaves cancels and awaits every
producer before the sources are closed.

The reader runs in its own task and the producers are its only helpers: no task to supervise
them and no ``asyncio.Queue`` (whose three deques and event weigh 2.8 KiB). A stream whose client
reads nothing keeps its fan-in for as long as it is held back, so what it is made of counts
(``bench/slow_reader.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Generic, Protocol, TypeVar

from serving.pipeline.errors import MotorError

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Source(Protocol[T_co]):
    """A sub-stream: an async iterator the fan-in closes (an async generator, or a plain iterator
    with ``aclose``, as ``streaming/prompt_chunks.py``'s)."""

    def __aiter__(self) -> AsyncIterator[T_co]: ...

    def aclose(self) -> Awaitable[None]: ...

# Bounded buffer between per-prompt producers and the client: a slow reader makes producers wait.
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


class _Merge(Generic[T]):
    """The producers of one fan-in and what they handed over, as a TaskGroup and a Queue would keep it."""

    __slots__ = ("loop", "items", "reader", "putters", "tasks", "running", "errors", "failed", "handed_on")

    def __init__(self, handed_on: bool) -> None:
        self.loop = asyncio.get_running_loop()
        self.items: list[tuple[T, asyncio.Future[None] | None]] = []
        self.reader: asyncio.Future[None] | None = None  # the reader's, while it waits for an item
        self.putters: list[asyncio.Future[None]] = []  # producers waiting for room
        self.tasks: list[asyncio.Task[None]] = []
        self.running = 0
        self.errors: list[BaseException] = []
        self.failed: list[int] = []
        self.handed_on = handed_on

    def start(self, sources: Sequence[Callable[[], Source[T]]]) -> None:
        for index, source in enumerate(sources):
            task = self.loop.create_task(self._produce(index, source))
            task.add_done_callback(self._ended)
            self.tasks.append(task)
        self.running = len(self.tasks)

    async def _produce(self, index: int, source: Callable[[], Source[T]]) -> None:
        try:
            async with aclosing(source()) as items:
                async for item in items:
                    while len(self.items) >= MERGE_QUEUE_SIZE:
                        room = self.loop.create_future()
                        self.putters.append(room)
                        try:
                            await room
                        finally:
                            if room in self.putters:
                                self.putters.remove(room)
                    taken = self.loop.create_future() if self.handed_on else None
                    self.items.append((item, taken))
                    self._wake(self.reader)
                    if taken is not None:
                        await taken
        except MotorError:
            self.failed.append(index)
            raise

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.running -= 1
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.errors.append(exc)
            if len(self.errors) == 1:  # as a TaskGroup does: the first failure stops the others
                for other in self.tasks:
                    other.cancel()
        if self.running == 0:
            self._wake(self.reader)

    def take(self) -> tuple[T, asyncio.Future[None] | None]:
        entry = self.items.pop(0)
        while self.putters:
            if self._wake(self.putters.pop(0)):
                break
        return entry

    @staticmethod
    def _wake(waiter: asyncio.Future[None] | None) -> bool:
        if waiter is None or waiter.done():
            return False
        waiter.set_result(None)
        return True

    async def stop(self) -> None:
        """Cancel the producers and wait for them to end, without taking on their outcome."""
        for task in self.tasks:
            task.cancel()
        pending = [t for t in self.tasks if not t.done()]
        if pending:
            # asyncio.wait raises only our own cancellation, which must propagate.
            await asyncio.wait(pending)


async def fan_in(
    sources: Sequence[Callable[[], Source[T]]],
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
    was handed the chunk, not the moment the chunk entered the buffer. The other sources go on
    meanwhile: each holds at most one item the client has not taken.
    """
    merge: _Merge[T] = _Merge(handed_on)
    merge.start(sources)
    try:
        while True:
            if merge.items:
                item, taken = merge.take()
                yield item
                if taken is not None and not taken.done():
                    taken.set_result(None)  # the reader came back for more: the item was handed on
                continue
            if merge.running == 0:
                break
            merge.reader = merge.loop.create_future()
            try:
                await merge.reader
            finally:
                merge.reader = None
        if merge.errors:
            # As a TaskGroup raises them (callers unwrap with ``first_error``).
            raise BaseExceptionGroup("unhandled errors in a TaskGroup", merge.errors)
    except BaseException as exc:
        await merge.stop()
        on_stop(merge.failed, exc)
        if isinstance(exc, BaseExceptionGroup):
            raise first_error(exc) from exc
        raise
