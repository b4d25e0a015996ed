"""The benchmarks' TTFT split: read from /metrics text, differenced per cell, one table row per cell."""

from __future__ import annotations

from bench.phase_split import END_TO_END, PhaseSplit, table, totals
from serving.pipeline import metric_names as names
from serving.pipeline.exporter import exposition
from serving.pipeline.phases import Histograms


def metrics_text(h: Histograms) -> str:
    return exposition(h.registry).decode()


def observe(h: Histograms, family: names.Family, seconds: float, **extra: str) -> None:
    h.observe(family, seconds, {k: v for k, v in {"model": "tiny", "api": "chat", "mode": "stream", "topology": "union", **extra}.items()
                                if k in family.labels})


def test_it_adds_up_every_series_of_a_phase_and_divides_by_the_requests_answered() -> None:
    h = Histograms()
    observe(h, names.PHASE_RENDER, 0.5, source="render")  # before the cell: not counted
    observe(h, names.PHASE_END_TO_END, 9.0)
    before = totals(metrics_text(h))
    for topology in ("union", "handoff"):
        observe(h, names.PHASE_RENDER, 0.25, source="local" if topology == "handoff" else "render")
        observe(h, names.PHASE_QUEUE_WAIT, 0.125, topology=topology)
        observe(h, names.PHASE_FIRST_CHUNK, 1.0, topology=topology, leg="union")
        observe(h, names.PHASE_END_TO_END, 2.0, topology=topology)
    observe(h, names.PHASE_QUEUE_WAIT, 0.125, topology="handoff")  # P/D's second wait adds to its request
    split = PhaseSplit()
    split.add(before, totals(metrics_text(h)))
    assert split.requests == 2
    assert split.mean_ms(names.PHASE_RENDER.name) == 250.0
    assert split.mean_ms(names.PHASE_QUEUE_WAIT.name) == 187.5
    assert split.mean_ms(names.PHASE_PLACEMENT.name) == 0.0  # declared, never observed
    assert split.mean_ms(END_TO_END) == 2000.0
    row = table("path", [("d", split, [1.5, 2.5, None])]).splitlines()[-1]
    assert row == "| d | 250.00 | 187.50 | 0.00 | 1000.00 | 0.00 | 1437.50 | 2000.00 | 2000.00 |"


def test_a_cell_without_requests_has_no_split() -> None:
    split = PhaseSplit()
    assert split.requests == 0 and split.mean_ms(END_TO_END) is None
    assert table("path", [("b", split, [])]).splitlines()[-1].startswith("| b | – |")
