"""A client's trace continues through the coordinator to the render sidecar and the engines.

Through the real server: a coordinator under Daphne, as ``make run`` starts it, over the fake
sidecar and engines on 127.0.0.1 (``served.py``), which record the W3C trace headers of every call
they get, as vLLM reads them (``traceparent``, ``tracestate``). The client is the official
``openai`` SDK sending its own ``traceparent``. With ``MOTOR_TRACING`` on, the coordinator exports
its spans over OTLP/HTTP to a receiver on 127.0.0.1 (``tests/otlp.py``): its root span is the
client span's child, and every render, generate and derender call names that root span as its
parent, in the client's trace. With tracing off, the client's headers reach every call unchanged
(the engines' own traces join the client's), and a request that brought none sends none.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.otlp import Receiver
from tests.serving.fakes import MODEL
from tests.serving.served import API_KEY, Fleet, fake_fleet

TRACESTATE = "vendor1=opaque,vendor2=x"
# What each request reaches: render, the engine's generate, derender (JSON and streamed).
CALLS = {"/v1/chat/completions/render", "/inference/v1/generate", "/v1/chat/completions/derender"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fake_fleet(tmp_path_factory.mktemp("traces"), tokens=4) as f:
        yield f


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced(fleet: Fleet, receiver: Receiver) -> Iterator[str]:
    """A coordinator with tracing on, exporting to ``receiver``; yields its URL. Shared by the JSON
    and the streaming case: each reads only the calls and spans of its own fresh trace ids."""
    env = {"MOTOR_TRACING": "true", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
           "OTEL_BSP_SCHEDULE_DELAY": "50"}
    with fleet.coordinator("daphne", env) as (cfg, _pid):
        yield cfg.coordinator_url


def client_trace() -> tuple[str, str, str]:
    """A client span of a fresh trace: (trace id, span id, its traceparent)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def ask(base_url: str, headers: dict[str, str], *, stream: bool) -> str:
    """One chat through the coordinator with the openai SDK; returns its X-Request-Id."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, default_headers=headers)
    with client:
        messages: Any = [{"role": "user", "content": "hi"}]
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4,
                                                               stream=stream)
        answer = raw.parse()
        if stream:
            text = "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)
        else:
            text = answer.choices[0].message.content or ""
        assert text
        return raw.headers["x-request-id"]


def calls_since(fleet: Fleet, seq: int) -> list[dict[str, Any]]:
    return [c for c in fleet.stats()["traced"] if c["seq"] >= seq]


def next_seq(fleet: Fleet) -> int:
    traced = fleet.stats()["traced"]
    return traced[-1]["seq"] + 1 if traced else 0


def parent_of(call: dict[str, Any]) -> tuple[str, str, bool]:
    """(trace id, parent span id, sampled) of a call's ``traceparent``."""
    _version, trace_id, span_id, flags = call["traceparent"].split("-")
    return trace_id, span_id, bool(int(flags, 16) & 1)


def of_trace(calls: list[dict[str, Any]], trace_id: str) -> list[dict[str, Any]]:
    return [c for c in calls if c["traceparent"] and c["traceparent"].split("-")[1] == trace_id]


def root_span(receiver: Receiver, request_id: str) -> Any:
    """The coordinator's ``request`` span of ``request_id``, once the batch exporter sent it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        roots = [s for _, s in receiver.spans()
                 if s.name == "request" and receiver.attributes(s).get("motor.request_id") == request_id]
        if roots:
            [root] = roots
            return root
        time.sleep(0.05)
    raise AssertionError(f"no root span of {request_id} reached the receiver")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_with_tracing_on_every_upstream_call_continues_the_clients_trace_under_the_coordinators_span(
    fleet: Fleet, receiver: Receiver, traced: str, stream: bool
) -> None:
    trace_id, span_id, traceparent = client_trace()
    seq = next_seq(fleet)
    request_id = ask(traced, {"traceparent": traceparent, "tracestate": TRACESTATE}, stream=stream)
    calls = calls_since(fleet, seq)
    root = root_span(receiver, request_id)
    # A request that brought no trace starts one at the coordinator, carried the same way.
    seq = next_seq(fleet)
    fresh_id = ask(traced, {}, stream=stream)
    fresh_calls = calls_since(fleet, seq)
    fresh_root = root_span(receiver, fresh_id)

    assert root.trace_id.hex() == trace_id and root.parent_span_id.hex() == span_id
    ours = of_trace(calls, trace_id)
    assert {c["path"] for c in ours} == CALLS
    assert [c for c in calls if c["path"] in CALLS] == ours  # not one call without the trace
    for call in ours:
        assert call["traceparent"] == f"00-{trace_id}-{root.span_id.hex()}-01", call
        assert call["tracestate"] == TRACESTATE  # the client's vendors' state travels on

    assert fresh_root.parent_span_id == b"" and fresh_root.trace_id.hex() != trace_id
    fresh = [c for c in fresh_calls if c["path"] in CALLS]
    assert {c["path"] for c in fresh} == CALLS
    assert all(parent_of(c) == (fresh_root.trace_id.hex(), fresh_root.span_id.hex(), True)
               and c["tracestate"] is None for c in fresh), fresh


def test_with_tracing_off_the_clients_trace_headers_reach_every_call_unchanged(fleet: Fleet) -> None:
    with fleet.coordinator("daphne", {"MOTOR_TRACING": "false"}) as (cfg, _pid):
        trace_id, _span_id, traceparent = client_trace()
        seq = next_seq(fleet)
        for stream in (False, True):
            ask(cfg.coordinator_url, {"traceparent": traceparent, "tracestate": TRACESTATE}, stream=stream)
        calls = [c for c in calls_since(fleet, seq) if c["path"] in CALLS]
        seq = next_seq(fleet)
        ask(cfg.coordinator_url, {}, stream=True)
        # A malformed traceparent is no trace: dropped, not forwarded.
        ask(cfg.coordinator_url, {"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01"}, stream=False)
        untraced = [c for c in calls_since(fleet, seq) if c["path"] in CALLS]

    assert {c["path"] for c in calls} == CALLS and len(calls) >= 6
    assert all(c["traceparent"] == traceparent and c["tracestate"] == TRACESTATE for c in calls), calls
    assert of_trace(calls, trace_id) == calls
    assert {c["path"] for c in untraced} == CALLS
    assert all(c["traceparent"] is None and c["tracestate"] is None for c in untraced), untraced
