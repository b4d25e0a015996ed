"""In-process load per instance: the requests this process has in flight on each.

Its own module so that the scorers, the scheduler and the runtime share it without importing
each other.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import KeysView
from types import TracebackType

from serving.pipeline.snapshot import InstanceView


class LoadTracker:
    """In-process count of requests in flight per instance."""

    def __init__(self) -> None:
        self._inflight: Counter[str] = Counter()

    def inflight(self, name: str) -> int:
        return self._inflight[name]

    def hold(self, instance: InstanceView) -> _Hold:
        """A request in flight on ``instance`` while the returned context manager is entered."""
        return _Hold(self._inflight, instance.name)

    def snapshot(self) -> dict[str, int]:
        return dict(self._inflight)

    def busy(self) -> KeysView[str]:
        """Names with a request in flight (a live view)."""
        return self._inflight.keys()


class _Hold:
    """``LoadTracker.hold``: a class, not a ``contextmanager`` generator, whose suspended frame and
    wrapper an engine stream's attempt would keep for the stream's whole life (issue 31)."""

    __slots__ = ("_inflight", "_name")

    def __init__(self, inflight: Counter[str], name: str) -> None:
        self._inflight = inflight
        self._name = name

    def __enter__(self) -> None:
        self._inflight[self._name] += 1

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        inflight, name = self._inflight, self._name
        inflight[name] -= 1
        if not inflight[name]:
            del inflight[name]
