"""The Anthropic Messages API on the chat token path, over the fake sidecar and engines: what
is rendered and derendered where, the Messages answer and event stream, the relay after an
engine drops mid-stream, and what keeps the native path (a sidecar without the Messages render
route) or is refused (the same with obfuscation on). The real sidecar and engine:
tests/integration/test_messages_real.py."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from serving.pipeline.apis.messages_stream import MessagesStream
from serving.pipeline.errors import RenderUnavailable
from serving.pipeline.placement.scheduler import Placement
from serving.pipeline.response import Response
from tests.serving.api_rigs import FLEET, NO_ROUTE, events
from tests.serving.fakes import CHAT_PROMPT, MODEL, StreamPlan, output_ids, text_of
from tests.serving.router_fakes import Rig, engine, snapshot_with


def message(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi"}], **extra}


async def test_it_is_rendered_as_messages_and_derendered_as_a_chat(rig: Rig) -> None:
    out = await rig.pipeline(snapshot_with(*FLEET)).messages(message(), "m1")
    assert [c.path for c in rig.upstreams.calls if c.kind in ("render", "derender")] == [
        "/v1/messages/render", "/v1/chat/completions/derender"]
    derender = rig.upstreams.calls_of("derender")[0].body
    assert derender["prompt_token_ids"] == CHAT_PROMPT and derender["chat_request"]["max_tokens"] == 8
    assert out == {
        "id": "msg_m1", "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": text_of(output_ids(CHAT_PROMPT, 0)[:-1])}], "model": MODEL,
        "stop_reason": "end_turn", "usage": {"input_tokens": len(CHAT_PROMPT), "output_tokens": 3},
    }
    assert rig.native.calls == []
    assert rig.counters.get("motor_route_decisions_total", path="native", reason="api:messages") == 0


async def test_a_stream_is_anthropics_event_protocol(rig: Rig) -> None:
    stream = await rig.pipeline(snapshot_with(*FLEET)).messages(message(stream=True), "m2")
    assert isinstance(stream, Response) and isinstance(stream.body, MessagesStream)
    got = events(b"".join([f async for f in stream.frames()]))
    names = [n for n, _ in got]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert all(n == "content_block_delta" for n in names[2:-3])
    assert got[0][1]["message"]["id"] == "msg_m2" and got[0][1]["message"]["usage"]["input_tokens"] == len(CHAT_PROMPT)
    text = "".join(d["delta"]["text"] for n, d in got if n == "content_block_delta")
    assert text == text_of(output_ids(CHAT_PROMPT, 0)[:-1])
    assert got[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                          "usage": {"input_tokens": len(CHAT_PROMPT), "output_tokens": 3}}


async def test_an_engine_dropping_mid_stream_is_relayed_unseen(rig: Rig) -> None:
    rig.upstreams.stream_plans["resp-m3"] = StreamPlan(end="raise", after=2)
    stream = await rig.pipeline(snapshot_with(*FLEET)).messages(message(stream=True), "m3")
    got = events(b"".join([f async for f in stream.frames()]))
    assert [n for n, _ in got][-1] == "message_stop" and not any(n == "error" for n, _ in got)
    first, relay = rig.upstreams.calls_of("generate")
    assert first.host != relay.host and relay.body["token_ids"] == CHAT_PROMPT + output_ids(CHAT_PROMPT, 0)[:2]


async def test_a_client_leaving_closes_the_engine_stream(rig: Rig) -> None:
    plan = StreamPlan(end="hang", after=1)
    rig.upstreams.stream_plans["resp-m4"] = plan
    stream = await rig.pipeline(snapshot_with(*FLEET)).messages(message(stream=True), "m4")
    frames = stream.frames()
    assert b"message_start" in await anext(frames)
    await frames.aclose()  # type: ignore[attr-defined]
    await rig.client.loopback.settle()
    assert rig.upstreams.open_streams == set()


async def test_a_sidecar_without_the_route_keeps_the_native_path(rig: Rig) -> None:
    rig.upstreams.override("render", "render", NO_ROUTE)
    out = await rig.pipeline(snapshot_with(*FLEET)).messages(message(), "m5")
    assert out["path"] == "/v1/messages" and rig.native.calls[0][1] == "/v1/messages"
    assert rig.counters.get("motor_route_decisions_total", path="native", reason="api:messages") == 1
    assert rig.counters.get("motor_render_outcomes_total", source="local", result="native",
                            fallback_reason="capability") == 1


async def test_with_obfuscation_on_it_is_refused_rather_than_sent_native(rig: Rig) -> None:
    rig.upstreams.override("render", "render", NO_ROUTE)
    with pytest.raises(RenderUnavailable):
        await rig.pipeline(snapshot_with(*FLEET, obfuscation=True)).messages(message(), "m6")
    assert rig.native.calls == [] and rig.upstreams.calls_of("generate") == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefill_decode_pair_serves_it_as_a_chat(rig: Rig, stream: bool) -> None:
    """The topology is the chat token path's: a handoff (prefill, then decode) serves it too."""
    pair = (engine("e1", role="prefill", kv_transfer="pull"), engine("e2", role="decode", kv_transfer="pull"))
    rig.scheduler.topology_policy = lambda *_: Placement("handoff", pair)

    def prefill(_request: httpx.Request, body: Any) -> httpx.Response:  # a KV producer's answer
        return httpx.Response(200, json={**rig.upstreams.generate_response(body), "kv_transfer_params": {"remote": "p"}})

    rig.upstreams.override("e1", "generate", prefill)
    out = await rig.pipeline(snapshot_with(*pair)).messages(message(stream=stream), "m7")
    if isinstance(out, Response) and isinstance(out.body, MessagesStream):
        names = [n for n, _ in events(b"".join([f async for f in out.frames()]))]
        assert names[0] == "message_start" and names[-1] == "message_stop"
    else:
        assert out["type"] == "message" and out["stop_reason"] == "end_turn"
    assert [(g.host, g.body["sampling_params"]["max_tokens"]) for g in rig.upstreams.calls_of("generate")] == [
        ("e1", 1), ("e2", 8)]
    assert rig.native.calls == []
