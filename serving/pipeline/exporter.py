"""This process's metrics as ``prometheus_client`` objects, built from the families of ``metric_names``.

A family declares its name, type, help, labels (with each label's closed set of values) and a
histogram's buckets once; ``metric`` turns that into the library's ``Counter``, ``Gauge`` or
``Histogram``, and ``Recorder`` feeds it only values the family declares (``Family.series``:
anything else is counted as ``other``). Values the process keeps elsewhere and reads at scrape
time (in-flight tokens, the launcher's processes, ...) become the library's metric families
through ``scraped``. ``exposition`` writes them all as Prometheus text (docs/metrics.md).

One registry per recorder and one process per ``/metrics``: every deployment serves each
coordinator process on its own port, so Prometheus scrapes and sums the processes itself and
the multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``) is not used (docs/metrics.md says why).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from serving.pipeline.metric_names import Family

# ``generate_latest`` writes the 0.0.4 text format.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# No ``_created`` series: in the 0.0.4 text they are gauge families of their own that no query
# here reads, one per counter and histogram series (process-wide, and what vLLM's exporter does too).
disable_created_metrics()  # type: ignore[no-untyped-call]

Metrics = Counter | Gauge | Histogram


def metric(family: Family, registry: CollectorRegistry) -> Metrics:
    """The ``prometheus_client`` object of ``family``, registered in ``registry``."""
    if family.type == "histogram":
        return Histogram(family.name, family.help, family.labels, registry=registry, buckets=family.buckets)
    kind = Counter if family.type == "counter" else Gauge
    return kind(family.name, family.help, family.labels, registry=registry)


class Recorder:
    """One family's metric, fed only label values the family declares.

    ``child`` checks the label names (``ValueError`` for any other set) and maps each value
    outside its label's set to ``other``; the library's child of a declared label set is cached,
    so a request pays a tuple and a dictionary lookup before the library's own lock.
    """

    __slots__ = ("family", "metric", "_children")

    def __init__(self, family: Family, registry: CollectorRegistry) -> None:
        self.family = family
        self.metric = metric(family, registry)
        # Keyed by the values as given, kept only when none was folded into ``other``: bounded by
        # the label sets (and the fleet's names, for the operator's labels).
        self._children: dict[tuple[str, ...], Any] = {}

    def child(self, labels: Mapping[str, str]) -> Any:
        """The series of ``labels`` (a ``Counter``, ``Gauge`` or ``Histogram`` of one label set)."""
        family = self.family
        if len(labels) != len(family.labels):
            family.check(labels)  # raises
        try:
            key = tuple([labels[k] for k in family.labels])
        except KeyError:
            family.check(labels)  # raises
            raise
        found = self._children.get(key)
        if found is not None:
            return found
        if not family.labels:
            return self.metric
        folded = dict(family.series(labels))
        found = self.metric.labels(*(folded[k] for k in family.labels))
        if all(folded[k] == v for k, v in zip(family.labels, key, strict=True)):
            self._children[key] = found
        return found

    def clear(self) -> None:
        """Forget every series (tests; a process's metrics otherwise live as long as it does)."""
        self._children.clear()
        if self.family.labels:
            self.metric.clear()


def scraped(family: Family, series: Iterable[tuple[Mapping[str, str], float]]) -> Metric:
    """``family`` with the values read at scrape time, each series ``(labels, value)``.

    Label values pass through ``Family.series`` (a value outside its set is summed into
    ``other``); raises ``ValueError`` for label names the family does not declare. A family
    without series is still exported (idle is not missing).
    """
    folded: dict[tuple[str, ...], float] = {}
    for labels, value in series:
        values = dict(family.series(labels))
        key = tuple(values[k] for k in family.labels)
        folded[key] = folded.get(key, 0.0) + value
    if family.type == "histogram":
        raise ValueError(f"{family.name}: a histogram is observed, not read at scrape time")
    kind = CounterMetricFamily if family.type == "counter" else GaugeMetricFamily
    out = kind(family.name, family.help, labels=family.labels)
    for key, value in folded.items():
        out.add_metric(list(key), value)
    return out


class Exposition:
    """Several collectors (each recorder's registry, the families read at scrape time) as one."""

    def __init__(self, *sources: Collector) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        for source in self._sources:
            yield from source.collect()


class Families:
    """Metric families read at scrape time (``scraped``), as a collector."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def exposition(*sources: Collector) -> bytes:
    """Prometheus text (0.0.4) of ``sources``, in order."""
    return generate_latest(Exposition(*sources))
