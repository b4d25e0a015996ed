"""Derender waits for a sidecar that its supervisor is restarting, and only for so long."""

from __future__ import annotations

import json

import httpx
import pytest

from serving.pipeline.render.client import DerenderRetryable, RenderClient

RENDER_URL = "http://render.test"
CHUNK = {"choices": [{"index": 0, "token_ids": [5], "finish_reason": None}]}


def sidecar_down_for(calls: int) -> tuple[httpx.AsyncClient, list[dict[str, object]]]:
    """A client whose first ``calls`` derender posts find nothing listening, then the sidecar answers."""
    seen: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        if len(seen) <= calls:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"chunk": {"choices": [{"index": 0, "delta": {"content": "x"}}]}, "stream_state": {"n": 1}})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler)), seen


async def test_it_resumes_a_stream_on_the_restarted_sidecar_with_the_same_state() -> None:
    client, seen = sidecar_down_for(3)
    render = RenderClient(client, RENDER_URL, 5.0, derender_patience_s=10.0)
    chunk, state = await render.derender_chunk(
        "chat", CHUNK, stream_state={"n": 0}, prompt_tokens=2, prompt_token_ids=[1, 2], request={"messages": []},
        model="tiny",
    )
    assert chunk["choices"][0]["delta"] == {"content": "x"} and state == {"n": 1}
    # Four identical posts: the committed state went unchanged to the sidecar that came back.
    assert len(seen) == 4 and all(body == seen[0] for body in seen)
    assert seen[0]["stream_state"] == {"n": 0}
    await client.aclose()


async def test_it_gives_up_after_its_patience() -> None:
    client, seen = sidecar_down_for(1000)
    render = RenderClient(client, RENDER_URL, 5.0, derender_patience_s=0.3)
    with pytest.raises(DerenderRetryable, match="derender unreachable"):
        await render.derender_chat(
            {"choices": []}, prompt_token_ids=[1], chat_request={"messages": []}, model="tiny"
        )
    assert 2 <= len(seen) < 20  # retried with back-off, not in a hot loop
    await client.aclose()


async def test_it_does_not_wait_without_patience() -> None:
    client, seen = sidecar_down_for(1)
    render = RenderClient(client, RENDER_URL, 5.0)
    with pytest.raises(DerenderRetryable):
        await render.derender_completions([{}], prompt_token_ids=[[1]], completion_request={}, model="tiny")
    assert len(seen) == 1
    await client.aclose()
