"""/metrics through the real server: latency histograms whose buckets add up, and a quantile from them.

Daphne, as ``make run`` starts it (and uvicorn, its other server: one process either way, so one
registry answers every scrape), over the fake upstreams on 127.0.0.1 (``served.py``); the
official ``openai`` client sends streamed and JSON chat completions, then ``/metrics`` is read
over a socket and parsed with ``prometheus_client``'s own parser.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from serving.pipeline import metric_names as names
from tests.serving.served import API_KEY, Fleet, fake_fleet

TOKENS = 8
STREAMS, JSONS = 3, 2
Series = dict[str, float]  # one label set's samples: "_bucket:<le>", "_sum", "_count"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fake_fleet(tmp_path_factory.mktemp("metrics"), tokens=TOKENS) as f:
        yield f


def histograms(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], Series]]:
    """Every histogram family in ``text``: its series by label set (``le`` left out)."""
    out: dict[str, dict[tuple[tuple[str, str], ...], Series]] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        series: dict[tuple[tuple[str, str], ...], Series] = defaultdict(dict)
        for s in family.samples:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            suffix = s.name.removeprefix(family.name)
            series[key][f"{suffix}:{s.labels['le']}" if suffix == "_bucket" else suffix] = s.value
        out[family.name] = dict(series)
    return out


def buckets(series: Series) -> list[tuple[float, float]]:
    """``(upper bound, cumulative count)`` of each bucket, by bound."""
    return sorted((float(k.split(":", 1)[1]), v) for k, v in series.items() if k.startswith("_bucket:"))


def quantile(q: float, series: Series) -> float:
    """Prometheus' ``histogram_quantile``: linear within the bucket the rank falls in."""
    bounds = buckets(series)
    total = bounds[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in bounds:
        if count >= rank:
            if math.isinf(upper):
                return lower  # above the last finite bound: Prometheus answers that bound
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    raise AssertionError("the +Inf bucket holds every observation")


@pytest.mark.parametrize("server", ["daphne", "uvicorn"])
def test_metrics_serves_ttft_tpot_duration_and_each_phase_as_histograms_that_add_up(fleet: Fleet, server: str) -> None:
    with fleet.coordinator(server) as (cfg, _pid):
        client = openai.OpenAI(base_url=cfg.coordinator_url + "/v1", api_key=API_KEY, max_retries=0)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        for _ in range(STREAMS):
            with client.chat.completions.create(model="tiny", messages=messages, max_tokens=TOKENS, stream=True) as stream:
                assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        for _ in range(JSONS):
            answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=TOKENS)
            assert answer.choices[0].message.content
        response = httpx.get(cfg.coordinator_url + "/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    assert "_created" not in response.text and "python_gc_" not in response.text  # docs/metrics.md: neither
    found = histograms(response.text)

    timed = (names.ENGINE_TTFT, names.ENGINE_TPOT, *names.PHASES)
    assert {f.name for f in timed} <= found.keys(), sorted(found)
    for family in timed:
        for labels, series in found[family.name].items():
            bounds = buckets(series)
            # Every declared bound, then +Inf; cumulative, so counts never fall; +Inf is _count.
            assert [b for b, _ in bounds] == [*family.buckets, math.inf], (family.name, labels)
            assert all(a[1] <= b[1] for a, b in zip(bounds, bounds[1:], strict=False)), (family.name, labels)
            assert bounds[-1][1] == series["_count"], (family.name, labels)
            assert series["_sum"] >= 0

    def count(family: names.Family, **match: str) -> float:
        return sum(s["_count"] for labels, s in found[family.name].items() if set(match.items()) <= set(labels))

    # One engine request per chat: each has a TTFT; a stream of several tokens also a TPOT.
    assert count(names.ENGINE_TTFT) == STREAMS + JSONS
    assert count(names.ENGINE_TPOT) == STREAMS
    assert count(names.PHASE_END_TO_END, api="chat", mode="stream") == STREAMS
    assert count(names.PHASE_END_TO_END, api="chat", mode="json") == JSONS
    assert count(names.PHASE_RENDER) == STREAMS + JSONS

    for family in (names.ENGINE_TTFT, names.ENGINE_TPOT, names.PHASE_END_TO_END):
        for series in found[family.name].values():
            p50, p99 = quantile(0.5, series), quantile(0.99, series)
            assert 0 < p50 <= p99 <= family.buckets[-1], family.name
