"""The per-phase latency histograms: the store, its Prometheus text, and each hook of the pipeline.

The pipeline's hooks are timed with an injected clock that only the fake upstreams move: render
takes 2^-8 s, a generate leg 2^-4 s before its answer or first event, a derender call 2^-9 s, an
admission wait 2^-2 s. Binary fractions, so every sum is exact.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from serving.pipeline import metric_names as names
from serving.pipeline.exporter import exposition
from serving.pipeline.flow_control.admission import AdmissionSettings, Lease, LeaseGroup, TokenAdmission
from serving.pipeline.phases import Histograms, Phases
from serving.pipeline.placement.scheduler import Placement
from serving.pipeline.response import Response
from serving.pipeline.service import EventStream
from serving.pipeline.snapshot import InstanceView
from tests.serving.fakes import FakeUpstreams
from tests.serving.router_fakes import Rig, assert_no_leaks, chat_body, engine, make_rig, snapshot_with

RENDER_S, GENERATE_S, DERENDER_S, WAIT_S = 2**-8, 2**-4, 2**-9, 2**-2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sums(h: Histograms, family: names.Family) -> dict[tuple[tuple[str, str], ...], tuple[float, float]]:
    """(sum, count) of each series of ``family``, by its labels."""
    samples = h.samples()
    return {
        labels: (value, samples[(family.name + "_count", labels)])
        for (name, labels), value in samples.items() if name == family.name + "_sum"
    }


def labels(**kv: str) -> tuple[tuple[str, str], ...]:
    # A recorder begun without the edge's resolved model (these drive the pipeline directly) says other.
    return tuple(sorted({"model": names.OTHER, **kv}.items()))


# -- the store ---------------------------------------------------------------------------------


def test_it_counts_cumulative_buckets_with_an_exact_sum_and_count() -> None:
    h = Histograms()
    for seconds in (0.0005, 0.001, 0.2, 31.0):
        h.observe(names.PHASE_PLACEMENT, seconds, {"model": "tiny", "api": "chat", "mode": "json", "topology": "union"})
    samples = h.samples()
    key = labels(api="chat", mode="json", model="tiny", topology="union")
    bucket = {le: samples[(names.PHASE_PLACEMENT.name + "_bucket", (*key, ("le", le)))]
              for le in [repr(b) for b in names.PHASE_PLACEMENT.buckets] + ["+Inf"]}
    assert bucket["0.0005"] == 1.0 and bucket["0.001"] == 2.0  # le is inclusive: 1 ms is in the 1 ms bucket
    assert bucket["0.1"] == 2.0 and bucket["0.25"] == 3.0 and bucket["30.0"] == 3.0 and bucket["60.0"] == 4.0
    assert bucket["+Inf"] == 4.0
    assert samples[(names.PHASE_PLACEMENT.name + "_sum", key)] == 0.0005 + 0.001 + 0.2 + 31.0
    assert samples[(names.PHASE_PLACEMENT.name + "_count", key)] == 4.0


def test_it_refuses_labels_the_family_does_not_declare() -> None:
    with pytest.raises(ValueError, match="takes labels"):
        Histograms().observe(names.PHASE_RENDER, 0.1, {"api": "chat", "mode": "json"})


def test_its_text_has_one_header_and_buckets_in_increasing_le() -> None:
    h = Histograms()
    h.observe(names.PHASE_RENDER, 0.003, {"model": "tiny", "api": "chat", "mode": "stream", "source": "render"})
    h.observe(names.PHASE_RENDER, 12.0, {"model": "tiny", "api": "completions", "mode": "json", "source": "local"})
    lines = exposition(h.registry).decode().splitlines()
    assert lines.count("# TYPE motor_request_render_seconds histogram") == 1
    assert "# TYPE motor_request_duration_seconds histogram" in lines  # declared while idle
    chat = [line for line in lines if line.startswith("motor_request_render_seconds_bucket{api=\"chat\"")]
    bounds = [repr(b) for b in names.PHASE_RENDER.buckets] + ["+Inf"]
    assert [line.split('le="')[1].split('"')[0] for line in chat] == bounds
    five_ms = bounds.index("0.005")  # 3 ms: first in the 5 ms bucket
    assert chat[five_ms - 1].endswith(" 0.0") and chat[five_ms].endswith(" 1.0")
    assert 'motor_request_render_seconds_count{api="completions",mode="json",model="tiny",source="local"} 1.0' in lines


def test_a_recorder_without_histograms_records_nothing() -> None:
    phases = Phases(None, {"api": "chat"})
    phases.placed("union").observe(names.PHASE_PLACEMENT, phases.now())  # no store, no labels needed
    assert phases.placed_on.topology == "none"


# -- the pipeline's hooks ------------------------------------------------------------------------


def timed(upstreams: FakeUpstreams, clock: Clock) -> None:
    """Render, generate and derender of every host take their fixed time on ``clock``."""

    def after(kind: str, seconds: float) -> Any:
        def answer(request: httpx.Request, body: Any) -> httpx.Response:
            clock.now += seconds
            if kind == "generate" and body.get("stream"):
                return upstreams.sse_response(body)
            return getattr(upstreams, f"_{kind}")(request, body)
        return answer

    upstreams.override("render", "render", after("render", RENDER_S))
    upstreams.override("render", "derender", after("derender", DERENDER_S))
    for host in ("e1", "e2"):
        upstreams.override(host, "generate", after("generate", GENERATE_S))


@pytest.fixture
def clock(upstreams: FakeUpstreams) -> Clock:
    c = Clock()
    timed(upstreams, c)
    return c


async def test_it_times_each_phase_of_a_json_chat(rig: Rig, clock: Clock) -> None:
    h = Histograms(clock=clock)
    phases = Phases.begin(h, "chat", chat_body(), clock())
    await rig.pipeline().chat(chat_body(max_tokens=3), "p1", phases)
    on = dict(api="chat", mode="json", topology="union")
    assert sums(h, names.PHASE_RENDER) == {labels(api="chat", mode="json", source="render"): (RENDER_S, 1)}
    assert sums(h, names.PHASE_PLACEMENT) == {labels(**on): (0.0, 1)}
    assert sums(h, names.PHASE_QUEUE_WAIT) == {labels(**on): (0.0, 1)}  # granted at once: a zero wait
    assert sums(h, names.PHASE_FIRST_CHUNK) == {labels(**on, leg="union"): (GENERATE_S, 1)}
    assert sums(h, names.PHASE_FIRST_DERENDER) == {labels(**on): (DERENDER_S, 1)}
    assert phases.placed_on.topology == "union"


async def test_it_times_the_first_event_and_only_the_first_derender_of_a_stream(rig: Rig, clock: Clock) -> None:
    h = Histograms(clock=clock)
    body = chat_body(stream=True, max_tokens=3)
    stream = await rig.pipeline().chat(body, "p2", Phases.begin(h, "chat", body, clock()))
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    frames = [f async for f in stream.frames()]
    assert len(rig.upstreams.calls_of("derender")) == len(frames) - 1 > 2  # every chunk derendered
    on = dict(api="chat", mode="stream", topology="union")
    assert sums(h, names.PHASE_FIRST_CHUNK) == {labels(**on, leg="union"): (GENERATE_S, 1)}
    assert sums(h, names.PHASE_FIRST_DERENDER) == {labels(**on): (DERENDER_S, 1)}
    assert sums(h, names.PHASE_RENDER) == {labels(api="chat", mode="stream", source="render"): (RENDER_S, 1)}


class WaitingAdmission(TokenAdmission):
    """Admission whose every lease takes ``WAIT_S`` on the clock to be granted."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(AdmissionSettings())
        self.clock = clock

    async def acquire(self, instance: InstanceView, tokens: int, group: LeaseGroup | None = None) -> Lease:
        self.clock.now += WAIT_S
        return await super().acquire(instance, tokens, group)


async def test_it_times_the_admission_wait_of_every_lease(upstreams: FakeUpstreams, clock: Clock) -> None:
    before = asyncio.all_tasks()
    rig = make_rig(upstreams, admission=WaitingAdmission(clock))
    h = Histograms(clock=clock)
    try:
        for i in range(2):
            await rig.pipeline().chat(chat_body(max_tokens=3), f"p3-{i}", Phases.begin(h, "chat", {}, clock()))
        on = labels(api="chat", mode="json", topology="union")
        assert sums(h, names.PHASE_QUEUE_WAIT) == {on: (2 * WAIT_S, 2)}
        first = labels(api="chat", mode="json", topology="union", leg="union")
        assert sums(h, names.PHASE_FIRST_CHUNK) == {first: (2 * GENERATE_S, 2)}
    finally:
        await assert_no_leaks(rig, before)
        await rig.client.aclose()


async def test_it_labels_each_leg_of_a_handoff_and_times_both_waits(upstreams: FakeUpstreams) -> None:
    before = asyncio.all_tasks()
    clock = Clock()
    rig = make_rig(upstreams, admission=WaitingAdmission(clock))
    p, d = engine("e1", role="prefill", kv_transfer="pull"), engine("e2", role="decode", kv_transfer="pull")
    rig.scheduler.topology_policy = lambda *_: Placement("handoff", (p, d))

    def prefill(request: httpx.Request, body: Any) -> httpx.Response:
        clock.now += GENERATE_S
        return httpx.Response(200, json={**upstreams.generate_response(body), "kv_transfer_params": {"remote": "p"}})

    upstreams.override("e1", "generate", prefill)  # before timed(): the first override answers
    timed(upstreams, clock)
    h = Histograms(clock=clock)
    try:
        await rig.pipeline(snapshot_with(p, d)).chat(chat_body(max_tokens=3), "p4", Phases.begin(h, "chat", {}, clock()))
        on = dict(api="chat", mode="json", topology="handoff")
        assert sums(h, names.PHASE_FIRST_CHUNK) == {
            labels(**on, leg="prefill"): (GENERATE_S, 1), labels(**on, leg="decode"): (GENERATE_S, 1),
        }
        assert sums(h, names.PHASE_QUEUE_WAIT) == {labels(**on): (2 * WAIT_S, 2)}  # D reserved, then P
        assert sums(h, names.PHASE_FIRST_DERENDER) == {labels(**on): (DERENDER_S, 1)}
    finally:
        await assert_no_leaks(rig, before)
        await rig.client.aclose()
