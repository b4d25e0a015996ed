"""A deadline renewed at every step of a stream, on one timer per period rather than one per step.

``asyncio.timeout`` arms a timer on entry and cancels it on exit: on a stream's per-chunk path
(the engine read's stall bound, the derender's bound) that is a timer scheduled and cancelled
per chunk, each about 35 k instructions (a ``TimerHandle``, the heap's Python comparisons, the
cancelled handles swept later: ``bench/chunk_cost.py``, issue 32). ``StepBound`` keeps one timer
armed for the stream and moves it on only when it comes due while a step is still running. The
edge's sends to a client use it too (``send_stream`` in ``serving/edge/asgi.py``, the client
stall bound).
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class StepBound:
    """``async with bound:`` around each step of one stream, one step at a time: a step that
    lasts ``seconds`` is cancelled and ``TimeoutError`` raised out of it, as
    ``asyncio.timeout(seconds)`` entered at the step's start would (same deadline, same
    cancellation accounting). Between steps nothing is due; the timer, armed at most once per
    period, lets go of the bound when it finds no step running (``close`` lets go at once).
    """

    __slots__ = ("seconds", "_loop", "_task", "_since", "_cancelling", "_fired", "_handle")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[object] | None = None
        self._since: float | None = None  # the running step's start (the loop's clock), else None
        self._cancelling = 0
        self._fired = False
        self._handle: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> StepBound:
        task = asyncio.current_task()
        assert task is not None, "a step runs in a task"
        loop = self._loop
        if loop is None:
            loop = self._loop = task.get_loop()
        self._task = task
        self._cancelling = task.cancelling()
        self._since = since = loop.time()
        if self._handle is None:
            self._handle = loop.call_at(since + self.seconds, self._check)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._since = None
        if self._fired:
            self._fired = False
            task, self._task = self._task, None
            assert task is not None
            if task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
        self._task = None

    def _check(self) -> None:
        self._handle = None
        since = self._since
        if since is None:
            return  # no step running: the next one arms the timer again
        assert self._loop is not None and self._task is not None
        due = since + self.seconds
        if due > self._loop.time():
            self._handle = self._loop.call_at(due, self._check)
            return
        self._fired = True
        self._task.cancel()

    def close(self) -> None:
        """Let go of the timer now (the stream ended); a later step arms it again."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.cancel()
