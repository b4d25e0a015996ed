"""The render config's timeout_ms bounds each whole render and derender call, not each phase of it.

A per-phase timeout (connect, each read) lets a sidecar that answers slowly, or trickles its
bytes, pass them all. The fake sidecar here (on 127.0.0.1, reached with the production client)
takes far longer than the bound to answer: the call ends at the bound with render's own error.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from serving.pipeline.derender.session import StreamingRenderSession
from serving.pipeline.errors import DerenderError, RenderUnavailable
from serving.pipeline.render.client import RenderClient
from tests.serving.loopback import LoopbackClient

BOUND_S = 0.2


def slow_sidecar() -> LoopbackClient:
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(3600)
        return httpx.Response(500)

    return LoopbackClient(handler)  # the production client, the sidecar on 127.0.0.1


async def test_a_render_call_is_bounded_as_a_whole() -> None:
    async with slow_sidecar() as client, asyncio.timeout(30):  # the watchdog, far above the bound
        render = RenderClient(client, "http://render.test", BOUND_S)
        with pytest.raises(RenderUnavailable) as info:
            await render.render_chat({"model": "tiny", "messages": []}, "r1")
    assert info.value.reason == "timeout"


async def test_a_derender_call_is_bounded_as_a_whole() -> None:
    async with slow_sidecar() as client, asyncio.timeout(30):
        render = RenderClient(client, "http://render.test", BOUND_S)
        with pytest.raises(DerenderError) as info:
            await render.derender_chat({"choices": []}, prompt_token_ids=[1], chat_request={"messages": []}, model="tiny")
    assert info.value.status == 504


CHUNK_EVENT = {"request_id": "gen-1", "choices": [{"index": 0, "token_ids": [5], "finish_reason": None}]}


async def test_a_streamed_chunk_is_bounded_by_its_session_as_a_whole() -> None:
    async with slow_sidecar() as client, asyncio.timeout(30):
        render = RenderClient(client, "http://render.test", BOUND_S)
        session = StreamingRenderSession(render, "chat", {"model": "tiny", "messages": []}, [1],
                                         request_id="r1", public_id="chatcmpl-1")
        with pytest.raises(DerenderError) as info:
            await session.derender(CHUNK_EVENT)
    assert info.value.status == 504 and "derender of a chunk" in str(info.value)


async def test_a_streamed_chunk_call_keeps_no_deadline_of_its_own() -> None:
    """The session's bound (the same timeout_ms, started first) always ends first: the call
    itself schedules no timer, neither a whole-call one nor the reads' (two a chunk fewer)."""
    async with slow_sidecar() as client:
        render = RenderClient(client, "http://render.test", BOUND_S)
        call = render.derender_chunk("chat", CHUNK_EVENT, stream_state=None, prompt_tokens=1, prompt_token_ids=[1],
                                     request={"messages": []}, model="tiny")
        with pytest.raises(TimeoutError):  # the caller's bound, not a DerenderError of the call's own
            await asyncio.wait_for(call, BOUND_S * 3)
