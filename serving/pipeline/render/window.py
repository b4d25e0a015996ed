"""At most so many streaming derender calls in flight per render sidecar; the rest wait their turn here.

The RFC bounds each derender chunk by ``timeout_ms`` (one HTTP request). Without a window every
open stream has a call in flight at once, so the sidecar's own queue is as long as the number of
streams, and a call's time is mostly its wait in that queue: at 256 streams on the simulated fleet
one sidecar took over 5 s for the first chunks of a burst of new streams, and those streams failed
with 504 although nothing was wrong but the queue the coordinator had built itself
(bench/RESULTS.md, the coalesce section). With a window the queue is here, FIFO, and is not a
derender call yet: the deadline starts when the call is sent, so it measures the sidecar, not the
number of streams. A stream waiting for its turn keeps reading its engine, and coalescing
(derender/coalesce.py) merges what arrives meanwhile into its next call, so the calls per second
fall to what the sidecar answers instead of piling up. A sidecar that hangs still fails the calls
it holds at their deadline.

A window serves one event loop; ``Windows`` keeps them per loop (a process's loop in production,
one per test in the tests) so no waiter ever belongs to another loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import weakref

# Calls in flight per sidecar of a pool. One sidecar answered 300-550 streaming derender calls a
# second on the 2-core machines (bench/RESULTS.md, the knee), so 16 queued in it are tens of
# milliseconds, far inside the RFC's 5 s; and up to 16 streams per sidecar (every cell of
# bench/serve_bench.py) nothing waits here, so the cadence below the knee is unchanged.
CALLS_PER_SIDECAR = 16


class Window:
    """At most ``size`` holders at once; the others wait in arrival order."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self.held = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def slot(self) -> Window:
        """``async with window.slot():`` holds one of its places (the window is its own context
        manager: no generator per call, which a call per chunk would pay for)."""
        return self

    async def __aenter__(self) -> None:
        if self.held < self.size and not self._waiters:
            self.held += 1
            return
        await self._acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._release()

    async def _acquire(self) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # a releaser hands its slot over: ``held`` stays as it was
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release()  # handed a slot, then cancelled before using it: the next one gets it
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.held -= 1


class Windows:
    """The windows of this process, per event loop and per pool of sidecars."""

    def __init__(self, per_sidecar: int = CALLS_PER_SIDECAR) -> None:
        self.per_sidecar = per_sidecar
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, ...], Window]] = (
            weakref.WeakKeyDictionary())

    def of(self, sidecars: tuple[str, ...]) -> Window:
        """The window of a pool of ``sidecars`` (base URLs) on the running loop: ``per_sidecar`` calls each."""
        windows = self._by_loop.setdefault(asyncio.get_running_loop(), {})
        found = windows.get(sidecars)
        if found is None:
            found = windows[sidecars] = Window(self.per_sidecar * len(sidecars))
        return found
