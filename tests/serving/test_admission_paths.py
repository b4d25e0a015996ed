"""Admission and the tokens-per-minute limit on every path of the pipeline (fake upstreams, the
``rig`` ends by asserting nothing leaked): the native path is charged, a non-positive count is
refused before any engine, and a multi-prompt stream is admitted together or fails fast."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from serving.pipeline.engine.native import prompt_bound
from serving.pipeline.errors import AdmissionUnavailable, RequestError
from serving.pipeline.flow_control import rate_limit
from serving.pipeline.flow_control.rate_limit import KeyLimit, TokenRateLimited, TokenRateLimiter
from serving.pipeline.request_context import KeyGrant, RequestContext
from tests.serving.fakes import CHAT_PROMPT, MODEL, error_json
from tests.serving.router_fakes import Rig, chat_body, engine, model_dir, respond, snapshot_with
from tests.serving.test_tokenization import connect_error, expected_chat_ids

PLAIN = (engine("e1", native_openai=True), engine("e2", native_openai=True))
KEY = KeyLimit("c" * 64, "team-c", 100)


@pytest.fixture
def limiter(monkeypatch: pytest.MonkeyPatch) -> Iterator[TokenRateLimiter]:
    fresh = TokenRateLimiter()
    monkeypatch.setattr(rate_limit, "LIMITER", fresh)
    yield fresh


def keyed(request_id: str, limit: KeyLimit = KEY) -> RequestContext:
    """The context of a request whose key has ``limit``."""
    return RequestContext.granted(request_id, KeyGrant(limit=limit))


async def test_the_native_path_is_charged(rig: Rig, limiter: TokenRateLimiter) -> None:
    await rig.pipeline(snapshot_with(*PLAIN)).chat(chat_body(stop=["\n"], max_tokens=60), keyed("t1"))
    assert limiter.used(KEY.key_id) == len(CHAT_PROMPT) + 60  # render's prompt count + max_tokens
    with pytest.raises(TokenRateLimited):
        await rig.pipeline(snapshot_with(*PLAIN)).chat(chat_body(stop=["\n"], max_tokens=60), keyed("t2"))
    assert len(rig.native.calls) == 1  # refused before any engine
    assert limiter.used(KEY.key_id) == len(CHAT_PROMPT) + 60


async def test_responses_are_charged_their_max_output_tokens(rig: Rig, limiter: TokenRateLimiter) -> None:
    await rig.pipeline(snapshot_with(*PLAIN)).responses({"model": MODEL, "input": "hi", "max_output_tokens": 33}, keyed("t10"))
    assert limiter.used(KEY.key_id) == len(CHAT_PROMPT) + 33


async def test_the_local_fallback_is_charged(rig: Rig, limiter: TokenRateLimiter) -> None:
    rig.upstreams.override("render", "render", connect_error)  # render unreachable: local tokenizer
    await rig.pipeline(snapshot_with(model_path=model_dir())).chat(chat_body(max_tokens=5), keyed("t7"))
    assert limiter.used(KEY.key_id) == len(expected_chat_ids()) + 5


async def test_a_fallback_that_goes_native_is_charged_once(rig: Rig, limiter: TokenRateLimiter) -> None:
    rig.upstreams.override("render", "render", connect_error)
    roomy = KeyLimit("d" * 64, "team-d", 10_000)
    snap = snapshot_with(engine("e1", native_openai=True), engine("e2"), model_path=model_dir())
    body = chat_body(max_tokens=7, tools=[{"type": "function", "function": {"name": "f"}}])
    await rig.pipeline(snap).chat(body, keyed("t8", roomy))
    assert len(rig.native.calls) == 1
    assert len(rig.upstreams.calls_of("render")) == 1  # render is not asked again to count
    # The native estimate, charged on the native path: render is down, so the body's size bounds the prompt.
    assert limiter.used(roomy.key_id) == prompt_bound("chat", body)[0] + 7


async def test_a_request_moved_from_token_only_to_native_is_not_charged_twice(
    rig: Rig, limiter: TokenRateLimiter
) -> None:
    for host in ("e1", "e2"):  # no token-only generate: the request moves to the native path
        rig.upstreams.override(host, "generate", respond(404, {"detail": "Not Found"}))
    out = await rig.pipeline(snapshot_with(*PLAIN)).chat(chat_body(max_tokens=9), keyed("t9"))
    assert out["path"] == "/v1/chat/completions"
    (render,) = rig.upstreams.calls_of("render")
    assert limiter.used(KEY.key_id) == len(render.response["token_ids"]) + 9  # after render, only


async def test_a_native_request_with_negative_max_tokens_is_refused_before_any_engine(
    rig: Rig, limiter: TokenRateLimiter
) -> None:
    with pytest.raises(RequestError) as info:
        await rig.pipeline(snapshot_with(*PLAIN)).chat(chat_body(stop=["\n"], max_tokens=-50), keyed("t3"))
    assert info.value.status == 400
    assert rig.native.calls == [] and limiter.used(KEY.key_id) == 0
    assert rig.scheduler.admission.inflight_tokens() == {}
    # Capacity still applies afterwards: nothing went negative.
    await rig.pipeline(snapshot_with(*PLAIN)).chat(chat_body(stop=["\n"], max_tokens=5), keyed("t4"))


async def test_a_multi_prompt_stream_that_cannot_hold_all_its_prompts_fails_fast(rig: Rig) -> None:
    only = engine("e1", token_capacity=100)
    body = {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 60, "stream": True}
    async with asyncio.timeout(5):  # the admission deadline is 30 s: waiting on itself is the bug
        with pytest.raises(AdmissionUnavailable) as info:
            await rig.pipeline(snapshot_with(only)).completions(body, "t5")
    assert info.value.status == 503 and info.value.retry_after_s >= 1
    assert rig.scheduler.admission.inflight_tokens() == {} and rig.scheduler.admission.waiting() == 0
    # An unrelated request is served at once afterwards.
    out = await rig.pipeline(snapshot_with(only)).completions({"model": MODEL, "prompt": "a", "max_tokens": 5}, "t6")
    assert out["choices"]


async def test_render_only_counts_a_native_prompt_and_its_verdict_never_refuses_it(
    rig: Rig, limiter: TokenRateLimiter
) -> None:
    # Render cannot know a response only the engine stored: its 4xx costs the count, not the request.
    rig.upstreams.override("render", "render", respond(404, error_json(404, "Response resp_x not found", "NotFoundError")))
    roomy = KeyLimit("e" * 64, "team-e", 10_000)
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 5, "previous_response_id": "resp_x"}
    out = await rig.pipeline(snapshot_with(*PLAIN)).responses(dict(body), keyed("t11", roomy))
    assert out["path"] == "/v1/responses"
    (count,) = rig.upstreams.calls_of("render")
    assert count.path == "/v1/responses/render" and count.body["mm_payload"] == "none"  # ids only, no tensors
    assert rig.native.calls == [("e1", "/v1/responses", body)]  # the client's body, as sent
    assert limiter.used(roomy.key_id) == prompt_bound("responses", body)[0] + 5
