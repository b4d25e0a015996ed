"""The render config's timeout_ms bounds each whole render and derender call, not each phase of it.

A per-phase timeout (connect, each read) lets a sidecar that answers slowly, or trickles its
bytes, pass them all. The fake sidecar here (on 127.0.0.1, reached with the production client)
takes far longer than the bound to answer: the call ends at the bound with render's own error.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

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
