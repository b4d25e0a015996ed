"""In-process load per instance: the requests this process has in flight on each.

Its own module so that the scorers, the scheduler and the runtime share it without importing
each other.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, KeysView
from contextlib import contextmanager

from serving.pipeline.snapshot import InstanceView


class LoadTracker:
    """In-process count of requests in flight per instance."""

    def __init__(self) -> None:
        self._inflight: Counter[str] = Counter()

    def inflight(self, name: str) -> int:
        return self._inflight[name]

    @contextmanager
    def hold(self, instance: InstanceView) -> Iterator[None]:
        self._inflight[instance.name] += 1
        try:
            yield
        finally:
            self._inflight[instance.name] -= 1
            if not self._inflight[instance.name]:
                del self._inflight[instance.name]

    def snapshot(self) -> dict[str, int]:
        return dict(self._inflight)

    def busy(self) -> KeysView[str]:
        """Names with a request in flight (a live view)."""
        return self._inflight.keys()
