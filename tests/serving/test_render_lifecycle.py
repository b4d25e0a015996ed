"""The render sidecar's lifecycle as the pipeline sees it: a sidecar without streaming derender
sends streams to the native path, and every request is counted on the sidecar it uses until it
no longer needs it (what the launcher's graceful restart waits for). Fake upstreams as in
test_native.py (tests/serving/router_fakes.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from serving.pipeline.engine.native import NativeStream, native_reason
from serving.pipeline.errors import NoCapacity, RequestError, error_body
from serving.pipeline.render.sidecar_holds import SidecarHolds
from serving.pipeline.response import Response
from serving.pipeline.service import EventStream
from tests.serving.fakes import MODEL, RENDER_URL, FakeUpstreams
from tests.serving.router_fakes import Rig, chat_body, engine, snapshot_with

NATIVE_FLEET = (engine("e1", native_openai=True), engine("e2", native_openai=True))
OLD_SIDECAR = {"streaming_derender": False}  # what the version probe writes for a sidecar < 0.27



async def read_all(stream: EventStream | NativeStream) -> bytes:
    async with asyncio.timeout(5):
        return b"".join([chunk async for chunk in stream.frames()])


# -- a sidecar without streaming derender ----------------------------------------------------------


def test_native_reason_names_the_missing_streaming_derender() -> None:
    old = snapshot_with(*NATIVE_FLEET, **OLD_SIDECAR)
    assert native_reason("chat", chat_body(stream=True), old, MODEL) == "no_streaming_derender"
    assert native_reason("completions", {"model": MODEL, "prompt": "x", "stream": True}, old, MODEL) == "no_streaming_derender"
    assert native_reason("chat", chat_body(stream=False), old, MODEL) is None  # derender of whole answers works
    assert native_reason("chat", chat_body(stream=True), snapshot_with(*NATIVE_FLEET), MODEL) is None


async def test_a_stream_goes_native_when_the_sidecar_lacks_streaming_derender(rig: Rig) -> None:
    body = chat_body(stream=True)
    stream = await rig.pipeline(snapshot_with(*NATIVE_FLEET, **OLD_SIDECAR)).chat(body, "s1")
    assert isinstance(stream, Response) and isinstance(stream.body, NativeStream)
    raw = await read_all(stream)
    assert raw.endswith(b"data: [DONE]\n\n") and b'"content":"hi"' in raw
    assert rig.native.calls == [("e1", "/v1/chat/completions", body)]
    # Render is asked for the prompt's token count only: neither derender nor token-only generate.
    assert [c.path for c in rig.upstreams.calls] == ["/v1/chat/completions/render"]
    assert rig.counters.get("motor_route_decisions_total", path="native", reason="no_streaming_derender") == 1


async def test_a_non_streaming_request_stays_token_only_on_such_a_sidecar(rig: Rig) -> None:
    out = await rig.pipeline(snapshot_with(*NATIVE_FLEET, **OLD_SIDECAR)).chat(chat_body(), "s2")
    assert isinstance(out, dict) and out["object"] == "chat.completion"
    assert rig.native.calls == []
    assert [c.kind for c in rig.upstreams.calls] == ["render", "generate", "derender"]


async def test_without_a_native_engine_the_stream_is_a_503_that_says_why(rig: Rig) -> None:
    tokens_only = snapshot_with(engine("e1"), engine("e2"), **OLD_SIDECAR)
    with pytest.raises(NoCapacity) as info:
        await rig.pipeline(tokens_only).chat(chat_body(stream=True), "s3")
    status, body = error_body(info.value)
    assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
    assert "older than vLLM 0.27" in body["error"]["message"] and "`stream: false`" in body["error"]["message"]
    assert rig.upstreams.calls == [] and rig.native.calls == []


async def test_with_obfuscation_on_the_stream_is_refused_never_sent_native(rig: Rig) -> None:
    obfuscated = snapshot_with(*NATIVE_FLEET, obfuscation=True, **OLD_SIDECAR)
    with pytest.raises(RequestError) as info:
        await rig.pipeline(obfuscated).chat(chat_body(stream=True), "s4")
    status, body = error_body(info.value)
    assert status == 400 and "obfuscation" in body["error"]["message"]
    assert "`stream: false`" in body["error"]["message"]
    assert rig.native.calls == [] and rig.upstreams.calls == []
    assert rig.counters.get("motor_route_decisions_total", path="refused", reason="no_streaming_derender") == 1


# -- what holds a sidecar --------------------------------------------------------------------------


async def test_a_stream_holds_its_sidecar_until_its_last_chunk(rig: Rig) -> None:
    live = SidecarHolds()
    stream = await rig.pipeline(sidecar_holds=live).chat(chat_body(stream=True), "h1")
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    assert live.counts() == {RENDER_URL: 1}
    seen: list[tuple[bytes, dict[str, int]]] = []
    async with asyncio.timeout(5):
        async for frame in stream.frames():
            seen.append((frame, live.counts()))
    chunks = [counts for frame, counts in seen if frame != b"data: [DONE]\n\n"]
    assert chunks and all(counts == {RENDER_URL: 1} for counts in chunks), seen  # held to the last one
    assert live.counts() == {}


async def test_a_stream_never_read_releases_its_sidecar_on_aclose(rig: Rig) -> None:
    live = SidecarHolds()
    stream = await rig.pipeline(sidecar_holds=live).chat(chat_body(stream=True), "h2")
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream) and live.counts() == {RENDER_URL: 1}
    await stream.aclose()
    await stream.aclose()  # idempotent: counted down once
    assert live.counts() == {}


async def test_a_stream_keeps_the_sidecar_it_began_with_after_the_snapshot_moves(rig: Rig) -> None:
    live = SidecarHolds()
    old = await rig.pipeline(sidecar_holds=live).chat(chat_body(stream=True), "h3")
    moved = snapshot_with(**{"base_url": "http://render.test:8101"})
    out = await rig.pipeline(moved, sidecar_holds=live).chat(chat_body(), "h4")
    assert isinstance(out, dict)
    assert live.counts() == {RENDER_URL: 1}  # the new request came and went on the replacement
    await read_all(old)
    assert live.counts() == {}


async def test_a_non_streaming_request_holds_its_sidecar_through_derender(rig: Rig, upstreams: FakeUpstreams) -> None:
    live = SidecarHolds()
    during: list[dict[str, int]] = []

    def derender(request: httpx.Request, body: Any) -> httpx.Response:
        during.append(live.counts())
        return upstreams._derender(request, body)

    upstreams.override("render", "derender", derender)
    await rig.pipeline(sidecar_holds=live).chat(chat_body(), "h5")
    assert during == [{RENDER_URL: 1}]
    assert live.counts() == {}


async def test_a_failed_request_releases_its_sidecar(rig: Rig) -> None:
    live = SidecarHolds()
    with pytest.raises(NoCapacity):
        await rig.pipeline(snapshot_with(engine("e1", state="draining")), sidecar_holds=live).chat(
            chat_body(stream=True), "h6"
        )
    assert live.counts() == {}


async def test_a_native_request_never_holds_the_sidecar(rig: Rig) -> None:
    changes: list[dict[str, int]] = []
    live = SidecarHolds()
    live.on_change = lambda: changes.append(live.counts())
    stream = await rig.pipeline(snapshot_with(*NATIVE_FLEET, **OLD_SIDECAR), sidecar_holds=live).chat(
        chat_body(stream=True), "h7"
    )
    await read_all(stream)
    assert changes == []


def test_live_streams_count_per_sidecar_and_release_once() -> None:
    changes: list[dict[str, int]] = []
    live = SidecarHolds()
    live.on_change = lambda: changes.append(live.counts())
    a1, a2, b = live.hold("http://a"), live.hold("http://a"), live.hold("http://b")
    assert live.counts() == {"http://a": 2, "http://b": 1}
    a1()
    a1()
    b()
    assert live.counts() == {"http://a": 1}
    a2()
    assert live.counts() == {}
    assert len(changes) == 6  # three holds, three releases: the double release is not a change
