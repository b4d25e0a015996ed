"""Per-instance engine request metrics of this coordinator process: for ``/metrics``, and recent ones for the dashboard.

The request path calls ``record_request`` once per engine request outcome. It counts the
request (and its error) and observes its TTFT and TPOT in ``prometheus_client`` counters and
histograms (``prometheus``, what ``/metrics`` serves), and adds it to ring buffers of
``BUCKETS`` buckets of ``BUCKET_S`` seconds (ten minutes) that the fleet dashboard reads
(``snapshot``, ``export``). The cost per request is a few additions, each under its lock, and
memory is bounded by the number of instances. Each coordinator process keeps its own; with several
processes a Prometheus server sums what each ``/metrics`` reports.

Django-free like the rest of ``serving.pipeline``.

What the numbers mean, as the coordinator sees them:

- TTFT: for a stream, from the engine's HTTP 200 to its first token event; for a non-streaming
  generate the first token arrives with the whole answer, so it is the whole generate latency.
- TPOT: for a stream, (last token event - first) / (tokens - 1); unknown for non-streaming.
- errors: engine failures (``EngineError``, including the engine's own busy 503); a request the
  engine rejected as invalid or a client that left is neither a success nor an error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from serving.pipeline import metric_names as names
from serving.pipeline.errors import EngineError
from serving.pipeline.exporter import Recorder
from serving.pipeline.metric_names import Family

BUCKET_S = 10
BUCKETS = 60


@dataclass(slots=True)
class _Bucket:
    start: int  # epoch seconds, a multiple of the bucket width
    requests: int = 0
    errors: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    tpot_sum: float = 0.0
    tpot_count: int = 0


@dataclass(frozen=True, slots=True)
class Point:
    """One bucket of one instance; averages are None when nothing was measured in it."""

    start: int
    requests: int
    errors: int
    ttft_s: float | None
    tpot_s: float | None


@dataclass(frozen=True, slots=True)
class InstanceSeries:
    """The last ``BUCKETS`` buckets of one instance, oldest first (empty ones included), and the
    window's totals (a whole-life total is the process's ``/metrics``)."""

    points: tuple[Point, ...]
    requests_total: int
    errors_total: int
    ttft_sum_s: float
    ttft_count: int
    tpot_sum_s: float
    tpot_count: int


# The families ``record_request`` records, per engine instance.
ENGINE_FAMILIES = (names.ENGINE_REQUESTS, names.ENGINE_ERRORS, names.ENGINE_TTFT, names.ENGINE_TPOT)


class MetricsRegistry:
    """Ring buffers of recent buckets per instance name (the dashboard), and the same outcomes
    as ``prometheus_client`` counters and histograms since the process started (``prometheus``)."""

    def __init__(self, *, bucket_s: int = BUCKET_S, buckets: int = BUCKETS, clock: Callable[[], float] = time.time) -> None:
        self.bucket_s = bucket_s
        self.buckets = buckets
        self._clock = clock
        # The request path writes from the event loop while a sync dashboard view reads from a
        # worker thread; the lock is held for a few additions, never across an await.
        self._lock = threading.Lock()
        self._rings: dict[str, list[_Bucket | None]] = {}
        # What /metrics serves: requests, errors, TTFT and TPOT per instance (``ENGINE_FAMILIES``).
        self.prometheus = CollectorRegistry(auto_describe=True)
        self._recorders = tuple(Recorder(f, self.prometheus) for f in ENGINE_FAMILIES)
        self._series: dict[str, tuple[Any, ...]] = {}  # instance -> its four series, in that order
        # Called after each record, outside the lock (the host's report of this process's
        # buckets for the fleet dashboard, ``serving.stream_reports``); must not block.
        self.on_record: Callable[[], None] | None = None

    def _slot(self, now: float) -> tuple[int, int]:
        start = int(now // self.bucket_s) * self.bucket_s
        return start, (start // self.bucket_s) % self.buckets

    def record_request(self, instance: str, ttft_s: float | None, tpot_s: float | None, ok: bool) -> None:
        """Count one engine request outcome of ``instance`` in the current bucket."""
        start, index = self._slot(self._clock())
        with self._lock:
            ring = self._rings.get(instance)
            if ring is None:
                ring = self._rings[instance] = [None] * self.buckets
            bucket = ring[index]
            if bucket is None or bucket.start != start:
                # The slot still holds a bucket one lap (buckets * bucket_s) old: reuse it.
                bucket = ring[index] = _Bucket(start)
            bucket.requests += 1
            if not ok:
                bucket.errors += 1
            if ttft_s is not None:
                bucket.ttft_sum += ttft_s
                bucket.ttft_count += 1
            if tpot_s is not None:
                bucket.tpot_sum += tpot_s
                bucket.tpot_count += 1
        series = self._series.get(instance)
        if series is None:
            # The instance names are the operator's (the fleet's records): bounded by the fleet.
            labels = {"instance": instance}
            series = self._series[instance] = tuple(r.child(labels) for r in self._recorders)
        requests, errors, ttft, tpot = series
        requests.inc()
        if not ok:
            errors.inc()
        if ttft_s is not None:
            ttft.observe(ttft_s)
        if tpot_s is not None:
            tpot.observe(tpot_s)
        if self.on_record is not None:
            self.on_record()

    def export(self) -> Export:
        """The buckets of the current window as sums, per instance: what ``merge`` adds up.

        Sums and counts rather than averages, so buckets of several coordinator processes
        add up to the fleet's (an average of averages would weigh a quiet process like a busy one).
        """
        current, _ = self._slot(self._clock())
        oldest = current - (self.buckets - 1) * self.bucket_s
        with self._lock:
            return {
                name: [
                    [b.start, b.requests, b.errors, b.ttft_sum, b.ttft_count, b.tpot_sum, b.tpot_count]
                    for b in sorted((b for b in ring if b is not None and b.start >= oldest), key=lambda b: b.start)
                ]
                for name, ring in self._rings.items()
            }

    def snapshot(self) -> dict[str, InstanceSeries]:
        """Every instance's last ``buckets`` buckets ending with the current one, and their totals."""
        return merge([self.export()], now=self._clock(), bucket_s=self.bucket_s, buckets=self.buckets)

    def clear(self) -> None:
        with self._lock:
            self._rings.clear()
            self._series.clear()
            for recorder in self._recorders:
                recorder.clear()


# instance name -> its buckets as [start, requests, errors, ttft_sum, ttft_count, tpot_sum, tpot_count]
Export = dict[str, list[list[float]]]


def merge(exports: list[Export], *, now: float, bucket_s: int = BUCKET_S, buckets: int = BUCKETS) -> dict[str, InstanceSeries]:
    """Add up the exports of several registries (coordinator processes) into one series per instance.

    Buckets are aligned by their start (each a multiple of ``bucket_s`` of wall-clock time), so
    the same ten seconds of two processes land in one point; buckets outside the window ending at
    ``now`` are left out. Totals are the window's sums (a whole-life total lives in each process's
    own ``/metrics``, which Prometheus adds up).
    """
    current = int(now // bucket_s) * bucket_s
    starts = [current - (buckets - 1 - k) * bucket_s for k in range(buckets)]
    window = set(starts)
    sums: dict[str, dict[int, list[float]]] = {}
    for export in exports:
        for name, rows in export.items():
            into = sums.setdefault(name, {})
            for row in rows:
                start = int(row[0])
                if start in window:
                    acc = into.setdefault(start, [0.0] * 6)
                    for k in range(6):
                        acc[k] += float(row[k + 1])
    out: dict[str, InstanceSeries] = {}
    for name, by_start in sums.items():
        points = []
        for start in starts:
            r, e, ts, tc, ps, pc = by_start.get(start, [0.0] * 6)
            points.append(Point(start, int(r), int(e), ts / tc if tc else None, ps / pc if pc else None))
        t = [sum(v[k] for v in by_start.values()) for k in range(6)]
        out[name] = InstanceSeries(tuple(points), int(t[0]), int(t[1]), t[2], int(t[3]), t[4], int(t[5]))
    return out


class TimedEvents:
    """Wraps an engine's stream of generate events (a list per read) and records its outcome once.

    A plain async iterator rather than an async generator on purpose: it holds no frame to be
    finalized later, so a client that leaves mid-stream leaves nothing for the loop to clean up,
    and the stream's owner (the engine client's context manager) still closes the stream itself.
    """

    def __init__(
        self, instance: str, events: AsyncIterator[list[dict[str, Any]]], registry: MetricsRegistry | None = None,
        *, clock: Callable[[], float] = time.perf_counter, on_first: Callable[[], None] | None = None,
    ) -> None:
        self._instance = instance
        self._events = events
        self._registry = registry or REGISTRY
        self._clock = clock  # monotonic seconds; durations only, so not the registry's wall clock
        # Established (HTTP 200) is the start: the engine sends headers before it has a token.
        self._start = clock()
        self._first: float | None = None
        self._last = 0.0
        self._tokens = 0
        self._recorded = False
        self._on_first = on_first  # called once, when the first event (of any kind) arrives

    def __aiter__(self) -> TimedEvents:
        return self

    async def __anext__(self) -> list[dict[str, Any]]:
        try:
            batch = await self._events.__anext__()
        except StopAsyncIteration:
            self._record(ok=True)
            raise
        except EngineError:
            self._record(ok=False)
            raise
        if self._on_first is not None:
            on_first, self._on_first = self._on_first, None
            on_first()
        tokens = sum(len(c.get("token_ids") or ()) for event in batch for c in event.get("choices") or ())
        if tokens:
            now = self._clock()
            if self._first is None:
                self._first = now
            self._last = now
            self._tokens += tokens
        return batch

    def _record(self, *, ok: bool) -> None:
        if self._recorded:
            return
        self._recorded = True
        ttft = self._first - self._start if self._first is not None else None
        tpot = (self._last - self._first) / (self._tokens - 1) if self._first is not None and self._tokens > 1 else None
        self._registry.record_request(self._instance, ttft, tpot, ok)


# The process's registry: one per coordinator process, shared by every request and view.
REGISTRY = MetricsRegistry()


def record_request(instance: str, ttft_s: float | None, tpot_s: float | None, ok: bool) -> None:
    """Record one engine request outcome in the process's registry (see the module docstring)."""
    REGISTRY.record_request(instance, ttft_s, tpot_s, ok)


def snapshot() -> dict[str, InstanceSeries]:
    return REGISTRY.snapshot()


class RouterCounters:
    """Counters of routing decisions and phase outcomes (``prometheus_client``), served by ``/metrics``.

    Families come from ``metric_names`` (``ROUTER_FAMILIES``, declared from the start so a reason
    never counted is exported as no series rather than missing); ``inc`` raises ``ValueError``
    for labels the family does not declare and records a value outside its label's set as
    ``other`` (``Family.series``), so memory and ``/metrics`` stay bounded whatever a request carries.
    """

    def __init__(self, families: tuple[Family, ...] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._recorders = {f.name: Recorder(f, self.registry) for f in families or ROUTER_FAMILIES}
        # Called after each count (the dashboard's reporter: the route decisions are in its payload).
        self.on_inc: Callable[[], None] | None = None

    def inc(self, family: Family, **labels: str) -> None:
        self._recorders[family.name].child(labels).inc()
        if self.on_inc is not None:
            self.on_inc()

    def route_decisions(self) -> list[tuple[str, str, str, int]]:
        """Every counted route decision as ``(model, path, reason, count)``: what the dashboard
        shows per model (why its requests went native), and what each process reports of it."""
        return sorted(
            (s.labels["model"], s.labels["path"], s.labels["reason"], int(s.value))
            for metric in self.registry.collect() for s in metric.samples
            if s.name == names.ROUTE_DECISIONS.name and s.value
        )

    def get(self, family: Family | str, **labels: str) -> int:
        """The count of one series, or the sum over the labels not given (tests and benchmarks;
        ``/metrics`` is what operators read). Raises ``ValueError`` for labels the family lacks."""
        if isinstance(family, str):
            family = names.FAMILIES[family]
        given = set(labels)
        if given - set(family.labels):
            family.check(labels)  # raises: a label the family does not declare
        full = {k: labels.get(k, "") for k in family.labels}
        wanted = {k: v for k, v in family.series(full) if k in given}
        return int(sum(
            s.value for metric in self.registry.collect() for s in metric.samples
            if s.name == family.name and all(s.labels.get(k) == v for k, v in wanted.items())
        ))

    def snapshot(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], int]:
        """Every counted series as ``(family name, sorted (label, value) pairs) -> count``."""
        return {
            (s.name, tuple(sorted(s.labels.items()))): int(s.value)
            for metric in self.registry.collect() for s in metric.samples if s.name.endswith("_total")
        }

    def clear(self) -> None:
        for recorder in self._recorders.values():
            recorder.clear()


# What the router counts (``RouterCounters``): route decisions, tokenizations, stream relays.
ROUTER_FAMILIES = (names.ROUTE_DECISIONS, names.RENDER_OUTCOMES, names.STREAM_RELAYS)
