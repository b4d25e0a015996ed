"""Where a /v1 request's time goes: one latency histogram per phase, and the recorder it carries.

The phases (``metric_names``, docs/metrics.md): render or local tokenization, the admission
queue wait, placement, the first generate chunk (from sending generate to its first event, or to
its JSON answer), the first derender call, and the whole request at the edge. Each is observed
where it happens, in one hook, through the request's ``Phases``: the process's ``Histograms``
(``prometheus_client`` histograms whose clock every duration is read from, so tests inject
one), and the request's labels. Each phase's buckets are its family's (``metric_names``).

Labels come from fixed sets only, never from what a client wrote: ``model`` (the served model
the edge resolved the request to), ``api`` (the route: chat,
completions, responses, messages), ``mode`` (stream or json), ``topology`` (union, handoff,
trigger; native for an engine's own API), ``leg`` (union, prefill, decode) and ``source``
(render, local). A family takes the subset it declares; ``topology`` is the attempt's, or on the
request's own recorder the last placement's (what the end-to-end and derender hooks see).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import CollectorRegistry

from serving.pipeline.exporter import Recorder
from serving.pipeline.metric_names import OTHER, PHASES, Family
from serving.pipeline.tracing import PhaseTracer, RequestTrace

Labels = tuple[tuple[str, str], ...]


class Histograms:
    """This process's phase histograms (``prometheus_client``), in a registry of their own.

    Every family of ``families`` is declared from the start, so an idle phase is exported with
    no series rather than missing; each takes its buckets from its ``Family``.
    """

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter, families: tuple[Family, ...] = PHASES) -> None:
        self.clock = clock  # monotonic seconds: every phase is a difference of two readings
        self.registry = CollectorRegistry(auto_describe=True)
        self._recorders = {f.name: Recorder(f, self.registry) for f in families}

    def observe(self, family: Family, seconds: float, labels: Mapping[str, str]) -> None:
        """Count one duration of ``family``; raises ``ValueError`` for labels it does not declare."""
        self._recorders[family.name].child(labels).observe(seconds)

    def samples(self) -> dict[tuple[str, Labels], float]:
        """Every series as ``(sample name, labels) -> value``: labels sorted, a bucket's ``le`` last."""
        out: dict[tuple[str, Labels], float] = {}
        for metric in self.registry.collect():
            for s in metric.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                if "le" in s.labels:
                    labels += (("le", s.labels["le"]),)
                out[(s.name, labels)] = s.value
        return out

    def clear(self) -> None:
        for recorder in self._recorders.values():
            recorder.clear()


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
        model: str = OTHER,
    ) -> Phases:
        """The recorder of a request of route ``api`` for served ``model`` (as the edge resolved it
        against the snapshot) that arrived at ``start``, traced by ``tracer`` (a child of the
        client's trace when ``parent``, its W3C trace headers, names one)."""
        labels = {"model": model, "api": api, "mode": "stream" if body.get("stream") else "json"}
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
        labels = {"topology": self.placed_on.topology, "model": OTHER, **self.labels}
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
