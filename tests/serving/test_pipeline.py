"""Component tests of ServingPipeline against fake render, engines and derender (conftest.py).

Every test ends with no load held and no asyncio task left behind (the ``no_leaks`` fixture).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections import defaultdict
from typing import Any, Callable

import httpx
import pytest

from serving.pipeline.derender.session import StreamSettings
from serving.pipeline.engine.client import EngineClient, ReplyDeadline
from serving.pipeline.errors import (
    DerenderError,
    EngineBusy,
    EngineError,
    NoCapacity,
    RenderUnavailable,
    UpstreamRequestError,
    error_body,
)
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Scheduler
from serving.pipeline.render.client import RenderClient
from serving.pipeline.response import Response
from serving.pipeline.service import EventStream, ServingPipeline
from serving.pipeline.streaming import fanout
from tests.serving.fakes import (
    CHAT_PROMPT,
    MODEL,
    RENDER_URL,
    FakeUpstreams,
    StreamPlan,
    completion_prompt_ids,
    error_json,
    fleet_snapshot,
    instance,
    output_ids,
    parse_frames,
    text_of,
)
from tests.serving.leaks import assert_nothing_held
from tests.serving.loopback import HANG_DEADLINE_S, LoopbackClient, hang

WATCHDOG_S = 5.0  # a hung pipeline fails the test instead of stalling the suite


@pytest.fixture
def scheduler() -> Scheduler:
    return Scheduler(LoadTracker())


@pytest.fixture(autouse=True)
async def no_leaks(scheduler: Scheduler, upstreams: FakeUpstreams):
    before = asyncio.all_tasks()
    yield
    await assert_nothing_held(scheduler, before, upstreams.open_streams)


@pytest.fixture
def make_pipeline(mock_client: LoopbackClient, scheduler: Scheduler) -> Callable[..., ServingPipeline]:
    def make(
        *instances: Any, render_timeout_s: float = 5.0, engine_reply_s: float | None = None, **render: Any,
    ) -> ServingPipeline:
        # engine_reply_s: a flat deadline for a non-streaming generate (production's ReplyDeadline);
        # None leaves the shared client's read timeout, as a pipeline without one has.
        deadline = None if engine_reply_s is None else ReplyDeadline(base_s=engine_reply_s, per_token_s=0.0)
        return ServingPipeline(
            fleet_snapshot(*instances, **render), RenderClient(mock_client, RENDER_URL, render_timeout_s),
            EngineClient(mock_client, deadline=deadline), scheduler,
        )

    return make


@pytest.fixture
def pipeline(make_pipeline: Callable[..., ServingPipeline]) -> ServingPipeline:
    return make_pipeline()


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], **extra}


def completion_body(prompt: Any = "Say hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, **extra}


async def drain(stream: EventStream) -> list[Any]:
    async with asyncio.timeout(WATCHDOG_S):
        raw = b"".join([f async for f in stream.frames()])
    return parse_frames(raw)


def respond(status: int, body: Any) -> Callable[..., httpx.Response]:
    return lambda request, _body: httpx.Response(status, json=body)


def connect_error(request: httpx.Request, _body: Any) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


read_timeout = hang  # a sidecar that never answers: the render deadline (HANG_DEADLINE_S) ends it


def with_max_tokens(rendered: dict[str, Any], value: int) -> dict[str, Any]:
    out = copy.deepcopy(rendered)
    out["sampling_params"]["max_tokens"] = value
    return out


# --- non-streaming ------------------------------------------------------------------------------


async def test_chat_non_stream_runs_render_generate_derender(
    pipeline: ServingPipeline, upstreams: FakeUpstreams,
) -> None:
    body = chat_body(max_completion_tokens=64, temperature=0.2)
    sent = copy.deepcopy(body)

    out = await pipeline.chat(body, "r1")

    assert out["id"] == "chatcmpl-r1"
    assert out["choices"][0]["message"]["content"] == text_of(output_ids(CHAT_PROMPT, 0))
    assert out["usage"]["prompt_tokens"] == len(CHAT_PROMPT)
    assert [c.kind for c in upstreams.calls] == ["render", "generate", "derender"]
    render, gen, der = upstreams.calls
    assert render.path == "/v1/chat/completions/render"
    assert render.body == sent and render.headers["x-request-id"] == "r1"
    assert gen.host == "e1" and gen.body == render.response  # render's request, untouched
    assert der.path == "/v1/chat/completions/derender"
    assert der.body == {
        "model": MODEL,
        "generate_response": gen.response,
        "prompt_tokens": len(CHAT_PROMPT),
        "prompt_token_ids": CHAT_PROMPT,
        "chat_request": sent,
    }
    assert body == sent  # the client's request is not mutated


async def test_completions_non_stream_single_prompt(pipeline: ServingPipeline, upstreams: FakeUpstreams) -> None:
    out = await pipeline.completions(completion_body(max_tokens=32), "r2")

    assert out["id"] == "cmpl-r2"
    assert [c["text"] for c in out["choices"]] == [text_of(output_ids(completion_prompt_ids(0), 0))]
    render, gen, der = upstreams.calls
    assert render.path == "/v1/completions/render"
    assert gen.body == render.response[0]
    assert der.path == "/v1/completions/derender"
    assert der.body["generate_responses"] == [gen.response]
    assert der.body["prompt_tokens"] == [len(completion_prompt_ids(0))]


async def test_multi_prompt_completions_keep_prompt_order(pipeline: ServingPipeline, upstreams: FakeUpstreams) -> None:
    all_arrived = asyncio.Event()

    async def first_prompt_answers_last(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if len(upstreams.calls_of("generate")) == 3:
            all_arrived.set()
        if body["request_id"].endswith("-0"):
            await all_arrived.wait()  # prompts run concurrently: prompt 0 finishes after 1 and 2
        return httpx.Response(200, json=upstreams.generate_response(body))

    for host in ("e1", "e2"):
        upstreams.override(host, "generate", first_prompt_answers_last)
    body = completion_body(["a", "b", "c"], n=2, max_tokens=20)

    async with asyncio.timeout(WATCHDOG_S):
        out = await pipeline.completions(body, "r3")

    assert out["id"] == "cmpl-r3"
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert [c["text"] for c in out["choices"]] == [
        text_of(output_ids(completion_prompt_ids(p), j)) for p in range(3) for j in range(2)
    ]
    gens = upstreams.calls_of("generate")
    assert {g.host for g in gens} == {"e1", "e2"}  # concurrent prompts spread over both engines
    assert sorted(g.body["request_id"] for g in gens) == ["cmpl-r3-0", "cmpl-r3-1", "cmpl-r3-2"]
    (der,) = upstreams.calls_of("derender")
    responses = der.body["generate_responses"]
    assert [r["request_id"] for r in responses] == [f"generate-tokens-cmpl-r3-{i}" for i in range(3)]
    assert all([c["index"] for c in r["choices"]] == [0, 1] for r in responses)  # sorted for derender
    assert der.body["prompt_tokens"] == [2, 3, 4]
    assert der.body["prompt_token_ids"] == [completion_prompt_ids(i) for i in range(3)]
    assert der.body["completion_request"] == body


async def test_a_failing_prompt_cancels_its_siblings(
    pipeline: ServingPipeline, upstreams: FakeUpstreams, mock_client: LoopbackClient
) -> None:
    never = asyncio.Event()
    cancelled = []

    async def route(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if body["request_id"].endswith("-1"):
            return httpx.Response(400, json=error_json(400, "bad prompt 1"))
        try:
            await never.wait()  # prompt 0 is a long generation
        except asyncio.CancelledError:
            cancelled.append(body["request_id"])
            raise
        raise AssertionError("unreachable")

    for host in ("e1", "e2"):
        upstreams.override(host, "generate", route)

    async with asyncio.timeout(WATCHDOG_S):
        with pytest.raises(UpstreamRequestError) as info:
            await pipeline.completions(completion_body(["a", "b"]), "r4")

    assert error_body(info.value) == (400, error_json(400, "bad prompt 1"))
    await mock_client.loopback.settle()  # the sibling's close reaches its fake engine over the socket
    assert cancelled == ["cmpl-r4-0"]  # no orphaned generate keeps running (no_leaks checks the task)
    assert upstreams.calls_of("derender") == []


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("chat", chat_body(max_completion_tokens=16)),
        ("chat", chat_body()),
        ("completions", completion_body()),
        ("completions", completion_body(max_tokens=16)),
    ],
)
async def test_omitted_max_tokens_16_is_restored_before_generate(
    pipeline: ServingPipeline, upstreams: FakeUpstreams, kind: str, body: dict[str, Any]
) -> None:
    await (pipeline.chat(body, "r5") if kind == "chat" else pipeline.completions(body, "r5"))

    render, gen = upstreams.calls_of("render")[0], upstreams.calls_of("generate")[0]
    rendered = render.response if kind == "chat" else render.response[0]
    assert "max_tokens" not in rendered["sampling_params"]
    assert gen.body == with_max_tokens(rendered, 16)


@pytest.mark.parametrize(
    "fault",
    [connect_error, read_timeout, respond(500, error_json(500, "boom", "InternalServerError")),
     respond(502, "bad gateway"), respond(200, {"not": "a GenerateResponse"})],
    ids=["connect", "timeout", "500", "502-text", "malformed"],
)
async def test_a_failed_engine_is_retried_once_on_the_other_instance(
    make_pipeline: Callable[..., ServingPipeline], upstreams: FakeUpstreams, fault: Callable[..., httpx.Response]
) -> None:
    # An engine that never answers is given up on at its reply deadline (the shared client's read
    # timeout, a minute, without one): a short one here.
    pipeline = make_pipeline(engine_reply_s=HANG_DEADLINE_S if fault is read_timeout else None)
    upstreams.override("e1", "generate", fault)

    out = await pipeline.chat(chat_body(max_completion_tokens=64), "r6")

    gens = upstreams.calls_of("generate")
    assert [g.host for g in gens] == ["e1", "e2"]
    assert [g.body["request_id"] for g in gens] == ["chatcmpl-r6", "chatcmpl-r6-a1"]  # distinct per attempt
    assert {k: v for k, v in gens[1].body.items() if k != "request_id"} == {
        k: v for k, v in gens[0].body.items() if k != "request_id"
    }
    assert upstreams.calls_of("derender")[0].body["generate_response"] == gens[1].response
    assert out["id"] == "chatcmpl-r6"


async def test_engine_retry_is_bounded(pipeline: ServingPipeline, upstreams: FakeUpstreams) -> None:
    for host in ("e1", "e2"):
        upstreams.override(host, "generate", respond(500, error_json(500, "boom", "InternalServerError")))

    with pytest.raises(EngineError) as info:
        await pipeline.chat(chat_body(), "r7")

    assert info.value.status == 502
    assert len(upstreams.calls_of("generate")) == 2
    assert upstreams.calls_of("derender") == []


async def test_engine_400_passes_through_unchanged_without_retry(
    pipeline: ServingPipeline, upstreams: FakeUpstreams
) -> None:
    vllm = error_json(400, "stop strings are not supported on a --tokens-only server", param="stop")
    upstreams.override("e1", "generate", respond(400, vllm))

    with pytest.raises(UpstreamRequestError) as info:
        await pipeline.chat(chat_body(), "r8")

    assert error_body(info.value) == (400, vllm)
    assert len(upstreams.calls_of("generate")) == 1
    assert upstreams.calls_of("derender") == []


async def test_engine_503_busy_goes_elsewhere(pipeline: ServingPipeline, upstreams: FakeUpstreams) -> None:
    upstreams.override("e1", "generate", respond(503, error_json(503, "queue full", "Service Unavailable")))

    out = await pipeline.completions(completion_body(), "r9")

    assert [g.host for g in upstreams.calls_of("generate")] == ["e1", "e2"]
    assert out["choices"][0]["text"] == text_of(output_ids(completion_prompt_ids(0), 0))


async def test_busy_everywhere_is_503(pipeline: ServingPipeline, upstreams: FakeUpstreams) -> None:
    for host in ("e1", "e2"):
        upstreams.override(host, "generate", respond(503, error_json(503, "queue full", "Service Unavailable")))

    with pytest.raises(EngineBusy) as info:
        await pipeline.chat(chat_body(), "r10")

    assert error_body(info.value)[0] == 503


async def test_no_active_instance_is_no_capacity(
    make_pipeline: Callable[..., ServingPipeline], upstreams: FakeUpstreams,
) -> None:
    pipeline = make_pipeline(instance("e1", state="draining"), instance("e2", state="quarantined"))

    with pytest.raises(NoCapacity) as info:
        await pipeline.chat(chat_body(), "r11")

    assert info.value.status == 503
    assert upstreams.calls_of("generate") == []


async def test_render_400_passes_through(pipeline: ServingPipeline, upstreams: FakeUpstreams) -> None:
    vllm = error_json(400, "max_completion_tokens=9999 cannot be greater than max_model_len=2048.",
                      param="max_completion_tokens")
    upstreams.override("render", "render", respond(400, vllm))

    with pytest.raises(UpstreamRequestError) as info:
        # Within the coordinator's own bounds (request_checks): only render knows its context.
        await pipeline.chat(chat_body(max_completion_tokens=2000), "r12")

    assert error_body(info.value) == (400, vllm)
    assert [c.kind for c in upstreams.calls] == ["render"]


@pytest.mark.parametrize(
    "fault",
    [connect_error, read_timeout, respond(500, error_json(500, "x", "InternalServerError")),
     respond(404, {"detail": "Not Found"}), respond(200, {"request_id": "x", "token_ids": []})],
    ids=["connect", "timeout", "500", "route-missing", "no-token-ids"],
)
async def test_unusable_render_is_render_unavailable(
    make_pipeline: Callable[..., ServingPipeline], upstreams: FakeUpstreams, fault: Callable[..., httpx.Response]
) -> None:
    # A sidecar that never answers is given up on at the render deadline: a short one here.
    pipeline = make_pipeline(render_timeout_s=HANG_DEADLINE_S if fault is read_timeout else 5.0)
    upstreams.override("render", "render", fault)

    with pytest.raises(RenderUnavailable) as info:
        await pipeline.chat(chat_body(), "r13")

    assert error_body(info.value)[0] == 503  # /models/tiny does not exist: no local fallback either
    assert [c.kind for c in upstreams.calls] == ["render"]


@pytest.mark.parametrize(
    ("fault", "exc_type", "status"),
    [
        (respond(400, error_json(400, "choice 0 has empty or null token_ids")), UpstreamRequestError, 400),
        (respond(500, error_json(500, "boom", "InternalServerError")), DerenderError, 502),
        (respond(501, error_json(501, "nope", "NotImplementedError")), DerenderError, 502),
        (read_timeout, DerenderError, 504),
        (connect_error, DerenderError, 502),
    ],
    ids=["400", "500", "501", "timeout", "connect"],
)
async def test_derender_failures_never_rerun_inference(
    make_pipeline: Callable[..., ServingPipeline], upstreams: FakeUpstreams, fault: Callable[..., httpx.Response],
    exc_type: type, status: int,
) -> None:
    pipeline = make_pipeline(render_timeout_s=HANG_DEADLINE_S)
    upstreams.override("render", "derender", fault)

    with pytest.raises(exc_type) as info:
        await pipeline.completions(completion_body(), "r14")

    assert error_body(info.value)[0] == status
    if status == 400:
        assert error_body(info.value)[1] == error_json(400, "choice 0 has empty or null token_ids")
    assert len(upstreams.calls_of("generate")) == 1


# --- streaming ----------------------------------------------------------------------------------


def assert_state_chains(upstreams: FakeUpstreams) -> None:
    """Each (prompt, choice) got None first, then exactly the state returned by its previous call."""
    chains: dict[tuple, list[dict]] = defaultdict(list)
    for d in upstreams.stream_derenders:
        chains[(d["prompt"], d["index"])].append(d)
    assert chains
    for calls in chains.values():
        assert calls[0]["state_in"] is None
        for prev, cur in zip(calls, calls[1:], strict=False):
            assert cur["state_in"] == prev["state_out"]


def contents(chunks: list[dict], field: str = "content") -> dict[int, str]:
    out: dict[int, str] = defaultdict(str)
    for c in chunks:
        for choice in c["choices"]:
            piece = choice["delta"].get(field) if "delta" in choice else choice.get(field)
            out[choice["index"]] += piece or ""
    return dict(out)


async def test_streaming_chat(pipeline: ServingPipeline, upstreams: FakeUpstreams, scheduler: Scheduler) -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True}, n=2, max_completion_tokens=64)
    sent = copy.deepcopy(body)

    stream = await pipeline.chat(body, "r20")

    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    assert scheduler.load.snapshot() == {"e1": 1}  # held while the stream is open
    frames = await drain(stream)

    assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
    chunks = frames[:-1]
    assert all(c["id"] == "chatcmpl-r20" for c in chunks)  # not generate-tokens-...
    assert contents(chunks) == {j: text_of(output_ids(CHAT_PROMPT, j)) for j in range(2)}
    for j in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == j]
        assert [ch["delta"]["role"] for ch in mine] == ["assistant"] + [None] * (len(mine) - 1)
        assert [ch["finish_reason"] for ch in mine][-1] == "stop"
    usage = [c for c in chunks if c.get("usage")]
    assert len(usage) == 1 and usage[0] is chunks[-1] and usage[0]["choices"] == []
    assert usage[0]["usage"]["prompt_tokens"] == len(CHAT_PROMPT)
    assert usage[0]["usage"]["completion_tokens"] == 6

    assert_state_chains(upstreams)
    ders = upstreams.calls_of("derender")
    assert len(ders) == 7  # 6 token events + the usage event; [DONE] never goes to derender
    assert all(d.body["stream"] is True and d.body["prompt_tokens"] == 10 for d in ders)
    # A choice's first call and the usage event carry the whole request and the prompt; once a
    # state without a replay buffer proved the plain path, the messages and prompt ids stay home,
    # and so does the whole request on a call whose event neither finishes nor has logprobs.
    full = [d for d in ders if d.body.get("stream_state") is None]
    later = [d for d in ders if d.body.get("stream_state") is not None]
    assert len(full) == 3 and len(later) == 4
    assert all(d.body["chat_request"] == sent and d.body["prompt_token_ids"] == CHAT_PROMPT for d in full)
    assert all("prompt_token_ids" not in d.body for d in later)
    finishing = [d for d in later if d.body["generate_chunk"]["choices"][0]["finish_reason"] is not None]
    assert len(finishing) == 2  # one per choice
    assert all(d.body["chat_request"] == {**sent, "messages": [{"role": "user", "content": ""}]} for d in finishing)
    assert all("chat_request" not in d.body for d in later if d not in finishing)
    (gen,) = upstreams.calls_of("generate")
    assert gen.body["stream"] is True
    assert upstreams.open_streams == set() and upstreams.closed_streams == ["chatcmpl-r20"]
    assert upstreams.calls_of("abort") == []  # finished cleanly: nothing to abort


async def test_streaming_completions_single_prompt(pipeline: ServingPipeline, upstreams: FakeUpstreams) -> None:
    stream = await pipeline.completions(completion_body(stream=True), "r21")
    frames = await drain(stream)

    assert frames[-1] == "[DONE]"
    chunks = frames[:-1]
    assert all(c["id"] == "cmpl-r21" for c in chunks)
    assert contents(chunks, "text") == {0: text_of(output_ids(completion_prompt_ids(0), 0))}
    assert not any(c.get("usage") for c in chunks)  # no include_usage, no usage chunk
    ders = upstreams.calls_of("derender")
    assert len(ders) > 2 and all(d.path == "/v1/completions/derender" for d in ders)
    # The first call seeds from the whole request, the last drops the stop token by it; the calls
    # between read none of it on the plain path (derender/payload.py) and go without.
    assert "completion_request" in ders[0].body and "completion_request" in ders[-1].body
    assert ders[-1].body["generate_chunk"]["choices"][0]["finish_reason"] is not None
    assert all("completion_request" not in d.body for d in ders[1:-1])


@pytest.mark.parametrize(
    ("plan", "error_status"),
    [
        (StreamPlan(end="raise", after=1), 502),
        (StreamPlan(end="eof", after=1), 502),
        (StreamPlan(end="error", after=1, error_code=500), 502),
    ],
    ids=["connection-drop", "eof-without-done", "in-band-500"],
)
async def test_a_stream_failing_midway_ends_with_an_error_frame_then_done(
    pipeline: ServingPipeline, upstreams: FakeUpstreams, plan: StreamPlan, error_status: int
) -> None:
    upstreams.default_plan = plan
    # Relay is off here: this is the end of a stream whose relay budget is spent (test_relay.py relays).
    pipeline.stream_settings = StreamSettings(max_relays=0)

    frames = await drain(await pipeline.chat(chat_body(stream=True), "r22"))

    assert len(frames) == 3 and frames[2] == "[DONE]"
    assert frames[0]["choices"][0]["delta"]["content"] == text_of(CHAT_PROMPT[:1])
    assert frames[1]["error"]["code"] == error_status and frames[1]["error"]["type"] == "BadGatewayError"
    assert upstreams.aborted_ids() == [("e1", "generate-tokens-chatcmpl-r22")]
    assert upstreams.open_streams == set()
    assert len(upstreams.calls_of("derender")) == 1  # the error event never reaches derender


async def test_an_in_band_400_is_passed_to_the_client_unchanged(
    pipeline: ServingPipeline, upstreams: FakeUpstreams
) -> None:
    upstreams.default_plan = StreamPlan(end="error", after=0, error_code=400)

    frames = await drain(await pipeline.chat(chat_body(stream=True), "r23"))

    assert frames == [error_json(400, "engine failed mid-stream"), "[DONE]"]
    assert upstreams.calls_of("derender") == []


async def test_streaming_derender_failure_ends_the_stream_and_aborts(
    make_pipeline: Callable[..., ServingPipeline], upstreams: FakeUpstreams
) -> None:
    pipeline = make_pipeline(render_timeout_s=HANG_DEADLINE_S)
    upstreams.override("render", "derender", read_timeout)

    frames = await drain(await pipeline.chat(chat_body(stream=True), "r24"))

    assert len(frames) == 2 and frames[0]["error"]["code"] == 504 and frames[1] == "[DONE]"
    assert upstreams.aborted_ids() == [("e1", "generate-tokens-chatcmpl-r24")]
    assert len(upstreams.calls_of("generate")) == 1


async def test_multi_prompt_streaming_remaps_indices_and_merges_usage(
    pipeline: ServingPipeline, upstreams: FakeUpstreams
) -> None:
    body = completion_body(["a", "b", "c"], stream=True, n=2, stream_options={"include_usage": True})

    frames = await drain(await pipeline.completions(body, "r25"))

    assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
    chunks = frames[:-1]
    assert all(c["id"] == "cmpl-r25" for c in chunks)
    assert contents(chunks, "text") == {
        p * 2 + j: text_of(output_ids(completion_prompt_ids(p), j)) for p in range(3) for j in range(2)
    }
    usage = [c for c in chunks if c.get("usage")]
    assert len(usage) == 1 and usage[0] is chunks[-1] and usage[0]["choices"] == []
    assert usage[0]["usage"]["prompt_tokens"] == 2 + 3 + 4
    assert usage[0]["usage"]["completion_tokens"] == 3 * 2 * 3
    assert usage[0]["usage"]["total_tokens"] == 9 + 18
    assert_state_chains(upstreams)
    assert {d["prompt"] for d in upstreams.stream_derenders} == {tuple(completion_prompt_ids(p)) for p in range(3)}
    assert sorted(upstreams.closed_streams) == [f"cmpl-r25-{i}" for i in range(3)]
    assert upstreams.calls_of("abort") == []


async def test_multi_prompt_stream_failure_ends_with_one_error_frame(
    pipeline: ServingPipeline, upstreams: FakeUpstreams
) -> None:
    upstreams.stream_plans["cmpl-r26-1"] = StreamPlan(end="raise", after=1)
    upstreams.stream_plans["cmpl-r26-0"] = StreamPlan(end="hang", after=1)

    frames = await drain(await pipeline.completions(completion_body(["a", "b"], stream=True), "r26"))

    assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
    errors = [f for f in frames[:-1] if "error" in f]
    assert len(errors) == 1 and frames[-2] is errors[0] and errors[0]["error"]["code"] == 502
    assert sorted(rid for _, rid in upstreams.aborted_ids()) == ["generate-tokens-cmpl-r26-0",
                                                                 "generate-tokens-cmpl-r26-1"]
    assert upstreams.open_streams == set()


async def test_closing_a_stream_early_aborts_the_engine_request(
    pipeline: ServingPipeline, upstreams: FakeUpstreams, scheduler: Scheduler
) -> None:
    upstreams.default_plan = StreamPlan(end="hang", after=1)  # a long generation
    stream = await pipeline.chat(chat_body(stream=True), "r27")

    async with asyncio.timeout(WATCHDOG_S):
        frames = stream.frames()
        first = await anext(frames)
        await frames.aclose()  # the client went away

    assert json.loads(first[len(b"data: "):])["id"] == "chatcmpl-r27"
    (gen,) = upstreams.calls_of("generate")
    assert upstreams.aborted_ids() == [(gen.host, "generate-tokens-" + gen.body["request_id"])]
    assert upstreams.open_streams == set()
    assert scheduler.load.snapshot() == {}


async def test_closing_a_multi_prompt_stream_early_aborts_every_engine_request(
    pipeline: ServingPipeline, upstreams: FakeUpstreams, scheduler: Scheduler
) -> None:
    upstreams.default_plan = StreamPlan(end="hang", after=1)
    stream = await pipeline.completions(completion_body(["a", "b"], stream=True), "r28")

    async with asyncio.timeout(WATCHDOG_S):
        frames = stream.frames()
        await anext(frames)
        await frames.aclose()

    expected = {(g.host, "generate-tokens-" + g.body["request_id"]) for g in upstreams.calls_of("generate")}
    assert set(upstreams.aborted_ids()) == expected and len(expected) == 2
    assert upstreams.open_streams == set()
    assert scheduler.load.snapshot() == {}


async def test_a_slow_client_leaving_a_full_merge_queue_still_releases_everything(
    pipeline: ServingPipeline, upstreams: FakeUpstreams, scheduler: Scheduler
) -> None:
    # 2 prompts x 40 token events; the client reads one frame and then nothing.
    upstreams.default_plan = StreamPlan(end="hang", after=40, tokens=41)
    stream = await pipeline.completions(completion_body(["a", "b"], stream=True), "r35")

    async with asyncio.timeout(WATCHDOG_S):
        frames = stream.frames()
        await anext(frames)
        for _ in range(200):  # let the producers run until the queue is full (bounded turns)
            await asyncio.sleep(0)
        # Each prompt derendered one chunk and waits for the client to take it (its session
        # commits only then): nothing runs ahead of a client that reads nothing.
        assert len(upstreams.calls_of("derender")) == 2 <= fanout.MERGE_QUEUE_SIZE
        await frames.aclose()

    assert len(upstreams.aborted_ids()) == 2
    assert upstreams.open_streams == set()
    assert scheduler.load.snapshot() == {}


async def test_a_stream_never_read_is_released_by_aclose(
    pipeline: ServingPipeline, upstreams: FakeUpstreams, scheduler: Scheduler
) -> None:
    stream = await pipeline.chat(chat_body(stream=True), "r29")
    assert scheduler.load.snapshot() == {"e1": 1}

    await stream.aclose()

    assert upstreams.aborted_ids() == [("e1", "generate-tokens-chatcmpl-r29")]
    assert upstreams.open_streams == set()


async def test_stream_open_failure_retries_elsewhere_and_holds_only_the_live_engine(
    pipeline: ServingPipeline, upstreams: FakeUpstreams, scheduler: Scheduler
) -> None:
    upstreams.override("e1", "generate", respond(500, error_json(500, "boom", "InternalServerError")))

    stream = await pipeline.chat(chat_body(stream=True), "r30")

    assert [(g.host, g.body["request_id"]) for g in upstreams.calls_of("generate")] == [
        ("e1", "chatcmpl-r30"), ("e2", "chatcmpl-r30-a1")
    ]
    assert scheduler.load.snapshot() == {"e2": 1}  # the failed attempt holds nothing
    frames = await drain(stream)
    assert frames[-1] == "[DONE]" and all("error" not in f for f in frames[:-1])
    assert upstreams.calls_of("abort") == []


async def test_stream_open_busy_goes_elsewhere(pipeline: ServingPipeline, upstreams: FakeUpstreams) -> None:
    upstreams.override("e1", "generate", respond(503, error_json(503, "queue full", "Service Unavailable")))

    frames = await drain(await pipeline.completions(completion_body(stream=True), "r31"))

    assert [g.host for g in upstreams.calls_of("generate")] == ["e1", "e2"]
    assert frames[-1] == "[DONE]" and contents(frames[:-1], "text")[0]


async def test_stream_engine_400_is_a_proper_status_not_a_broken_200(
    pipeline: ServingPipeline, upstreams: FakeUpstreams
) -> None:
    vllm = error_json(400, "prompt too long", param="input_tokens")
    upstreams.override("e1", "generate", respond(400, vllm))

    with pytest.raises(UpstreamRequestError) as info:
        await pipeline.chat(chat_body(stream=True), "r32")

    assert error_body(info.value) == (400, vllm)
    assert len(upstreams.calls_of("generate")) == 1


async def test_stream_open_failing_everywhere_raises_before_any_byte(
    pipeline: ServingPipeline, upstreams: FakeUpstreams
) -> None:
    for host in ("e1", "e2"):
        upstreams.override(host, "generate", connect_error)

    with pytest.raises(EngineError):
        await pipeline.chat(chat_body(stream=True), "r33")

    assert len(upstreams.calls_of("generate")) == 2


async def test_multi_prompt_stream_open_failure_aborts_the_streams_already_open(
    pipeline: ServingPipeline, upstreams: FakeUpstreams
) -> None:
    vllm = error_json(400, "bad prompt 1")

    def second_prompt_rejected(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if body["request_id"].endswith("-1"):
            return httpx.Response(400, json=vllm)
        return upstreams.sse_response(body)

    for host in ("e1", "e2"):
        upstreams.override(host, "generate", second_prompt_rejected)

    with pytest.raises(UpstreamRequestError) as info:
        await pipeline.completions(completion_body(["a", "b"], stream=True), "r34")

    assert error_body(info.value) == (400, vllm)
    first = upstreams.calls_of("generate")[0]
    assert upstreams.aborted_ids() == [(first.host, "generate-tokens-cmpl-r34-0")]
    assert upstreams.open_streams == set()


@pytest.mark.parametrize("coalesce", [False, True], ids=["coalesce-off", "coalesce-on"])
async def test_without_coalescing_each_engine_event_is_one_derender_call_and_one_chunk(
    make_pipeline: Callable[..., ServingPipeline], upstreams: FakeUpstreams, coalesce: bool
) -> None:
    # The real-engine parity test cannot prove this: vLLM itself merges a request's deltas when
    # its HTTP writer falls behind (RequestOutputCollector), so its events may carry several
    # tokens. Here the engine sends one token per event, all at once, so that a reader that
    # coalesces finds them queued behind the first derender call.
    pipeline = make_pipeline(derender_coalesce=coalesce)
    upstreams.default_plan = StreamPlan(tokens=12, burst=True)
    stream = await pipeline.chat(chat_body(stream=True, max_tokens=12), "r-coalesce")
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    chunks = (await drain(stream))[:-1]
    (gen,) = upstreams.calls_of("generate")
    events = upstreams.stream_events(gen.body, 12)
    assert len(events) == 12 and all(len(e["choices"][0]["token_ids"]) == 1 for e in events)
    ders = upstreams.calls_of("derender")
    if coalesce:
        assert len(ders) < len(events)  # the reader merged what queued (else this proves nothing)
    else:
        assert len(ders) == len(events) and len(chunks) == len(events)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == text_of(output_ids(CHAT_PROMPT, 0, 12))
