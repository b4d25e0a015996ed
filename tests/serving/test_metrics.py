"""The per-instance metrics (ring buffers, prometheus_client series), the stream timer and the Prometheus text."""

from __future__ import annotations

from typing import Any, AsyncIterator

import pytest

from serving.pipeline import metric_names as names
from serving.pipeline.errors import EngineError
from serving.pipeline.exporter import Families, exposition, scraped
from serving.pipeline.metric_names import FAMILIES, ROUTE_DECISIONS
from serving.pipeline.metrics import MetricsRegistry, RouterCounters, TimedEvents


def prometheus_text(reg: MetricsRegistry, in_flight_tokens: dict[str, int] | None = None) -> str:
    """What /metrics serves of ``reg`` (and of tokens in flight, read at scrape time)."""
    families = [] if in_flight_tokens is None else [
        scraped(names.ENGINE_IN_FLIGHT_TOKENS, [({"instance": k}, v) for k, v in in_flight_tokens.items()])
    ]
    return exposition(reg.prometheus, Families(families)).decode()


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_it_buckets_requests_by_time_and_keeps_totals() -> None:
    clock = Clock()
    reg = MetricsRegistry(bucket_s=10, buckets=3, clock=clock)
    reg.record_request("e1", 0.2, 0.01, ok=True)
    reg.record_request("e1", 0.4, None, ok=True)
    reg.record_request("e1", None, None, ok=False)
    clock.now += 10
    reg.record_request("e1", 1.0, 0.03, ok=True)
    series = reg.snapshot()["e1"]
    assert [p.start for p in series.points] == [990, 1000, 1010]
    assert [p.requests for p in series.points] == [0, 3, 1]
    assert [p.errors for p in series.points] == [0, 1, 0]
    assert series.points[1].ttft_s == pytest.approx(0.3)
    assert series.points[1].tpot_s == pytest.approx(0.01)
    assert series.points[0].ttft_s is None
    assert (series.requests_total, series.errors_total, series.ttft_count) == (4, 1, 3)


def total(reg: MetricsRegistry, name: str, instance: str) -> float:
    """A whole-life series of ``reg``'s ``/metrics`` (``prometheus_client``'s own reading)."""
    return reg.prometheus.get_sample_value(name, {"instance": instance}) or 0.0


def test_it_forgets_buckets_older_than_the_window_but_metrics_keeps_the_totals() -> None:
    clock = Clock()
    reg = MetricsRegistry(bucket_s=10, buckets=3, clock=clock)
    reg.record_request("e1", 0.1, None, ok=False)
    clock.now += 30  # one full lap: the same slot, a new bucket
    reg.record_request("e1", 0.5, None, ok=True)
    series = reg.snapshot()["e1"]
    assert [p.requests for p in series.points] == [0, 0, 1]
    assert [p.errors for p in series.points] == [0, 0, 0]
    assert series.points[-1].ttft_s == pytest.approx(0.5)
    assert (series.requests_total, series.errors_total) == (1, 0)  # the window's
    assert total(reg, "motor_engine_requests_total", "e1") == 2 and total(reg, "motor_engine_errors_total", "e1") == 1
    assert total(reg, "motor_engine_ttft_seconds_count", "e1") == 2
    assert total(reg, "motor_engine_ttft_seconds_sum", "e1") == pytest.approx(0.6)


def test_it_keeps_instances_apart() -> None:
    reg = MetricsRegistry(bucket_s=10, buckets=2, clock=Clock())
    reg.record_request("e1", 0.1, None, ok=True)
    reg.record_request("e2", None, None, ok=False)
    snap = reg.snapshot()
    assert snap["e1"].errors_total == 0 and snap["e2"].errors_total == 1


async def _events(items: list[dict[str, Any]], fail: bool = False) -> AsyncIterator[list[dict[str, Any]]]:
    for item in items:
        yield [item]
    if fail:
        raise EngineError("dropped", instance="e1")


def _tok(n: int) -> dict[str, Any]:
    return {"choices": [{"index": 0, "token_ids": list(range(n))}]}


async def _timed_events(
    clock: Clock, steps: list[tuple[float, list[dict[str, Any]]]]
) -> AsyncIterator[list[dict[str, Any]]]:
    """Each read arrives ``delay`` seconds (on ``clock``) after the one before."""
    for delay, batch in steps:
        clock.now += delay
        yield batch


async def test_it_times_a_stream_once_when_it_ends() -> None:
    clock = Clock(50.0)
    reg = MetricsRegistry(clock=Clock())
    # Established at 50.0; tokens at 50.25 (1), 50.5 (1), an empty event at 50.75, then 2 + 1 at
    # 51.5 in one read.
    events = _timed_events(
        clock, [(0.25, [_tok(1)]), (0.25, [_tok(1)]), (0.25, [{"choices": []}]), (0.75, [_tok(2), _tok(1)])]
    )
    timed = TimedEvents("e1", events, reg, clock=clock)
    got = [b async for b in timed]
    assert [len(b) for b in got] == [1, 1, 1, 2]
    series = reg.snapshot()["e1"]
    assert (series.requests_total, series.errors_total, series.ttft_count, series.tpot_count) == (1, 0, 1, 1)
    # TTFT: 200 -> first token. TPOT: (last token - first token) / (5 tokens - 1).
    assert series.ttft_sum_s == pytest.approx(0.25)
    assert series.tpot_sum_s == pytest.approx((51.5 - 50.25) / 4)
    assert total(reg, "motor_engine_ttft_seconds_sum", "e1") == pytest.approx(0.25)
    assert total(reg, "motor_engine_tpot_seconds_sum", "e1") == pytest.approx((51.5 - 50.25) / 4)


async def test_it_counts_a_stream_that_fails_as_an_error() -> None:
    reg = MetricsRegistry(clock=Clock())
    timed = TimedEvents("e1", _events([_tok(1)], fail=True), reg)
    with pytest.raises(EngineError):
        async for _ in timed:
            pass
    series = reg.snapshot()["e1"]
    assert (series.requests_total, series.errors_total, series.ttft_count, series.tpot_count) == (1, 1, 1, 0)


async def test_it_records_nothing_for_a_stream_abandoned_midway() -> None:
    reg = MetricsRegistry(clock=Clock())
    timed = TimedEvents("e1", _events([_tok(1), _tok(1)]), reg)
    await timed.__anext__()
    assert reg.snapshot() == {}


def test_it_renders_prometheus_text() -> None:
    reg = MetricsRegistry(clock=Clock())
    reg.record_request('we"ird', 0.25, None, ok=False)
    text = prometheus_text(reg, {"e1": 3})
    assert "# TYPE motor_engine_requests_total counter" in text
    assert 'motor_engine_errors_total{instance="we\\"ird"} 1.0' in text
    assert 'motor_engine_ttft_seconds_sum{instance="we\\"ird"} 0.25' in text
    assert 'motor_engine_ttft_seconds_bucket{instance="we\\"ird",le="0.1"} 0.0' in text
    assert 'motor_engine_ttft_seconds_bucket{instance="we\\"ird",le="0.25"} 1.0' in text  # le is inclusive
    assert 'motor_engine_ttft_seconds_count{instance="we\\"ird"} 1.0' in text
    assert 'motor_engine_tpot_seconds_count{instance="we\\"ird"} 0.0' in text
    assert 'motor_engine_in_flight_tokens{instance="e1"} 3.0' in text
    assert "_created" not in text
    assert text.endswith("\n")


def test_it_names_every_family_the_prometheus_way() -> None:
    for family in FAMILIES.values():
        assert family.name.startswith("motor_"), family
        # Counters and only counters end in _total; timings are histograms in base units.
        assert family.name.endswith("_total") == (family.type == "counter"), family
        assert family.name.endswith("_seconds") == (family.type == "histogram"), family


def test_it_refuses_labels_a_family_does_not_declare() -> None:
    counters = RouterCounters()
    with pytest.raises(ValueError, match="takes labels"):
        counters.inc(ROUTE_DECISIONS, model="tiny", path="native")
    counters.inc(ROUTE_DECISIONS, model="tiny", path="native", reason="echo")
    assert counters.get(ROUTE_DECISIONS, path="native", reason="echo") == 1
    assert counters.get("motor_route_decisions_total", path="native", reason="echo") == 1


def test_it_declares_each_family_once_before_its_series() -> None:
    reg = MetricsRegistry(clock=Clock())
    reg.record_request("e1", 0.5, 0.1, ok=True)
    reg.record_request("e2", 0.25, None, ok=True)
    lines = prometheus_text(reg).splitlines()
    assert lines.count("# TYPE motor_engine_ttft_seconds histogram") == 1
    header = lines.index("# TYPE motor_engine_ttft_seconds histogram")
    block = lines[header + 1:lines.index("# HELP motor_engine_tpot_seconds Time per output token.")]
    assert all(line.startswith("motor_engine_ttft_seconds_") for line in block)
    assert 'motor_engine_ttft_seconds_count{instance="e1"} 1.0' in block
    assert 'motor_engine_ttft_seconds_sum{instance="e2"} 0.25' in block
    with pytest.raises(ValueError, match="takes labels"):
        scraped(names.ENGINE_IN_FLIGHT_TOKENS, [({"engine": "e1"}, 1)])


def test_it_exports_every_engine_family_even_when_idle() -> None:
    text = prometheus_text(MetricsRegistry(), {})
    for family in ("motor_engine_requests_total counter", "motor_engine_ttft_seconds histogram",
                   "motor_engine_tpot_seconds histogram", "motor_engine_in_flight_tokens gauge"):
        assert f"# TYPE {family}" in text
    assert "motor_engine_in_flight_tokens" not in prometheus_text(MetricsRegistry())  # no gauge asked for


def test_clearing_the_registry_clears_its_series() -> None:
    reg = MetricsRegistry(clock=Clock())
    reg.record_request("e1", 0.5, 0.1, ok=True)
    reg.clear()
    reg.record_request("e2", 0.5, 0.1, ok=True)
    text = prometheus_text(reg)
    assert 'instance="e1"' not in text and 'motor_engine_requests_total{instance="e2"} 1.0' in text
