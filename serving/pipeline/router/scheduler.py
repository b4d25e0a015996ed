"""Placement: which instance runs a request.

The first slice places on union instances only, least loaded first (in-flight requests per
weight), so two concurrent requests spread over two engines.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

from serving.pipeline.errors import NoCapacity
from serving.pipeline.snapshot import FleetSnapshot, InstanceView


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


class Scheduler:
    def __init__(self, load: LoadTracker) -> None:
        self.load = load

    def pick_union(self, snapshot: FleetSnapshot, model: str, *, exclude: set[str] = frozenset()) -> InstanceView:  # type: ignore[assignment]
        """Return the least loaded union instance for ``model``; raise ``NoCapacity`` if none."""
        candidates = [i for i in snapshot.union_instances(model) if i.name not in exclude]
        if not candidates:
            raise NoCapacity(f"no engine instance can serve model {model!r} right now")
        return min(candidates, key=lambda i: (self.load.inflight(i.name) / max(i.weight, 1), i.name))
