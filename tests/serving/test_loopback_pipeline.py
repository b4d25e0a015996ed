"""The pipeline on the production upstream client (``Http11Client``) against the fake upstreams
served over 127.0.0.1 (``loopback.py``), not ``httpx.MockTransport``: a request is never sent
twice, and what the engines' connections do (a reset before the answer, a drop mid-stream, a
client that leaves) reaches the attempt policy and the relay, with nothing left open."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import httpx
import pytest

from serving.pipeline.engine.client import EngineClient
from serving.pipeline.http11 import Http11Client
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Scheduler
from serving.pipeline.render.client import RenderClient
from serving.pipeline.response import Response
from serving.pipeline.service import EventStream, ServingPipeline
from tests.serving.fakes import (
    CHAT_PROMPT,
    ENGINE_URLS,
    MODEL,
    RENDER_URL,
    FakeUpstreams,
    StreamPlan,
    fleet_snapshot,
    output_ids,
    parse_frames,
    text_of,
)
from tests.serving.leaks import assert_nothing_held
from tests.serving.loopback import Loopback, at_loopback

pytestmark = pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])

WATCHDOG_S = 10.0


@pytest.fixture
async def wired(upstreams: FakeUpstreams) -> AsyncIterator[tuple[Loopback, Http11Client, Scheduler]]:
    before = asyncio.all_tasks()
    loopback = Loopback(upstreams.handler)
    await loopback.serve(RENDER_URL, *ENGINE_URLS.values())
    client = Http11Client()
    scheduler = Scheduler(LoadTracker())
    yield loopback, client, scheduler
    await loopback.settle()  # every stream the client closed is closed at the fake engine too
    await client.aclose()
    await loopback.aclose()
    await assert_nothing_held(scheduler, before, upstreams.open_streams)


def pipeline_of(wired: tuple[Loopback, Http11Client, Scheduler], *instances: Any) -> ServingPipeline:
    loopback, client, scheduler = wired
    snapshot = at_loopback(fleet_snapshot(*instances), loopback.urls)
    return ServingPipeline(
        snapshot, RenderClient(client, loopback.urls[RENDER_URL], 5.0), EngineClient(client), scheduler
    )


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], **extra}


async def answer(result: Any) -> Any:
    async with asyncio.timeout(WATCHDOG_S):
        if isinstance(result, Response) and isinstance(result.body, EventStream):
            return parse_frames(b"".join([f async for f in result.frames()]))
        return result


def reset(request: httpx.Request, _body: Any) -> httpx.Response:
    raise httpx.ReadError("the engine took the request and went away")  # loopback.py: a reset


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_generate_whose_kept_alive_connection_resets_is_a_new_attempt_never_a_resend(
    wired: Any, upstreams: FakeUpstreams, stream: bool
) -> None:
    # Issue 31, finding 4. The first chat leaves a kept-alive connection to e1; the second one's
    # generate is written on it and the engine goes away without a byte of an answer (it may be
    # running it: a non-streaming generate sends nothing until it is done). The client hands the
    # failure to the attempt policy, which runs attempt 1 under its own id; it never writes the
    # same request, same id, a second time.
    pipeline = pipeline_of(wired)
    first = await answer(await pipeline.chat(chat_body(), "warm"))
    assert first["choices"][0]["message"]["content"] == text_of(output_ids(CHAT_PROMPT, 0))
    upstreams.override("e1", "generate", reset, times=1)

    out = await answer(await pipeline.chat(chat_body(stream=stream), "r1"))

    sent = [(g.host, g.body["request_id"]) for g in upstreams.calls_of("generate")]
    assert sent == [("e1", "chatcmpl-warm"), ("e1", "chatcmpl-r1"), ("e2", "chatcmpl-r1-a1")]
    if stream:
        assert out[-1] == "[DONE]" and not any("error" in f for f in out[:-1])
    else:
        assert out["choices"][0]["message"]["content"] == text_of(output_ids(CHAT_PROMPT, 0))


async def test_a_stream_dropped_midway_is_relayed_over_a_new_connection(wired: Any, upstreams: FakeUpstreams) -> None:
    upstreams.stream_plans["chatcmpl-r2"] = StreamPlan(end="raise", after=2)  # reset after two events
    pipeline = pipeline_of(wired)

    frames = await answer(await pipeline.chat(chat_body(stream=True), "r2"))

    assert frames[-1] == "[DONE]" and not any("error" in f for f in frames[:-1])
    first, relay = upstreams.calls_of("generate")
    committed = output_ids(CHAT_PROMPT, 0)[:2]  # the two events before the reset
    assert (first.host, relay.host) == ("e1", "e2")
    assert relay.body["token_ids"] == CHAT_PROMPT + committed  # continued from what the client has


async def test_a_stream_left_by_its_client_is_closed_at_the_engine(wired: Any, upstreams: FakeUpstreams) -> None:
    plan = StreamPlan(end="hang", after=1)
    upstreams.stream_plans["chatcmpl-r3"] = plan
    pipeline = pipeline_of(wired)
    stream = await pipeline.chat(chat_body(stream=True), "r3")
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    frames = stream.frames()
    async with asyncio.timeout(WATCHDOG_S):
        assert b"data:" in await anext(frames)
        await frames.aclose()  # the client went away with the engine still generating
        await wired[0].settle()
    assert upstreams.open_streams == set() and upstreams.closed_streams == ["chatcmpl-r3"]


async def test_a_malformed_engine_answer_is_an_engine_failure_and_goes_elsewhere(
    wired: Any, upstreams: FakeUpstreams
) -> None:
    # A body framed two ways (chunked and a length: a smuggling or splitting attempt, RFC 9112
    # 6.3) is the engine's fault, however good the body looks: the next attempt runs on the other
    # engine. (The hand-written parser read it as chunked and served the answer.)
    def framed_twice(request: httpx.Request, body: Any) -> httpx.Response:
        reply = json.dumps(FakeUpstreams.generate_response(body)).encode()
        raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 2\r\n\r\n"
        return httpx.Response(200, extensions={"loopback_raw": raw + b"%x\r\n%s\r\n0\r\n\r\n" % (len(reply), reply)})

    upstreams.override("e1", "generate", framed_twice, times=1)
    pipeline = pipeline_of(wired)

    out = await answer(await pipeline.chat(chat_body(), "r4"))

    assert out["choices"][0]["message"]["content"] == text_of(output_ids(CHAT_PROMPT, 0))
    assert [g.host for g in upstreams.calls_of("generate")] == ["e1", "e2"]


async def test_a_generate_answer_not_shaped_as_vllms_is_an_engine_failure_and_goes_elsewhere(
    wired: Any, upstreams: FakeUpstreams
) -> None:
    # A choice whose finish_reason is not a string (vLLM's GenerateResponse, protocol 3.4) is not
    # derendered: the attempt policy sees the engine's failure and the next attempt runs on e2.
    def bad_choice(request: httpx.Request, body: Any) -> httpx.Response:
        reply = FakeUpstreams.generate_response(body)
        reply["choices"][0]["finish_reason"] = 5
        return httpx.Response(200, json=reply)

    upstreams.override("e1", "generate", bad_choice, times=1)
    pipeline = pipeline_of(wired)

    out = await answer(await pipeline.chat(chat_body(), "r5"))

    assert out["choices"][0]["message"]["content"] == text_of(output_ids(CHAT_PROMPT, 0))
    assert [g.host for g in upstreams.calls_of("generate")] == ["e1", "e2"]
