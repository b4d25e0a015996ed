"""Failure handling of the token-only router (non-streaming): admission released on every exit,
breakers fed only by engine faults, poison refused before any engine, the context budget, the
retry budget and derender mappings. Every test ends with nothing held (``assert_no_leaks``)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import httpx
import pytest

from serving.pipeline.errors import (
    AdmissionTimeout,
    DerenderError,
    EngineBusy,
    EngineError,
    QueueFull,
    RequestError,
    UpstreamRequestError,
)
from serving.pipeline.flow_control import rate_limit
from serving.pipeline.flow_control.admission import AdmissionSettings, TokenAdmission
from serving.pipeline.flow_control.rate_limit import KeyLimit, TokenRateLimiter
from serving.pipeline.request_context import KeyGrant, RequestContext
from serving.pipeline.resilience.breaker import BreakerBoard, State
from tests.serving.fakes import CHAT_PROMPT, MODEL, FakeUpstreams, completion_prompt_ids, error_json
from tests.serving.router_fakes import (
    Rig,
    assert_no_leaks,
    chat_body,
    engine,
    make_rig,
    model_dir,
    respond,
    snapshot_with,
)

WATCHDOG_S = 5.0


@pytest.fixture
async def rig(upstreams: FakeUpstreams) -> AsyncIterator[Rig]:
    before = asyncio.all_tasks()
    r = make_rig(upstreams, breakers=BreakerBoard(threshold=2))
    yield r
    await assert_no_leaks(r, before)
    await r.client.aclose()


def fail_500(request: httpx.Request, _body: Any) -> httpx.Response:
    return httpx.Response(500, json=error_json(500, "boom", "InternalServerError"))


def connect_error(request: httpx.Request, _body: Any) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


# -- admission --------------------------------------------------------------------------------------


async def test_admission_holds_prompt_plus_max_output_while_generating(rig: Rig) -> None:
    seen: list[dict[str, int]] = []

    def observe(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        seen.append(rig.scheduler.admission.inflight_tokens())
        return httpx.Response(200, json=rig.upstreams.generate_response(body))

    rig.upstreams.override("e1", "generate", observe)
    await rig.pipeline().chat(chat_body(max_completion_tokens=64, n=2), "f1")
    assert seen == [{"e1": len(CHAT_PROMPT) + 64 * 2}]


@pytest.mark.parametrize(
    "exit_path", ["success", "engine-error", "engine-4xx", "retry", "busy", "derender-error"],
)
async def test_quota_returns_to_zero_after_every_exit(rig: Rig, exit_path: str) -> None:
    pipeline = rig.pipeline()
    if exit_path == "engine-error":
        for host in ("e1", "e2"):
            rig.upstreams.override(host, "generate", fail_500)
    elif exit_path == "engine-4xx":
        rig.upstreams.override("e1", "generate", respond(400, error_json(400, "bad")))
    elif exit_path == "retry":
        rig.upstreams.override("e1", "generate", connect_error)
    elif exit_path == "busy":
        rig.upstreams.override("e1", "generate", respond(503, error_json(503, "busy", "ServiceUnavailable")))
    elif exit_path == "derender-error":
        rig.upstreams.override("render", "derender", fail_500)
    try:
        await pipeline.completions({"model": MODEL, "prompt": ["a", "b"], "max_tokens": 4}, "f2")
    except (EngineError, UpstreamRequestError, DerenderError):
        assert exit_path in ("engine-error", "engine-4xx", "derender-error")
    else:
        assert exit_path in ("success", "retry", "busy")
    # assert_no_leaks (fixture) checks inflight tokens, load and waiters are all zero.


async def test_quota_returns_to_zero_when_the_client_cancels(rig: Rig) -> None:
    started = asyncio.Event()

    async def hang(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    rig.upstreams.override("e1", "generate", hang)
    task = asyncio.create_task(rig.pipeline().chat(chat_body(), "f3"))
    async with asyncio.timeout(WATCHDOG_S):
        await started.wait()
    assert rig.scheduler.admission.inflight_tokens() != {}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rig.scheduler.breakers.state(engine("e1")) is State.CLOSED  # cancellation is no engine fault


async def test_a_full_admission_queue_is_429_and_a_passed_deadline_503(upstreams: FakeUpstreams) -> None:
    before = asyncio.all_tasks()
    rig = make_rig(upstreams, admission=TokenAdmission(AdmissionSettings(queue_size=1, wait_s=0.05)))
    small = (engine("e1", token_capacity=20),)
    holder = await rig.scheduler.admission.acquire(small[0], 20)
    waiter = asyncio.create_task(rig.scheduler.admission.acquire(small[0], 20))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull) as info:
        await rig.pipeline(snapshot_with(*small)).chat(chat_body(max_tokens=5), "f4")
    assert info.value.status == 429 and info.value.retry_after_s == 1
    with pytest.raises(AdmissionTimeout):
        await waiter
    with pytest.raises(AdmissionTimeout) as timeout:
        await rig.pipeline(snapshot_with(*small)).chat(chat_body(max_tokens=5), "f5")
    assert timeout.value.status == 503
    holder.release()
    assert upstreams.calls_of("generate") == []
    await assert_no_leaks(rig, before)
    await rig.client.aclose()


# -- breaker ----------------------------------------------------------------------------------------


async def test_consecutive_engine_failures_trip_the_breaker_and_traffic_moves(rig: Rig) -> None:
    rig.upstreams.override("e1", "generate", fail_500)
    pipeline = rig.pipeline()
    for i in range(2):
        await pipeline.chat(chat_body(), f"f6-{i}")  # e1 fails, e2 answers
    assert rig.scheduler.breakers.state(engine("e1")) is State.OPEN
    calls_before = len(rig.upstreams.calls_of("generate", "e1"))
    await pipeline.chat(chat_body(), "f7")
    assert len(rig.upstreams.calls_of("generate", "e1")) == calls_before  # e1 is kept out


@pytest.mark.parametrize(
    ("answer", "retried"),
    [(respond(503, error_json(503, "busy", "ServiceUnavailable")), True), (respond(400, error_json(400, "bad")), False)],
    ids=["busy", "4xx"],
)
async def test_busy_and_request_errors_never_touch_the_breaker(rig: Rig, answer: Any, retried: bool) -> None:
    rig.upstreams.override("e1", "generate", answer)
    for i in range(3):
        if retried:
            # Busy is e1's problem, not the request's: e2 must answer every one of them.
            await rig.pipeline().chat(chat_body(), f"f8-{i}")
        else:
            with pytest.raises(UpstreamRequestError) as info:
                await rig.pipeline().chat(chat_body(), f"f8-{i}")
            assert info.value.status == 400
    assert rig.scheduler.breakers.state(engine("e1")) is State.CLOSED
    # busy: each request moved on to e2; 4xx: no retry anywhere
    assert len(rig.upstreams.calls_of("generate")) == (6 if retried else 3)


async def test_busy_everywhere_is_503_without_breaker(rig: Rig) -> None:
    for host in ("e1", "e2"):
        rig.upstreams.override(host, "generate", respond(503, error_json(503, "busy", "ServiceUnavailable")))
    with pytest.raises(EngineBusy):
        await rig.pipeline().chat(chat_body(), "f9")
    assert set(rig.scheduler.breakers.snapshot().values()) == {"closed"}


async def test_unhealthy_instances_get_no_traffic(rig: Rig) -> None:
    await rig.pipeline(snapshot_with(engine("e1", healthy=False), engine("e2"))).chat(chat_body(), "f10")
    assert [g.host for g in rig.upstreams.calls_of("generate")] == ["e2"]


# -- poison and budget --------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [[5, 4096], [-1], list(range(1, 2049))], ids=["above-vocab", "negative", "too-long"])
async def test_poison_prompts_are_400_before_any_engine(rig: Rig, prompt: list[int]) -> None:
    def render_ids(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        out = FakeUpstreams._generate_request("cmpl-f11", prompt, body, False)
        return httpx.Response(200, json=[out])

    rig.upstreams.override("render", "render", render_ids)
    with pytest.raises(RequestError) as info:
        await rig.pipeline(snapshot_with(model_path=model_dir())).completions(
            {"model": MODEL, "prompt": prompt}, "f11"
        )
    assert info.value.status == 400
    assert rig.upstreams.calls_of("generate") == []


@pytest.mark.parametrize(("budget", "expected"), [(True, 2048 - 100 - 2), (False, 2000)])
async def test_the_context_budget_clamps_to_the_chosen_engines_room(rig: Rig, budget: bool, expected: int) -> None:
    small = engine("e1", max_model_len=2048 - 100)
    await rig.pipeline(snapshot_with(small, context_budget=budget)).completions(
        {"model": MODEL, "prompt": "x", "max_tokens": 2000}, "f12"
    )
    (gen,) = rig.upstreams.calls_of("generate")
    assert gen.body["sampling_params"]["max_tokens"] == expected  # prompt 0 renders to 2 ids


async def test_the_context_budget_clamps_before_placement_and_the_rate_limit_charge(
    rig: Rig, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # e1 (first by name, so placed first) has room for 2000 tokens, e2 only for 998. The clamp
    # comes before the engine is chosen, so it takes the smallest context among the candidates;
    # placement scores, the lease, the key's tokens-per-minute charge and the engine see one number.
    big, small = engine("e1", max_model_len=4096), engine("e2", max_model_len=1000)
    limiter = TokenRateLimiter()
    monkeypatch.setattr(rate_limit, "LIMITER", limiter)
    key = KeyLimit("c" * 64, "team-c", 100_000)
    placed: list[int] = []
    place = rig.scheduler.place

    def recording_place(*args: Any, **kwargs: Any) -> Any:
        placed.append(kwargs["tokens"])
        return place(*args, **kwargs)

    monkeypatch.setattr(rig.scheduler, "place", recording_place)
    leased: list[dict[str, int]] = []

    def observe(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        leased.append(rig.scheduler.admission.inflight_tokens())
        return httpx.Response(200, json=rig.upstreams.generate_response(body))

    rig.upstreams.override("e1", "generate", observe)
    await rig.pipeline(snapshot_with(big, small, context_budget=True)).completions(
        {"model": MODEL, "prompt": "x", "max_tokens": 2000}, RequestContext.granted("f12b", KeyGrant(limit=key))
    )
    room = 1000 - 2  # prompt 0 renders to 2 ids
    (gen,) = rig.upstreams.calls_of("generate")
    assert gen.host == "e1" and gen.body["sampling_params"]["max_tokens"] == room
    assert placed == [2 + room] and leased == [{"e1": 2 + room}]
    assert limiter.used(key.key_id) == 2 + room


async def test_a_missing_max_tokens_counts_as_16(rig: Rig) -> None:
    seen: list[dict[str, int]] = []

    def observe(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        seen.append(rig.scheduler.admission.inflight_tokens())
        return httpx.Response(200, json=rig.upstreams.generate_response(body))

    rig.upstreams.override("e1", "generate", observe)
    await rig.pipeline(snapshot_with(context_budget=True)).completions({"model": MODEL, "prompt": "x"}, "f13")
    (gen,) = rig.upstreams.calls_of("generate")
    assert gen.body["sampling_params"]["max_tokens"] == 16 and seen == [{"e1": 2 + 16}]


async def test_instances_whose_context_cannot_hold_the_prompt_are_skipped(rig: Rig) -> None:
    tiny = engine("e1", max_model_len=2)  # prompt 0 renders to 2 ids: no room for one token
    await rig.pipeline(snapshot_with(tiny, engine("e2"))).completions({"model": MODEL, "prompt": "x"}, "f14")
    assert [g.host for g in rig.upstreams.calls_of("generate")] == ["e2"]


# -- multi-prompt and derender ----------------------------------------------------------------------


async def test_multi_prompt_usage_is_summed_in_prompt_order(rig: Rig) -> None:
    out = await rig.pipeline().completions({"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 5}, "f15")
    assert out["usage"]["prompt_tokens"] == sum(len(completion_prompt_ids(i)) for i in range(3))
    assert out["usage"]["completion_tokens"] == 9
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]


@pytest.mark.parametrize(
    ("answer", "status"),
    [(respond(404, {"detail": "Not Found"}), 502), (respond(422, error_json(422, "bad chunk")), 422)],
    ids=["404-response-stage", "422-detail"],
)
async def test_derender_errors_never_rerun_inference_or_touch_breakers(rig: Rig, answer: Any, status: int) -> None:
    rig.upstreams.override("render", "derender", answer)
    with pytest.raises((DerenderError, UpstreamRequestError)) as info:
        await rig.pipeline().chat(chat_body(), "f16")
    assert info.value.status == status
    if status == 502:
        assert "response stage" in info.value.message
    assert len(rig.upstreams.calls_of("generate")) == 1
    assert set(rig.scheduler.breakers.snapshot().values()) == {"closed"}


async def test_render_failures_never_consume_engine_retries(rig: Rig) -> None:
    rig.upstreams.override("render", "render", connect_error)
    rig.upstreams.override("e1", "generate", fail_500)
    out = await rig.pipeline(snapshot_with(model_path=model_dir())).completions(
        {"model": MODEL, "prompt": "x", "max_tokens": 3}, "f17"
    )
    assert [g.host for g in rig.upstreams.calls_of("generate")] == ["e1", "e2"]  # both attempts still available
    assert out["choices"][0]["finish_reason"] == "stop"


# -- streaming keeps working through the same layers ----------------------------------------------------


async def test_a_stream_holds_its_tokens_until_it_ends(rig: Rig) -> None:
    stream = await rig.pipeline().chat(chat_body(stream=True, max_tokens=7), "f18")
    assert rig.scheduler.admission.inflight_tokens() == {"e1": len(CHAT_PROMPT) + 7}
    async with asyncio.timeout(WATCHDOG_S):
        raw = b"".join([f async for f in stream.frames()])  # type: ignore[union-attr]
    assert raw.endswith(b"data: [DONE]\n\n")


async def test_a_stream_closed_unread_and_a_failed_open_release_everything(rig: Rig) -> None:
    stream = await rig.pipeline().completions({"model": MODEL, "prompt": ["a", "b"], "stream": True}, "f19")
    await stream.aclose()  # type: ignore[union-attr]
    rig.upstreams.override("e1", "generate", fail_500)
    rig.upstreams.override("e2", "generate", fail_500)
    with pytest.raises(EngineError):
        await rig.pipeline().chat(chat_body(stream=True), "f20")
