"""Backpressure: a client that reads nothing makes every producer wait, within bounded buffers.

A multi-prompt streaming completion (one engine stream and one derender producer per prompt,
merged through ``MERGE_QUEUE_SIZE``) is read one frame, then left unread for a few thousand loop
turns. The engines must stop being read (pulled events stay under the sum of the bounds), the
derender calls must stop, and once the client reads again everything arrives and nothing leaked.
Runs with derender coalescing off and on: the coalescing reader reads no further ahead than the
plain one (it merges what one read of the engine stream brought, and reads only when asked).
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections import Counter
from typing import Any, AsyncIterator

import httpx
import pytest

from serving.pipeline.engine.client import EngineClient
from serving.pipeline.engine.requests import GENERATE_PREFIX
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Scheduler
from serving.pipeline.render.client import RenderClient
from serving.pipeline.response import Response
from serving.pipeline.service import EventStream, ServingPipeline
from serving.pipeline.streaming import fanout
from tests.serving.fakes import (
    MODEL,
    RENDER_URL,
    FakeUpstreams,
    SSEBody,
    StreamPlan,
    fleet_snapshot,
    parse_frames,
    text_of,
)
from tests.serving.in_process import InProcessClient

PROMPTS = 4
TOKENS = 120
QUEUE = 4  # MERGE_QUEUE_SIZE for the test: small, so the bound is what stops the producers
PAUSE_TURNS = 1500  # loop turns the client reads nothing; bounded, no wall clock


@pytest.fixture
def scheduler() -> Scheduler:
    return Scheduler(LoadTracker())


@pytest.fixture
def pulled(upstreams: FakeUpstreams) -> Counter[str]:
    """Engine events the coordinator has read, per engine request id (the engine's send side)."""
    counts: Counter[str] = Counter()

    def generate(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        rid = body["request_id"]
        events = FakeUpstreams.stream_events(body, TOKENS)

        async def agen() -> AsyncIterator[bytes]:
            for event in events:
                counts[rid] += 1
                yield ("data: " + json.dumps(event, separators=(",", ":")) + "\n\n").encode()
            yield b"data: [DONE]\n\n"

        upstreams.open_streams.add(rid)

        def on_close() -> None:
            upstreams.open_streams.discard(rid)
            upstreams.closed_streams.append(rid)

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=SSEBody(agen(), on_close))

    for host in ("e1", "e2"):
        upstreams.override(host, "generate", generate)
    return counts


@pytest.fixture
async def in_process(upstreams: FakeUpstreams) -> AsyncIterator[InProcessClient]:
    """The fakes in process, not over loopback: the bound asserted here is in engine events, which
    a socket's buffers would hide (``in_process.py`` says why)."""
    client = InProcessClient(upstreams.handler)
    yield client
    await client.aclose()


@pytest.fixture(params=[False, True], ids=["coalesce-off", "coalesce-on"])
def pipeline(request: pytest.FixtureRequest, in_process: InProcessClient, scheduler: Scheduler,
             monkeypatch: pytest.MonkeyPatch) -> ServingPipeline:
    monkeypatch.setattr(fanout, "MERGE_QUEUE_SIZE", QUEUE)
    snap = fleet_snapshot(derender_coalesce=request.param)
    return ServingPipeline(snap, RenderClient(in_process, RENDER_URL, 5.0), EngineClient(in_process), scheduler)


async def pause() -> None:
    for _ in range(PAUSE_TURNS):
        await asyncio.sleep(0)


async def test_it_makes_producers_wait_for_a_client_that_reads_nothing(
    pipeline: ServingPipeline, upstreams: FakeUpstreams, scheduler: Scheduler, pulled: Counter[str]
) -> None:
    before = asyncio.all_tasks()
    body = {"model": MODEL, "prompt": [f"p{i}" for i in range(PROMPTS)], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": TOKENS}
    stream = await pipeline.completions(body, "bp1")
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    async with asyncio.timeout(30):
        frames = stream.frames()
        raw = [await frames.__anext__()]

        await pause()
        read_at_pause = sum(pulled.values())
        derenders_at_pause = len(upstreams.calls_of("derender"))
        await pause()
        # The producers wait: nothing more was read from the engines or derendered.
        assert sum(pulled.values()) == read_at_pause
        assert len(upstreams.calls_of("derender")) == derenders_at_pause
        # ... within the bounds: the merge queue, one chunk per producer blocked on it and one in
        # its derender, each one read of its engine stream (one event a read here), coalescing or not.
        assert read_at_pause <= QUEUE + PROMPTS * 2 + 1
        assert read_at_pause < PROMPTS * (TOKENS + 1)  # far from everything

        raw += [f async for f in frames]
    chunks = parse_frames(b"".join(raw))
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    text: dict[int, str] = {}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            text[ch["index"]] = text.get(ch["index"], "") + ch["text"]
    gens = upstreams.calls_of("generate")
    assert sorted(text) == list(range(PROMPTS))
    expected = sorted(
        "".join(text_of(e["choices"][0]["token_ids"]) for e in FakeUpstreams.stream_events(g.body, TOKENS) if e["choices"])
        for g in gens
    )
    assert sorted(text.values()) == expected
    usage = [c for c in chunks[:-1] if c.get("usage") and not c["choices"]]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == PROMPTS * TOKENS
    assert sum(pulled.values()) == PROMPTS * (TOKENS + 1)

    # Nothing leaked: streams closed, load and admission released, no task left.
    assert upstreams.open_streams == set()
    assert scheduler.load.snapshot() == {}
    assert scheduler.admission.inflight_tokens() == {}
    gc.collect(1)
    for _ in range(20):
        stray = {t for t in asyncio.all_tasks() - before - {asyncio.current_task()}
                 if type(t.get_coro()).__name__ != "async_generator_athrow"}
        if not stray:
            break
        await asyncio.sleep(0)
    assert not stray, stray


async def test_a_client_that_leaves_while_producers_wait_releases_everything(
    pipeline: ServingPipeline, upstreams: FakeUpstreams, scheduler: Scheduler, pulled: Counter[str]
) -> None:
    before = asyncio.all_tasks()
    body = {"model": MODEL, "prompt": [f"p{i}" for i in range(PROMPTS)], "stream": True, "max_tokens": TOKENS}
    stream = await pipeline.completions(body, "bp2")
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    async with asyncio.timeout(30):
        frames = stream.frames()
        await frames.__anext__()
        await pause()
        await frames.aclose()  # the client hangs up while every producer is blocked
    assert upstreams.open_streams == set()
    assert sorted(rid for _, rid in upstreams.aborted_ids()) == sorted(
        GENERATE_PREFIX + g.body["request_id"] for g in upstreams.calls_of("generate"))
    assert scheduler.load.snapshot() == {}
    assert scheduler.admission.inflight_tokens() == {}
    gc.collect(1)
    for _ in range(20):
        stray = {t for t in asyncio.all_tasks() - before - {asyncio.current_task()}
                 if type(t.get_coro()).__name__ != "async_generator_athrow"}
        if not stray:
            break
        await asyncio.sleep(0)
    assert not stray, stray


async def test_a_client_that_leaves_while_the_engine_stalls_mid_stream_releases_everything(
    pipeline: ServingPipeline, upstreams: FakeUpstreams, scheduler: Scheduler
) -> None:
    """The stream is waiting on a stalled engine when the client leaves: nothing is left behind."""
    upstreams.default_plan = StreamPlan(after=3, end="hang")
    before = asyncio.all_tasks()
    stream = await pipeline.chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True},
                                 "bp3")
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    async with asyncio.timeout(30):
        frames = stream.frames()
        await frames.__anext__()
        await pause()
        await frames.aclose()
    assert upstreams.open_streams == set()
    assert scheduler.load.snapshot() == {}
    assert scheduler.admission.inflight_tokens() == {}
    for _ in range(20):
        stray = {t for t in asyncio.all_tasks() - before - {asyncio.current_task()}
                 if type(t.get_coro()).__name__ != "async_generator_athrow"}
        if not stray:
            break
        await asyncio.sleep(0)
    assert not stray, stray
