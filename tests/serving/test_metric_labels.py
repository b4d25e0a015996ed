"""/metrics label values come from fixed sets: nothing a client sends can mint a series.

Through the whole ASGI application: a request whose body carries field names of the client's
choosing takes the native path (render down, the local fallback cannot build those fields), and
every label value /metrics then shows is one its family declares (``metric_names``).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, AsyncIterator

import httpx
import pytest

from catalog.models import RenderConfig, ServedModel
from fleet.models import EngineInstance
from serving import runtime, snapshots
from serving.pipeline import metric_names
from serving.pipeline.exporter import Families, exposition, scraped
from serving.pipeline.metric_names import FAMILIES, MODEL_LABEL, OPERATOR_LABELS, OTHER, Family
from serving.pipeline.metrics import RouterCounters
from serving.pipeline.phases import Histograms
from tests.serving.fakes import ENGINE_URLS, MODEL, FakeUpstreams
from tests.serving.loopback import LoopbackClient

pytestmark = pytest.mark.django_db(transaction=True)

INVENTED = ("zq_invented_field", "x-motor-label-probe")
_SERIES = re.compile(r'^(\w+)\{(.*)\} \S+$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def native_chat(request: httpx.Request) -> httpx.Response:
    """An engine's own OpenAI API answering a chat completion."""
    return httpx.Response(200, json={
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    })


@pytest.fixture
def fleet(transactional_db: None, settings: Any) -> None:
    """Two engines with their own OpenAI API, /v1 open."""
    settings.MOTOR_OPEN_ACCESS = True
    settings.MOTOR_API_KEYS = []
    model = ServedModel.objects.create(name=MODEL, model_path="/models/tiny", max_model_len=2048, vocab_size=151936)
    RenderConfig.objects.create(host="render.test", port=8100, timeout_ms=5000)
    for name, url in ENGINE_URLS.items():
        EngineInstance.objects.create(name=name, url=url, served_model=model, cap_native_openai=True)


@pytest.fixture
async def served(
    fleet: None, upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch, mock_client: LoopbackClient
) -> AsyncIterator[FakeUpstreams]:
    """The fleet behind fake upstreams, render down; ends by asserting nothing leaked."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/render"):
            raise httpx.ConnectError("connection refused", request=request)  # render is down
        if request.url.path == "/v1/chat/completions":
            return native_chat(request)
        return await upstreams.handler(request)

    mock_client.loopback.handler = handler  # the production client; these engines on 127.0.0.1
    monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: mock_client)
    snapshots.invalidate()
    before = asyncio.all_tasks()
    yield upstreams
    snapshots.invalidate()
    await mock_client.aclose()  # settles, then closes the loopback's connections and their tasks
    assert runtime.load.snapshot() == {} and runtime.inflight_tokens() == {}
    assert asyncio.all_tasks() - {asyncio.current_task()} <= before


def unknown_label_values(text: str) -> list[str]:
    """Every ``family label=value`` in ``text`` whose value its family does not declare."""
    found = []
    for line in text.splitlines():
        match = _SERIES.match(line)
        if match is None:
            continue
        name = match.group(1)
        family = FAMILIES.get(name) or FAMILIES[
            name.removesuffix("_sum").removesuffix("_count").removesuffix("_bucket")
        ]
        for label, value in _LABEL.findall(match.group(2)):
            if label in OPERATOR_LABELS or (label == "le" and name.endswith("_bucket")):
                continue
            if label == MODEL_LABEL:
                if value not in (OTHER, MODEL):  # the one served model of this fleet
                    found.append(f"{name} {label}={value}")
                continue
            if value != OTHER and value not in family.values[label]:
                found.append(f"{name} {label}={value}")
    return found


async def test_it_shows_only_declared_label_values_after_bodies_with_invented_field_names(
    v1: httpx.AsyncClient, served: FakeUpstreams,
) -> None:
    runtime.counters.clear()
    for field in INVENTED:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, field: {"a": 1}}
        response = await v1.post("/v1/chat/completions", json=body)
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "hi"

    # A model the fleet does not serve is the client's 404, and no series of its name.
    unknown = await v1.post("/v1/chat/completions", json={"model": "zq-unserved-model", "messages": [
        {"role": "user", "content": "hi"}], "max_tokens": 3})
    assert unknown.status_code == 404
    text = (await v1.get("/metrics")).text
    assert "zq-unserved-model" not in text
    assert f'motor_route_decisions_total{{model="{MODEL}",path="native",reason="local:param"}} 2.0' in text
    assert not any(field in text for field in INVENTED)
    assert unknown_label_values(text) == []


def test_it_records_a_value_outside_its_labels_set_as_other() -> None:
    counters = RouterCounters()
    counters.inc(metric_names.ROUTE_DECISIONS, model="tiny", path="native", reason="local:param:zq_invented_field")
    counters.inc(metric_names.ROUTE_DECISIONS, model="tiny", path="native", reason='a"b\nc')
    counters.inc(metric_names.ROUTE_DECISIONS, model="tiny", path="native", reason="echo")
    counters.inc(metric_names.ROUTE_DECISIONS, model=OTHER, path="native", reason="echo")
    assert counters.snapshot() == {
        ("motor_route_decisions_total", (("model", "tiny"), ("path", "native"), ("reason", OTHER))): 2,
        ("motor_route_decisions_total", (("model", "tiny"), ("path", "native"), ("reason", "echo"))): 1,
        ("motor_route_decisions_total", (("model", OTHER), ("path", "native"), ("reason", "echo"))): 1,
    }
    assert counters.get(metric_names.ROUTE_DECISIONS, reason="echo") == 2  # summed over the labels not given


def test_the_exposition_folds_series_read_at_scrape_time_into_other() -> None:
    relays = scraped(metric_names.STREAM_RELAYS, [
        ({"model": "tiny", "reason": "stall", "topology": "zq"}, 1.0),
        ({"model": "tiny", "reason": "stall", "topology": "zz"}, 2.0),
    ])
    lines = exposition(Families([relays])).decode().splitlines()
    assert lines[2:] == ['motor_stream_relays_total{model="tiny",reason="stall",topology="other"} 3.0']


def test_a_histogram_records_a_value_outside_its_labels_set_as_other() -> None:
    h = Histograms()
    h.observe(metric_names.PHASE_RENDER, 0.01, {"model": "tiny", "api": "zq_invented", "mode": "json", "source": "render"})
    h.observe(metric_names.PHASE_RENDER, 0.01, {"model": "tiny", "api": "chat", "mode": "json", "source": "render"})
    text = exposition(h.registry).decode()
    assert 'motor_request_render_seconds_count{api="other",mode="json",model="tiny",source="render"} 1.0' in text
    assert "zq_invented" not in text and unknown_label_values(text) == []


def test_a_family_with_an_undeclared_label_set_fails_at_import() -> None:
    with pytest.raises(ValueError, match="declare the values"):
        Family("motor_example_total", "counter", "An example.", ("phase",))
    with pytest.raises(ValueError, match="declare the values"):
        Family("motor_example_total", "counter", "An example.", ("instance",), {"phase": frozenset({"a"})})
    Family("motor_example_total", "counter", "An example.", ("instance", "phase"), {"phase": frozenset({"a"})})


@pytest.mark.parametrize("family", sorted(FAMILIES), ids=str)
def test_every_family_bounds_every_label(family: str) -> None:
    f = FAMILIES[family]
    for label in f.labels:
        # ``model``'s set is the served models of the request's snapshot (metric_names.MODEL_LABEL).
        assert label in OPERATOR_LABELS or label == MODEL_LABEL or (
            f.values[label] and OTHER not in f.values[label]), (family, label)
