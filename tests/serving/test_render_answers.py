"""Render's answer is checked as vLLM's GenerateRequest (protocol.py) before the pipeline runs it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from serving.pipeline.errors import RenderUnavailable
from serving.pipeline.render.client import RenderClient
from tests.serving.loopback import LoopbackClient

GOOD = {"request_id": "chatcmpl-r1", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}


@pytest.mark.parametrize(
    ("answer", "reason", "where"),
    [
        ({**GOOD, "token_ids": [1, "2"]}, "no_token_ids", "$.token_ids[1]"),
        ({**GOOD, "token_ids": []}, "no_token_ids", "$.token_ids"),
        ({**GOOD, "request_id": 7}, "malformed", "$.request_id"),
        ({**GOOD, "sampling_params": [4]}, "malformed", "$.sampling_params"),
        ({k: v for k, v in GOOD.items() if k != "sampling_params"}, "malformed", "sampling_params"),
    ],
)
async def test_an_unusable_generate_request_is_render_unavailable_and_says_where(
    answer: dict[str, Any], reason: str, where: str
) -> None:
    async def sidecar(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answer)

    async with LoopbackClient(sidecar) as client, asyncio.timeout(30):
        render = RenderClient(client, "http://render.test", 10.0)
        with pytest.raises(RenderUnavailable) as info:
            await render.render_chat({"model": "tiny", "messages": []}, "r1")
    assert info.value.reason == reason and where in str(info.value)


async def test_vllms_whole_generate_request_passes_as_it_came() -> None:
    whole = {**GOOD, "stream": False, "cache_salt": None, "priority": 0, "kv_transfer_params": None,
             "features": None, "sampling_params": {"max_tokens": 4, "temperature": 0.0, "stop_token_ids": [2]}}  # fmt: skip

    async def sidecar(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=whole)

    async with LoopbackClient(sidecar) as client, asyncio.timeout(30):
        assert await RenderClient(client, "http://render.test", 10.0).render_chat({"messages": []}, "r1") == whole
