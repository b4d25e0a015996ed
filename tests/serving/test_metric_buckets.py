"""Each histogram's buckets resolve the latencies bench/RESULTS.md reports (docs/metrics.md, "Buckets"),
and each reading the doc names is one RESULTS.md reports."""

from __future__ import annotations

import bisect
import re
from pathlib import Path

import pytest

from serving.pipeline import metric_names as names

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
RESULTS = ROOT / "bench" / "RESULTS.md"
ROW = re.compile(r"^\| `([A-Z_]+)` \| [^|]* \| ([\d.]+) \| ([\d.]+) \| ([\d., ]+) \|$")
BUCKETS = {
    "PHASE_BUCKETS": names.PHASE_BUCKETS, "TTFT_BUCKETS": names.TTFT_BUCKETS,
    "TPOT_BUCKETS": names.TPOT_BUCKETS, "END_TO_END_BUCKETS": names.END_TO_END_BUCKETS,
}
RESOLUTION = 2.5  # the widest ratio of the two bounds around a reading


def documented() -> dict[str, tuple[float, float, list[float]]]:
    """The doc's table: bucket set -> (first bound, last bound, readings), all in seconds."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            readings = [float(v) / 1000 for v in m.group(4).split(",")]
            rows[m.group(1)] = (float(m.group(2)) / 1000, float(m.group(3)) / 1000, readings)
    return rows


def test_the_doc_lists_every_bucket_set_with_its_range() -> None:
    rows = documented()
    assert rows.keys() == BUCKETS.keys()
    for name, (first, last, _) in rows.items():
        assert (first, last) == pytest.approx((BUCKETS[name][0], BUCKETS[name][-1])), name


def _printed(number: str, text: str) -> bool:
    """Whether ``text`` prints ``number`` as a number of its own (not a piece of a longer one)."""
    return re.search(rf"(?<![\d.]){re.escape(number)}(?!\d)", text) is not None


def test_every_reading_is_a_number_results_md_reports() -> None:
    results = RESULTS.read_text()
    unreported = []
    for name, (_, _, readings) in documented().items():
        for seconds in readings:
            ms, us = seconds * 1000, seconds * 1_000_000
            # In milliseconds as the table writes it, with or without a trailing zero, or in µs.
            forms = {f"{ms:g}", f"{ms:.2f}", f"{us:g}"}
            if not any(_printed(form, results) for form in forms):
                unreported.append(f"{name}: {ms:g} ms")
    assert not unreported, f"docs/metrics.md's readings that bench/RESULTS.md does not report: {unreported}"


@pytest.mark.parametrize("name", sorted(BUCKETS))
def test_every_reading_falls_between_two_close_bounds(name: str) -> None:
    bounds = BUCKETS[name]
    for reading in documented()[name][2]:
        i = bisect.bisect_left(bounds, reading)
        assert 0 < i < len(bounds), f"{name}: {reading * 1000} ms is outside its bounds"
        assert bounds[i] / bounds[i - 1] <= RESOLUTION, f"{name}: {reading * 1000} ms lies in too wide a bucket"


def test_every_timing_family_uses_its_bucket_set() -> None:
    assert names.ENGINE_TTFT.buckets == names.TTFT_BUCKETS
    assert names.ENGINE_TPOT.buckets == names.TPOT_BUCKETS
    assert names.PHASE_END_TO_END.buckets == names.END_TO_END_BUCKETS
    assert all(f.buckets == names.PHASE_BUCKETS for f in names.PHASES if f is not names.PHASE_END_TO_END)


def test_a_histogram_without_increasing_buckets_fails_at_import() -> None:
    with pytest.raises(ValueError, match="increasing buckets"):
        names.Family("motor_example_seconds", "histogram", "An example.")
    with pytest.raises(ValueError, match="increasing buckets"):
        names.Family("motor_example_seconds", "histogram", "An example.", buckets=(0.1, 0.05))
    with pytest.raises(ValueError, match="increasing buckets"):
        names.Family("motor_example_total", "counter", "An example.", buckets=(0.1,))
    names.Family("motor_example_seconds", "histogram", "An example.", buckets=(0.05, 0.1))
