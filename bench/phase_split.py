"""motorsite's TTFT split into its phases, from the coordinator's own ``/metrics``.

A benchmark reads ``/metrics`` before and after a cell (``scrape``), and ``PhaseSplit.add``
keeps the differences of each phase histogram's ``_sum`` and ``_count`` (every series of a family
added up). The split is the mean per request: a phase's seconds over the cell divided by the
requests the cell answered (``motor_request_duration_seconds_count``), so phases that happen twice
in a request (P/D's two admission waits and two legs) add up as they do in its TTFT. What the
phases do not cover (the edge, SSE framing, the client's side, the event loop's queueing) is the
rest of the client's TTFT.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from serving.pipeline import metric_names as names

# The phases before a stream's first token, in the order a request passes them.
TTFT_PHASES: tuple[tuple[str, str], ...] = (
    ("render", names.PHASE_RENDER.name),
    ("queue wait", names.PHASE_QUEUE_WAIT.name),
    ("placement", names.PHASE_PLACEMENT.name),
    ("first chunk", names.PHASE_FIRST_CHUNK.name),
    ("first derender", names.PHASE_FIRST_DERENDER.name),
)
END_TO_END = names.PHASE_END_TO_END.name
FAMILIES = frozenset([f for _, f in TTFT_PHASES] + [END_TO_END])

Totals = dict[str, tuple[float, float]]  # family -> (sum, count), over all its series


def totals(text: str) -> Totals:
    """Each phase family's ``_sum`` and ``_count`` in Prometheus text, summed over label sets."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        for suffix, slot in (("_sum", 0), ("_count", 1)):
            family = name.removesuffix(suffix)
            if family != name and family in FAMILIES:
                out.setdefault(family, [0.0, 0.0])[slot] += float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


async def scrape(client: httpx.AsyncClient, base_url: str) -> Totals:
    """The coordinator's phase totals now (``GET <base_url>/metrics``)."""
    response = await client.get(f"{base_url}/metrics")
    response.raise_for_status()
    return totals(response.text)


@dataclass
class PhaseSplit:
    """Phase seconds and observations over the cells added so far."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)

    def add(self, before: Totals, after: Totals) -> None:
        for family, (s, n) in after.items():
            s0, n0 = before.get(family, (0.0, 0.0))
            self.sums[family] = self.sums.get(family, 0.0) + s - s0
            self.counts[family] = self.counts.get(family, 0.0) + n - n0

    @property
    def requests(self) -> int:
        return int(self.counts.get(END_TO_END, 0))

    def mean_ms(self, family: str) -> float | None:
        """Mean milliseconds per request of ``family``; None before any request."""
        return self.sums.get(family, 0.0) * 1000 / self.requests if self.requests else None


def table(lead: str, rows: list[tuple[str, PhaseSplit, list[float | None]]]) -> str:
    """A Markdown table of phase splits: ``lead`` names the leading columns of each row (``"mode | c | path"``),
    then each phase's mean ms per request, their sum, the client's mean TTFT (from the row's TTFTs, in
    seconds; JSON rows have none) and the coordinator's end to end."""
    labels = [label for label, _ in TTFT_PHASES]
    lines = [
        "motorsite's TTFT split into phases (mean ms per request, from its /metrics `_sum`/`_count` deltas over "
        "the measured runs; JSON: first chunk is the whole answer, first derender the whole derender; the rest of "
        "the client's TTFT is the edge, framing, the event loop and the client):",
        "",
        f"| {lead} | " + " | ".join(labels) + " | phases | client TTFT mean | coordinator E2E mean |",
        "|" + "---|" * (lead.count("|") + 1) + "---:|" * (len(labels) + 3),
    ]
    for cells, split, ttfts in rows:
        if not split.requests:
            lines.append(f"| {cells} | " + " | ".join("–" for _ in labels) + " | – | – | – |")
            continue
        means = [split.mean_ms(family) or 0.0 for _, family in TTFT_PHASES]
        got = [t for t in ttfts if t is not None]
        client = f"{sum(got) * 1000 / len(got):.2f}" if got else "–"
        lines.append(
            f"| {cells} | " + " | ".join(f"{m:.2f}" for m in means)
            + f" | {sum(means):.2f} | {client} | {split.mean_ms(END_TO_END) or 0.0:.2f} |"
        )
    return "\n".join(lines) + "\n"
