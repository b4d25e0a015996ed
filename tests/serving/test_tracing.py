"""OpenTelemetry traces of a request's phases (``serving/pipeline/tracing.py``, ``MOTOR_TRACING``).

The pipeline runs on the fake upstreams with the phase tests' injected clock (render 2^-8 s, a
generate leg 2^-4 s, a derender call 2^-9 s), so every span's duration is exact. Spans go to the
SDK's in-memory exporter, or, through the whole ASGI application, over OTLP/HTTP to a receiver on
127.0.0.1 that decodes what the real exporter sends.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from serving import snapshots
from serving.pipeline import metric_names as names
from serving.pipeline import tracing
from serving.pipeline.errors import EngineError
from serving.pipeline.phases import Histograms, Phases
from serving.pipeline.request_context import RequestContext
from tests.otlp import Receiver
from tests.serving.fakes import MODEL, FakeUpstreams
from tests.serving.router_fakes import Rig, chat_body
from tests.serving.test_phases import DERENDER_S, GENERATE_S, RENDER_S, Clock, timed

ROOT = Path(__file__).resolve().parents[2]
PHASE_SPANS = {"render", "queue_wait", "placement", "first_chunk", "first_derender"}


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exporter: InMemorySpanExporter) -> Iterator[tracing.PhaseTracer]:
    t = tracing.configure(replica="coordinator-a", processor=SimpleSpanProcessor(exporter))
    yield t
    t.shutdown()


@pytest.fixture
def clock(upstreams: FakeUpstreams) -> Clock:
    c = Clock()
    timed(upstreams, c)
    return c


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    found = {s.name: s for s in spans}
    assert len(found) == len(spans), [s.name for s in spans]  # one span per phase of a one-leg request
    return found


def duration_s(span: ReadableSpan) -> float:
    assert span.start_time is not None and span.end_time is not None
    return (span.end_time - span.start_time) / 1e9


async def test_each_phase_of_a_request_is_a_span_under_its_root(
    rig: Rig, clock: Clock, tracer: tracing.PhaseTracer, exporter: InMemorySpanExporter
) -> None:
    h = Histograms(clock=clock)
    phases = Phases.begin(h, "chat", chat_body(), clock(), tracer=tracer, request_id="req-1")
    await rig.pipeline().chat(chat_body(max_tokens=3), "req-1", phases)
    assert exporter.get_finished_spans() and "request" not in by_name(exporter.get_finished_spans())
    phases.observe(names.PHASE_END_TO_END, phases.start)

    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == PHASE_SPANS | {"request"}
    root = spans.pop("request")
    assert root.parent is None and root.context is not None
    for span in spans.values():
        assert span.parent is not None and span.parent.span_id == root.context.span_id, span.name
        assert span.context is not None and span.context.trace_id == root.context.trace_id
        assert span.attributes is not None and span.attributes["motor.request_id"] == "req-1"
        assert span.attributes["motor.api"] == "chat" and span.attributes["motor.mode"] == "json"
    # The times the histograms count, exactly (binary fractions on the injected clock).
    assert duration_s(spans["render"]) == RENDER_S
    assert duration_s(spans["first_chunk"]) == GENERATE_S
    assert duration_s(spans["first_derender"]) == DERENDER_S
    assert duration_s(spans["placement"]) == duration_s(spans["queue_wait"]) == 0.0
    assert duration_s(root) == clock.now - 100.0 == RENDER_S + GENERATE_S + DERENDER_S
    assert spans["first_chunk"].attributes is not None and spans["first_chunk"].attributes["motor.leg"] == "union"
    assert root.attributes is not None and root.attributes["motor.request_id"] == "req-1"
    assert root.attributes["motor.topology"] == "union"  # the end-to-end phase's labels
    assert root.resource.attributes["service.instance.id"] == "coordinator-a"
    assert root.resource.attributes["service.name"] == tracing.SERVICE_NAME
    # Its histogram got the same observations: one hook, two records.
    assert h.samples()[(names.PHASE_RENDER.name + "_count",
                        (("api", "chat"), ("mode", "json"), ("model", names.OTHER), ("source", "render")))] == 1.0


def test_a_request_that_failed_ends_its_root_span_with_the_error_once(
    tracer: tracing.PhaseTracer, exporter: InMemorySpanExporter
) -> None:
    clock = Clock()
    phases = Phases.begin(Histograms(clock=clock), "completions", {"stream": True}, clock(), tracer=tracer, request_id="r2")
    clock.now += 0.5
    phases.close(EngineError("both engines failed", instance="e1"))
    phases.close()  # the edge's own close after an answered failure: nothing more
    phases.observe(names.PHASE_END_TO_END, phases.start)  # nor a late end-to-end
    [root] = exporter.get_finished_spans()
    assert root.name == "request" and root.status.status_code is StatusCode.ERROR
    assert root.attributes is not None and root.attributes["error.type"] == "EngineError"
    assert root.attributes["motor.mode"] == "stream" and duration_s(root) == 0.5


def test_no_tracer_no_trace() -> None:
    phases = Phases.begin(Histograms(), "chat", {}, 0.0, tracer=None, request_id="r3")
    assert phases.trace is None
    phases.close(EngineError("x", instance="e1"))  # nothing to end


def _modules_after(code: str, **env: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(m for m in sys.modules if m.startswith('opentelemetry'))))"],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "DJANGO_SETTINGS_MODULE": "motorsite.settings", **env},
        check=True,
    )
    return set(out.stdout.split())


# What only tracing loads. (redis-py imports OpenTelemetry's metrics API and SDK by itself whenever
# they are installed, for its own optional metrics; neither starts anything unless configured.)
TRACING_MODULES = {"opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"}


def test_off_by_default_the_process_never_loads_the_tracing_sdk_or_exporter() -> None:
    boot = "import django\ndjango.setup()\nimport serving.runtime, serving.edge.openai_api\n"
    env = {k: "" for k in ("MOTOR_TRACING", "REDIS_URL")}
    off = _modules_after(boot + "assert serving.runtime.tracer is None", **env)
    assert not off & TRACING_MODULES and not any(m.startswith("opentelemetry.exporter") for m in off)
    on = _modules_after(boot + "assert serving.runtime.tracer is not None", **{**env, "MOTOR_TRACING": "true"})
    assert TRACING_MODULES <= on


# -- over OTLP/HTTP, through the whole application ------------------------------------------------


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


async def test_a_request_through_the_application_is_exported_over_otlp_http(
    v1: httpx.AsyncClient, db_upstreams: FakeUpstreams, settings: Any, monkeypatch: pytest.MonkeyPatch,
    receiver: Receiver,
) -> None:
    settings.MOTOR_OPEN_ACCESS = True
    snapshots.invalidate()
    # The standard variables, as an operator sets them; configure() is what MOTOR_TRACING runs.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "motorsite-test")
    tracer = tracing.configure(replica="coordinator-b")
    monkeypatch.setattr("serving.edge.openai_api.tracer", tracer)
    try:
        answer = await v1.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                              "max_tokens": 3, "stream": True})
        assert answer.status_code == 200
        request_id = answer.headers["x-request-id"]
        refused = await v1.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                               "max_tokens": -1})
        assert refused.status_code == 400
        assert tracer.force_flush(10_000)
    finally:
        tracer.shutdown()
        snapshots.invalidate()
    assert set(receiver.paths) == {"/v1/traces"}
    received = receiver.spans()
    resources = {tuple(sorted(r.items())) for r, _ in received}
    assert len(resources) == 1
    [resource] = [dict(r) for r in resources]
    assert resource["service.name"] == "motorsite-test" and resource["service.instance.id"] == "coordinator-b"

    def attrs(span: Any) -> dict[str, str]:
        return {a.key: a.value.string_value for a in span.attributes}

    ours = [s for _, s in received if attrs(s).get("motor.request_id") == request_id]
    assert {s.name for s in ours} == PHASE_SPANS | {"request"}
    [root] = [s for s in ours if s.name == "request"]
    assert all(s.trace_id == root.trace_id for s in ours)
    assert all(s.parent_span_id == root.span_id for s in ours if s is not root)
    assert attrs(root)["motor.mode"] == "stream" and attrs(root)["motor.topology"] == "union"
    # The request refused before it reached the engines: a root of its own, marked failed.
    others = [s for _, s in received if attrs(s).get("motor.request_id") != request_id]
    assert [s.name for s in others] == ["request"] and others[0].status.code == 2  # STATUS_CODE_ERROR


# -- the client's trace headers (W3C Trace Context) ------------------------------------------------

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(("headers", "expected"), [
    ([(b"traceparent", TRACEPARENT.encode())], {"traceparent": TRACEPARENT}),
    ([(b"tracestate", b"a=1"), (b"traceparent", TRACEPARENT.encode())], {"traceparent": TRACEPARENT, "tracestate": "a=1"}),
    ([(b"tracestate", b"a=1")], None),  # a state without a parent means nothing
    ([], None),
    ([(b"traceparent", b"00-" + b"0" * 32 + b"-b7ad6b7169203331-01")], None),  # all-zero trace id
    ([(b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-" + b"0" * 16 + b"-01")], None),  # all-zero parent
    ([(b"traceparent", b"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")], None),  # version ff
    ([(b"traceparent", TRACEPARENT.encode() + b"-extra")], None),  # version 00 has four fields
    ([(b"traceparent", TRACEPARENT.upper().encode())], None),  # lower-case hex only
    ([(b"traceparent", TRACEPARENT.encode()), (b"tracestate", b"a=1\x7f")], {"traceparent": TRACEPARENT}),
])
def test_incoming_keeps_only_a_valid_w3c_trace_context(headers: list[tuple[bytes, bytes]], expected: Any) -> None:
    assert tracing.incoming(headers) == expected


async def test_a_carried_trace_reaches_every_call_of_the_request_and_no_other(rig: Rig, upstreams: FakeUpstreams) -> None:
    traced_request = RequestContext("req-t", trace={"traceparent": TRACEPARENT})
    await rig.pipeline().completions({"model": MODEL, "prompt": ["a", "b"], "max_tokens": 3}, traced_request)
    await rig.pipeline().completions({"model": MODEL, "prompt": "c", "max_tokens": 3}, "req-u")
    traced = [c for c in upstreams.calls if c.headers.get("traceparent") == TRACEPARENT]
    # Both prompts' generate calls (concurrent tasks of the request) and its render and derender.
    assert sorted(c.kind for c in traced) == ["derender", "generate", "generate", "render"]
    assert all("traceparent" not in c.headers for c in upstreams.calls if c not in traced)
