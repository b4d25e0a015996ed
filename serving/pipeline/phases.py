"""Where a /v1 request's time goes: one latency histogram per phase, and the recorder it carries.

The phases (``metric_names``, docs/metrics.md): render or local tokenization, the admission
queue wait, placement, the first generate chunk (from sending generate to its first event, or to
its JSON answer), the first derender call, and the whole request at the edge. Each is observed
where it happens, in one hook, through the request's ``Phases``: the process's ``Histograms``
(whose clock every duration is read from, so tests inject one), and the request's labels.

Labels come from fixed sets only, never from what a client wrote: ``api`` (the route: chat,
completions, responses, messages), ``mode`` (stream or json), ``topology`` (union, handoff,
trigger; native for an engine's own API), ``leg`` (union, prefill, decode) and ``source``
(render, local). A family takes the subset it declares; ``topology`` is the attempt's, or on the
request's own recorder the last placement's (what the end-to-end and derender hooks see).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from serving.pipeline.metric_names import Family
from serving.pipeline.tracing import PhaseTracer, RequestTrace

# 1 ms .. 30 s: a render or a derender call takes milliseconds, a queue wait or a long answer seconds.
BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

Labels = tuple[tuple[str, str], ...]


@dataclass(slots=True)
class _Series:
    counts: list[int]  # per bucket, not cumulative; the last one is +Inf
    total: float = 0.0


class Histograms:
    """This process's phase histograms: bucket counts, sums and counts per (family, labels)."""

    def __init__(self, *, buckets: tuple[float, ...] = BUCKETS, clock: Callable[[], float] = time.perf_counter) -> None:
        self.buckets = buckets
        self.clock = clock  # monotonic seconds: every phase is a difference of two readings
        # Observed on the event loop, read by /metrics (and tests) from anywhere; held for a few additions.
        self._lock = threading.Lock()
        self._series: dict[tuple[str, Labels], _Series] = {}

    def observe(self, family: Family, seconds: float, labels: dict[str, str]) -> None:
        """Count one duration of ``family``; raises ``ValueError`` for labels it does not declare."""
        family.check(labels)
        key = (family.name, tuple(sorted(labels.items())))
        index = bisect.bisect_left(self.buckets, seconds)  # le is inclusive: a value on a bound is in it
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = _Series([0] * (len(self.buckets) + 1))
            series.counts[index] += 1
            series.total += seconds

    def samples(self) -> dict[tuple[str, Labels], float]:
        """Every series as exposition samples: cumulative ``_bucket`` (``le``), ``_sum``, ``_count``."""
        out: dict[tuple[str, Labels], float] = {}
        bounds = [repr(b) for b in self.buckets] + ["+Inf"]
        with self._lock:
            for (name, labels), series in self._series.items():
                cumulative = 0
                for le, n in zip(bounds, series.counts, strict=True):
                    cumulative += n
                    out[(name + "_bucket", (*labels, ("le", le)))] = float(cumulative)
                out[(name + "_sum", labels)] = series.total
                out[(name + "_count", labels)] = float(cumulative)
        return out

    def clear(self) -> None:
        with self._lock:
            self._series.clear()


class _Placed:
    """The topology a request's last attempt was placed on, shared by every copy of its recorder."""

    __slots__ = ("topology",)

    def __init__(self) -> None:
        self.topology = "none"


@dataclass(frozen=True, slots=True)
class Phases:
    """One request's recorder: its histograms (None: record nothing), labels and start, and its
    trace when tracing is on (``tracing``: a span per observed phase, at the same times)."""

    histograms: Histograms | None
    labels: Mapping[str, str] = field(default_factory=dict)
    start: float = 0.0  # when the request arrived (the end-to-end phase's start)
    placed_on: _Placed = field(default_factory=_Placed)
    trace: RequestTrace | None = None

    @classmethod
    def begin(
        cls, histograms: Histograms | None, api: str, body: Mapping[str, Any], start: float, *,
        tracer: PhaseTracer | None = None, request_id: str = "", parent: Mapping[str, str] | None = None,
    ) -> Phases:
        """The recorder of a request of route ``api`` that arrived at ``start``, traced by ``tracer``
        (a child of the client's trace when ``parent``, its W3C trace headers, names one)."""
        labels = {"api": api, "mode": "stream" if body.get("stream") else "json"}
        trace = None
        if tracer is not None and histograms is not None:
            trace = tracer.begin(request_id, labels, start, histograms.clock, parent)
        return cls(histograms, labels, start, trace=trace)

    def now(self) -> float:
        return self.histograms.clock() if self.histograms is not None else 0.0

    def on(self, **labels: str) -> Phases:
        """A copy with ``labels`` added (the same request: its placement stays shared)."""
        return replace(self, labels={**self.labels, **labels})

    def placed(self, topology: str) -> Phases:
        """The attempt's recorder, on ``topology``; the request's remembers it as its last."""
        if self.histograms is not None:
            self.placed_on.topology = topology
        return self.on(topology=topology)

    def observe(self, family: Family, start: float) -> None:
        """Record ``now() - start`` in ``family``, with the labels it declares."""
        if self.histograms is None:
            return
        now = self.histograms.clock()
        labels = {"topology": self.placed_on.topology, **self.labels}
        declared = {k: labels[k] for k in family.labels}
        self.histograms.observe(family, now - start, declared)
        if self.trace is not None:
            self.trace.phase(family, start, now, declared)

    def close(self, error: BaseException | None = None) -> None:
        """End the request's trace if its end-to-end phase never came (``error``: why); idempotent."""
        if self.trace is not None:
            self.trace.close(self.now(), error)


# What a pipeline records without a recorder of the request (tests, direct callers): nothing.
NO_PHASES = Phases(None)
