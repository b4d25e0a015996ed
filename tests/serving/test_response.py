"""A request's ``Response`` owns what the request holds from the moment the pipeline takes it
(``serving/pipeline/response.py``): whatever step fails or is cancelled, the render count, the
key's charge and every engine stream already open are let go. Fake upstreams (``rig``, which
ends by asserting nothing leaked: admission, load, breaker slots, tasks)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from serving.pipeline.flow_control import rate_limit
from serving.pipeline.flow_control.rate_limit import KeyLimit, TokenRateLimiter
from serving.pipeline.render.sidecar_holds import SidecarHolds
from serving.pipeline.request_context import KeyGrant, RequestContext
from tests.serving.fakes import RENDER_URL
from tests.serving.router_fakes import Rig, chat_body

KEY = KeyLimit("f" * 64, "team-f", 10_000)


@pytest.fixture
def limiter(monkeypatch: pytest.MonkeyPatch) -> TokenRateLimiter:
    fresh = TokenRateLimiter()
    monkeypatch.setattr(rate_limit, "LIMITER", fresh)
    return fresh


async def test_it_closes_the_open_engine_streams_when_a_step_after_them_fails(
    rig: Rig, limiter: TokenRateLimiter, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*_: Any) -> None:  # the stream's derenderer cannot be built
        raise RuntimeError("tokenizer files unreadable")

    monkeypatch.setattr("serving.pipeline.service.stream_derenderer", broken)
    live = SidecarHolds()
    with pytest.raises(RuntimeError):
        await rig.pipeline(sidecar_holds=live).chat(
            chat_body(stream=True), RequestContext.granted("x1", KeyGrant(limit=KEY))
        )
    (generate,) = rig.upstreams.calls_of("generate")
    ((host, aborted),) = rig.upstreams.aborted_ids()  # the engine's slot freed at once
    assert host == generate.host and aborted.endswith(generate.body["request_id"])
    assert rig.scheduler.admission.inflight_tokens() == {} and live.counts() == {}
    assert limiter.used(KEY.key_id) == 0  # answered nothing: refunded


async def test_it_closes_the_open_engine_streams_when_the_client_leaves_before_the_stream_is_built(
    rig: Rig, limiter: TokenRateLimiter, monkeypatch: pytest.MonkeyPatch
) -> None:
    building = asyncio.Event()

    async def slow(*_: Any) -> None:  # a tokenizer still loading when the client hangs up
        building.set()
        await asyncio.Event().wait()

    monkeypatch.setattr("serving.pipeline.service.stream_derenderer", slow)
    live = SidecarHolds()
    task = asyncio.create_task(rig.pipeline(sidecar_holds=live).chat(
        chat_body(stream=True), RequestContext.granted("x2", KeyGrant(limit=KEY))
    ))
    await asyncio.wait_for(building.wait(), 5)
    assert live.counts() == {RENDER_URL: 1} and rig.scheduler.admission.inflight_tokens() != {}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(rig.upstreams.aborted_ids()) == 1
    assert rig.scheduler.admission.inflight_tokens() == {} and live.counts() == {}
    assert limiter.used(KEY.key_id) == 0
