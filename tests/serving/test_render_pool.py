"""A render pool (serving/pipeline/render/pool.py) over fake sidecars: the pick by fewest
outstanding calls, render failover before the local tokenizer, a stream that loses its sidecar
mid-way and goes on on another member, and a mixed-version pool that sends each call to a
member that can serve it. Fakes as in test_render_lifecycle.py (tests/serving/router_fakes.py);
the real-sidecar proof is tests/integration/test_render_pool_real.py."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import httpx
import pytest

from serving.pipeline.engine.client import EngineClient
from serving.pipeline.engine.native import native_reason
from serving.pipeline.errors import RenderUnavailable
from serving.pipeline.render.pool import PoolState, RenderPool
from serving.pipeline.service import EventStream, ServingPipeline
from serving.pipeline.snapshot import FleetSnapshot, RenderMember
from tests.serving.fakes import MODEL, StreamPlan
from tests.serving.router_fakes import Rig, chat_body, engine, snapshot_with

A, B = "http://render.test:8100", "http://render2.test:8101"
POOL = (RenderMember(A, "0.33.0"), RenderMember(B, "0.33.0"))
# What the snapshot builder makes of a member whose probe recorded vLLM 0.26 (render_members).
OLD = RenderMember(A, "0.26.0", token_in=True, derender=True, streaming_derender=False)


def connect_error(request: httpx.Request, _body: Any) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def pool_snapshot(*members: RenderMember) -> FleetSnapshot:
    return snapshot_with(engine("e1"), engine("e2"), members=members, base_url=members[0].base_url)


def pipeline(rig: Rig, snapshot: FleetSnapshot, state: PoolState) -> ServingPipeline:
    pool = RenderPool(rig.client, snapshot.render, state)
    return ServingPipeline(snapshot, pool, EngineClient(rig.client), rig.scheduler, counters=rig.counters,
                           render_health=pool.health_view)


async def read_text(stream: EventStream) -> str:
    text = []
    async with asyncio.timeout(10):
        async for frame in stream.frames():
            for line in frame.decode().splitlines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    text += [c["delta"].get("content") or "" for c in chunk["choices"]]
    return "".join(text)


# -- the pick ------------------------------------------------------------------------------------


def test_the_pick_is_the_member_with_fewest_outstanding_calls_then_pool_order() -> None:
    state = PoolState()
    pool = RenderPool(httpx.AsyncClient(), pool_snapshot(*POOL).render, state)  # type: ignore[arg-type]
    assert pool.pick("token_in") == POOL[0]  # a tie: pool order
    state.outstanding[A] = 2
    state.outstanding[B] = 1
    assert pool.pick("token_in") == POOL[1]
    state.outstanding[B] = 3
    assert pool.pick("token_in") == POOL[0]
    # A member marked down in this process, or failing its probes, comes after every one that is up.
    state.health_of(A).mark(RenderUnavailable("refused", reason="unreachable"))
    assert pool.pick("token_in") == POOL[1]
    failing = RenderPool(httpx.AsyncClient(), pool_snapshot(replace(POOL[0], healthy=False), POOL[1]).render,  # type: ignore[arg-type]
                         PoolState())
    assert failing.pick("token_in") == POOL[1]


async def test_a_render_call_goes_to_the_member_with_fewer_calls_outstanding(rig: Rig) -> None:
    held = asyncio.Event()
    release = asyncio.Event()

    async def slow(request: httpx.Request, body: Any) -> httpx.Response:
        held.set()
        await release.wait()
        return rig.upstreams._render(request, body)

    rig.upstreams.override("render", "render", slow, times=1)
    state = PoolState()
    serving = pipeline(rig, pool_snapshot(*POOL), state)
    first = asyncio.create_task(serving.chat(chat_body(max_tokens=3), "p1"))
    await held.wait()  # A holds one call
    assert state.outstanding == {A: 1}
    await serving.chat(chat_body(max_tokens=3), "p2")
    assert [c.host for c in rig.upstreams.calls_of("render")] == ["render", "render2"]
    release.set()
    await first
    assert not state.outstanding  # every call counted down


# -- render failover -------------------------------------------------------------------------------


async def test_render_tries_another_member_before_the_local_tokenizer(rig: Rig) -> None:
    rig.upstreams.override("render", "render", connect_error)
    state = PoolState()
    serving = pipeline(rig, pool_snapshot(*POOL), state)
    out = await serving.chat(chat_body(max_tokens=3), "f1")
    assert out["object"] == "chat.completion"
    assert [c.host for c in rig.upstreams.calls_of("render")] == ["render", "render2"]
    assert rig.counters.get("motor_render_outcomes_total", source="render", result="ok", fallback_reason="") == 1
    # A is down for the process now: the next request goes straight to B, never to the local tokenizer.
    await serving.chat(chat_body(max_tokens=3), "f2")
    assert [c.host for c in rig.upstreams.calls_of("render")] == ["render", "render2", "render2"]
    assert state.health_of(A).skip() and not state.health_of(B).skip()


# -- a stream that loses its sidecar ----------------------------------------------------------------


async def test_a_stream_goes_on_on_another_member_when_its_sidecar_is_lost(rig: Rig) -> None:
    rig.upstreams.default_plan = StreamPlan(tokens=8)
    undisturbed = await read_text(await pipeline(rig, pool_snapshot(*POOL), PoolState()).chat(
        chat_body(stream=True, max_tokens=8), "u1"))
    assert {c.host for c in rig.upstreams.calls_of("derender")} == {"render"}  # one member did it all

    rig.upstreams.calls.clear()
    # From the third chunk on, nothing listens at A any more.
    calls = 0

    async def dies(request: httpx.Request, body: Any) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls > 2:
            raise httpx.ConnectError("connection refused", request=request)
        return rig.upstreams._derender(request, body)

    rig.upstreams.override("render", "derender", dies)
    text = await read_text(await pipeline(rig, pool_snapshot(*POOL), PoolState()).chat(
        chat_body(stream=True, max_tokens=8), "u2"))
    assert text == undisturbed and len(text) > 0
    hosts = [c.host for c in rig.upstreams.calls_of("derender")]
    assert hosts[:3] == ["render", "render", "render"] and "render2" in hosts[3:]


# -- a mixed-version pool ---------------------------------------------------------------------------


async def test_a_mixed_version_pool_derenders_streams_only_on_the_member_that_can(rig: Rig) -> None:
    mixed = pool_snapshot(OLD, POOL[1])
    # Some member can derender a stream: the stream stays token-only.
    assert native_reason("chat", chat_body(stream=True), mixed, MODEL) is None
    state = PoolState()
    await read_text(await pipeline(rig, mixed, state).chat(chat_body(stream=True, max_tokens=5), "m1"))
    derenders = rig.upstreams.calls_of("derender")
    assert derenders and {c.host for c in derenders} == {"render2"}
    # A whole answer's derender and a render may go to the old member (it leads the pool order).
    rig.upstreams.calls.clear()
    await pipeline(rig, mixed, state).chat(chat_body(max_tokens=3), "m2")
    assert [c.host for c in rig.upstreams.calls_of("derender")] == ["render"]
    # No member can: the stream goes native, as a single old sidecar sends it.
    only_old = pool_snapshot(OLD, replace(OLD, base_url=B))
    assert native_reason("chat", chat_body(stream=True), replace(
        only_old, render=replace(only_old.render, streaming_derender=False)), MODEL) == "no_streaming_derender"


@pytest.mark.parametrize("members", [(), POOL])
def test_a_view_without_members_is_one_member_at_its_base_url(members: tuple[RenderMember, ...]) -> None:
    view = pool_snapshot(*POOL).render
    pool = RenderPool(httpx.AsyncClient(), replace(view, members=members), PoolState())  # type: ignore[arg-type]
    assert pool.base_urls == ((A,) if not members else (A, B))


async def test_a_call_goes_to_a_member_whose_probe_found_its_route(rig: Rig) -> None:
    """An older member without the Messages render route: the native path's prompt count for a
    Messages request goes to the member that serves it; chat renders go to either."""
    no_messages = replace(POOL[0], render_routes=frozenset({"chat", "completions"}))
    pool = RenderPool(rig.client, pool_snapshot(no_messages, POOL[1]).render, PoolState())
    assert pool.pick("token_in", "messages") == POOL[1]
    assert pool.pick("token_in", "chat") == no_messages
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    rig.upstreams.override("render2", "render", lambda request, _b: httpx.Response(200, json={"token_ids": [1, 2, 3]}))
    assert await pool.prompt_lengths("messages", body, "r1") == [3]
    assert [(c.host, c.path) for c in rig.upstreams.calls] == [("render2", "/v1/messages/render")]
    # Nothing serves it: render is unavailable for it (the caller's fallback), no member is called.
    only_old = RenderPool(rig.client, pool_snapshot(no_messages).render, PoolState())
    with pytest.raises(RenderUnavailable):
        await only_old.prompt_lengths("messages", body, "r2")
    assert len(rig.upstreams.calls) == 1


async def test_a_messages_render_for_the_token_path_goes_to_a_member_that_serves_it(rig: Rig) -> None:
    """The chat token path's Messages render (apis/messages.py) is a pool call like the others."""
    no_messages = replace(POOL[0], render_routes=frozenset({"chat", "completions"}))
    pool = RenderPool(rig.client, pool_snapshot(no_messages, POOL[1]).render, PoolState())
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    out = await pool.render_messages(body, "r3")
    assert out["token_ids"] and [(c.host, c.path) for c in rig.upstreams.calls] == [("render2", "/v1/messages/render")]
    with pytest.raises(RenderUnavailable):
        await RenderPool(rig.client, pool_snapshot(no_messages).render, PoolState()).render_messages(body, "r4")
