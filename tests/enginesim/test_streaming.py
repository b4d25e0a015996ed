"""Streaming generate, faults, abort and disconnects against a real uvicorn server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from enginesim.testing import LiveServer, SSEReader, eventually, gen_body

pytestmark = pytest.mark.asyncio

GENERATE = "/inference/v1/generate"
DONE = b"data: [DONE]\n\n"
# A closed connection shows up as either, depending on whether the kernel sent FIN or RST.
CONNECTION_LOST = (httpx.RemoteProtocolError, httpx.ReadError)


def payload(frame: bytes) -> dict[str, Any]:
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n") and frame != DONE
    assert b"\n" not in frame[:-2]
    return json.loads(frame[len(b"data: ") : -2])


async def stream_frames(
    http: httpx.AsyncClient, server: LiveServer, body: dict[str, Any]
) -> list[bytes]:
    async with http.stream("POST", server.url + GENERATE, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        return await SSEReader(r).all_frames()


async def stats(http: httpx.AsyncClient, server: LiveServer) -> dict[str, Any]:
    return (await http.get(server.url + "/sim/stats")).json()


async def test_it_frames_sse_exactly_like_vllm(
    live_client: httpx.AsyncClient, fast_server: LiveServer
) -> None:
    body = gen_body(
        [5, 6, 7],
        {"max_tokens": 4, "ignore_eos": True},
        return_token_ids=True,
        stream_options={"include_usage": True},
    )
    frames = await stream_frames(live_client, fast_server, body)
    assert frames[-1] == DONE and DONE not in frames[:-1]
    events = [payload(f) for f in frames[:-1]]
    assert len(events) == 5  # one per token, then usage
    for i, event in enumerate(events[:4]):
        expected = ["request_id", "usage", "prompt_token_ids", "output_mode", "choices"]
        assert list(event) == (expected if i == 0 else [k for k in expected if k != "prompt_token_ids"])
        assert event["request_id"] == "generate-tokens-r1" and event["usage"] is None
        (choice,) = event["choices"]
        assert list(choice) == [
            "index", "finish_reason", "stop_reason", "token_ids",
            "routed_experts", "sampling_mask", "weight_versions", "logprobs",
        ]  # fmt: skip
        assert len(choice["token_ids"]) == 1
        assert choice["finish_reason"] == ("length" if i == 3 else None)
    assert events[0]["prompt_token_ids"] == [5, 6, 7]
    assert frames[4] == (
        b'data: {"request_id":"generate-tokens-r1","usage":{"prompt_tokens":3,"total_tokens":7,'
        b'"completion_tokens":4},"output_mode":"tokens","choices":[]}\n\n'
    )
    # The same request without streaming yields the same ids.
    full = (await live_client.post(fast_server.url + GENERATE, json=body)).json()
    streamed = [e["choices"][0]["token_ids"][0] for e in events[:4]]
    assert full["choices"][0]["token_ids"] == streamed


async def test_it_reports_continuous_usage_per_choice(
    live_client: httpx.AsyncClient, fast_server: LiveServer
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = gen_body([5], {"max_tokens": 3, "ignore_eos": True, "n": 2}, stream_options=options)
    events = [payload(f) for f in (await stream_frames(live_client, fast_server, body))[:-1]]
    assert [e["choices"][0]["index"] for e in events[:-1]] == [0, 1, 0, 1, 0, 1]
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 1, 2, 2, 3, 3]
    assert events[0]["usage"]["prompt_tokens_details"] is None
    assert events[-1]["usage"] == {"prompt_tokens": 1, "total_tokens": 7, "completion_tokens": 6}


async def test_it_interleaves_n_choices_matching_the_json_answer(
    live_client: httpx.AsyncClient, fast_server: LiveServer
) -> None:
    body = gen_body([8, 9], {"max_tokens": 6, "n": 3, "logprobs": 1})
    events = [payload(f) for f in (await stream_frames(live_client, fast_server, body))[:-1]]
    per_index: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for event in events:
        choice = event["choices"][0]
        per_index[choice["index"]] += choice["token_ids"]
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    full = (await live_client.post(fast_server.url + GENERATE, json=body)).json()
    assert {c["index"]: c["token_ids"] for c in full["choices"]} == per_index


async def test_it_sends_engine_validation_errors_in_band(
    live_client: httpx.AsyncClient, fast_server: LiveServer
) -> None:
    frames = await stream_frames(live_client, fast_server, gen_body(list(range(64))))
    assert len(frames) == 2 and frames[1] == DONE
    error = payload(frames[0])["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "input_tokens", 400)


async def test_it_closes_the_connection_before_the_first_token(
    live_client: httpx.AsyncClient, fast_server: LiveServer
) -> None:
    await live_client.post(fast_server.url + "/sim/faults", json={"mode": "fail_before_first_token"})
    with pytest.raises(CONNECTION_LOST):
        await live_client.post(fast_server.url + GENERATE, json=gen_body([5], stream=True))
    # Count 1: the next request is served.
    assert len(await stream_frames(live_client, fast_server, gen_body([5]))) >= 2


async def test_it_drops_the_connection_after_k_tokens(
    live_client: httpx.AsyncClient, fast_server: LiveServer
) -> None:
    fault = {"mode": "drop_after_tokens", "tokens": 3, "count": 2}
    await live_client.post(fast_server.url + "/sim/faults", json=fault)
    body = gen_body([5], {"max_tokens": 10, "ignore_eos": True}, stream=True)
    for _ in range(2):
        async with live_client.stream("POST", fast_server.url + GENERATE, json=body) as r:
            reader = SSEReader(r)
            tokens = [payload(await reader.next_frame() or b"")["choices"][0] for _ in range(3)]
            assert [t["finish_reason"] for t in tokens] == [None] * 3
            with pytest.raises(CONNECTION_LOST):
                await reader.next_frame()
    # Non-streaming requests get no answer at all.
    await live_client.post(fast_server.url + "/sim/faults", json=fault)
    with pytest.raises(CONNECTION_LOST):
        await live_client.post(fast_server.url + GENERATE, json={**body, "stream": False})
    await eventually(lambda: _idle(live_client, fast_server))


async def test_it_sends_an_error_event_after_k_tokens(
    live_client: httpx.AsyncClient, fast_server: LiveServer
) -> None:
    await live_client.post(
        fast_server.url + "/sim/faults", json={"mode": "error_event_after_tokens", "tokens": 2}
    )
    body = gen_body([5], {"max_tokens": 10, "ignore_eos": True}, stream_options={"include_usage": True})
    frames = await stream_frames(live_client, fast_server, body)
    assert len(frames) == 4 and frames[-1] == DONE
    assert [len(payload(f)["choices"][0]["token_ids"]) for f in frames[:2]] == [1, 1]
    error = payload(frames[2])
    assert list(error) == ["error"]
    assert (error["error"]["type"], error["error"]["code"]) == ("InternalServerError", 500)


async def test_it_fires_after_token_faults_at_the_end_of_a_short_output(
    live_client: httpx.AsyncClient, fast_server: LiveServer
) -> None:
    await live_client.post(
        fast_server.url + "/sim/faults", json={"mode": "error_event_after_tokens", "tokens": 50}
    )
    frames = await stream_frames(live_client, fast_server, gen_body([5], {"max_tokens": 2}))
    assert "error" in payload(frames[-2]) and frames[-1] == DONE


async def _idle(http: httpx.AsyncClient, server: LiveServer) -> bool:
    current = await stats(http, server)
    return current["active_streams"] == 0 and current["running"] == 0


async def test_it_stalls_after_k_tokens_until_the_client_leaves(
    live_client: httpx.AsyncClient, fast_server: LiveServer
) -> None:
    await live_client.post(
        fast_server.url + "/sim/faults", json={"mode": "stall_after_tokens", "tokens": 2}
    )
    body = gen_body([5], {"max_tokens": 10, "ignore_eos": True}, stream=True)
    timeout = httpx.Timeout(5.0, read=0.3)
    async with live_client.stream("POST", fast_server.url + GENERATE, json=body, timeout=timeout) as r:
        reader = SSEReader(r)
        assert (await reader.next_frame()) and (await reader.next_frame())
        assert (await stats(live_client, fast_server))["active_streams"] == 1
        with pytest.raises(httpx.ReadTimeout):
            await reader.next_frame()
    await eventually(lambda: _idle(live_client, fast_server))
    assert (await stats(live_client, fast_server))["disconnects"] == 1


async def test_it_aborts_only_the_engine_side_id(
    live_client: httpx.AsyncClient, slow_server: LiveServer
) -> None:
    body = gen_body([5], {"max_tokens": 1000, "ignore_eos": True}, stream=True)
    abort = slow_server.url + "/inference/v1/abort_requests"
    async with live_client.stream("POST", slow_server.url + GENERATE, json=body) as r:
        reader = SSEReader(r)
        assert payload(await reader.next_frame() or b"")["choices"][0]["finish_reason"] is None
        # The bare client id is a silent no-op ...
        assert (await live_client.post(abort, json={"request_ids": ["r1"]})).status_code == 200
        assert payload(await reader.next_frame() or b"")["choices"][0]["finish_reason"] is None
        # ... the engine-side id ends the stream with finish_reason "abort".
        await live_client.post(abort, json={"request_ids": ["generate-tokens-r1"]})
        frames = await reader.all_frames()
    assert frames[-1] == DONE
    last = payload(frames[-2])["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("abort", None)
    assert len(frames) < 100
    current = await stats(live_client, slow_server)
    assert (current["aborted"], current["active_streams"]) == (1, 0)


async def test_it_aborts_a_non_streaming_request(
    live_client: httpx.AsyncClient, slow_server: LiveServer
) -> None:
    body = gen_body([5], {"max_tokens": 1000, "ignore_eos": True}, request_id="ns")
    pending = asyncio.create_task(live_client.post(slow_server.url + GENERATE, json=body))

    async def running() -> bool:
        return (await stats(live_client, slow_server))["running"] == 1

    await eventually(running)
    await live_client.post(
        slow_server.url + "/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-ns"]}
    )
    choice = (await pending).json()["choices"][0]
    assert choice["finish_reason"] == "abort" and len(choice["token_ids"]) < 1000


async def test_it_stops_generating_when_the_client_disconnects(
    live_client: httpx.AsyncClient, slow_server: LiveServer
) -> None:
    body = gen_body([5], {"max_tokens": 1000, "ignore_eos": True}, stream=True)
    async with live_client.stream("POST", slow_server.url + GENERATE, json=body) as r:
        # Keep the reader referenced: a collected aiter_raw() closes the response early.
        reader = SSEReader(r)
        assert await reader.next_frame()
        snapshot = await stats(live_client, slow_server)
        assert snapshot["active_streams"] == 1, snapshot
    await eventually(lambda: _idle(live_client, slow_server))
    current = await stats(live_client, slow_server)
    assert (current["disconnects"], current["finished"]) == (1, {}), current
