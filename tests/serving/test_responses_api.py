"""The Responses API on the chat token path, over the fake sidecar and engines: what is rendered
and derendered where (the tools in the chat shape the derender's parsers read), the answer and
its event stream, the relay after an engine drops mid-stream, the client leaving, and what keeps
the native path (``previous_response_id``, a sidecar without the route) or is refused (the same
with obfuscation on). The real sidecar and engine: tests/integration/test_responses_real.py."""

from __future__ import annotations

from typing import Any

import pytest

from serving.pipeline.apis.responses import to_response
from serving.pipeline.apis.responses_stream import ResponsesEvents, ResponsesStream
from serving.pipeline.errors import RenderUnavailable, RequestError
from serving.pipeline.response import Response
from tests.serving.api_rigs import FLEET, NO_ROUTE, events
from tests.serving.fakes import CHAT_PROMPT, MODEL, StreamPlan, output_ids, text_of
from tests.serving.router_fakes import Rig, snapshot_with

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}


def request(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_output_tokens": 8, "input": "Say hi", **extra}


async def test_it_is_rendered_as_responses_and_derendered_as_a_chat(rig: Rig) -> None:
    body = request(tools=[TOOL], tool_choice="auto", instructions="Be brief.")
    out = await rig.pipeline(snapshot_with(*FLEET)).responses(body, "r1")
    assert [c.path for c in rig.upstreams.calls if c.kind in ("render", "derender")] == [
        "/v1/responses/render", "/v1/chat/completions/derender"]
    chat = rig.upstreams.calls_of("derender")[0].body["chat_request"]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL["parameters"]}}]
    assert chat["tool_choice"] == "auto"
    assert out["id"] == "resp_r1" and out["object"] == "response" and out["status"] == "completed"
    assert out["instructions"] == "Be brief." and out["tools"] == [TOOL] and out["incomplete_details"] is None
    assert [(i["type"], i["status"], i["content"][0]["text"]) for i in out["output"]] == [
        ("message", "completed", text_of(output_ids(CHAT_PROMPT, 0)[:-1]))]
    assert out["usage"]["input_tokens"] == len(CHAT_PROMPT) and out["usage"]["output_tokens"] == 3
    assert out["usage"]["total_tokens"] == len(CHAT_PROMPT) + 3
    assert rig.native.calls == []


def test_the_output_bound_makes_it_incomplete() -> None:
    chat = {"model": MODEL, "created": 1, "usage": {"prompt_tokens": 5, "completion_tokens": 2},
            "choices": [{"finish_reason": "length", "message": {"content": "Hi", "reasoning": "hm", "tool_calls": [
                {"id": "call_1", "function": {"name": "f", "arguments": "{"}}]}}]}
    out = to_response(chat, request(max_output_tokens=2), {"sampling_params": {"max_tokens": 2}}, "resp_x")
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
    # vLLM's order, and only the last item was cut.
    assert [(i["type"], i["status"]) for i in out["output"]] == [
        ("reasoning", None), ("message", "completed"), ("function_call", "incomplete")]
    assert out["output"][2]["call_id"] == "call_1" and out["max_output_tokens"] == 2
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == 0  # mixed: no exact count here


def test_a_cut_stream_gives_its_items_the_statuses_vllm_streams() -> None:
    # vLLM's stream closes every item but the last as ``completed`` and the last with the
    # finish reason's status, the reasoning item too (``emit_simple_reasoning_done``), and its
    # final response carries the streamed items: a streamed reasoning item is never ``None``,
    # unlike the whole answer's (test_the_output_bound_makes_it_incomplete).
    chunks = [{"model": MODEL, "choices": [{"delta": {"reasoning": "hm"}}]},
              {"model": MODEL, "choices": [{"delta": {"content": "Hi"}}]},
              {"model": MODEL, "choices": [{"delta": {"tool_calls": [
                  {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{"}}]},
                  "finish_reason": "length"}]},
              {"model": MODEL, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}]
    stream = ResponsesEvents(request(max_output_tokens=3, stream=True), {"sampling_params": {"max_tokens": 3}}, "resp_c")
    got = events(b"".join(frame for chunk in chunks for frame in stream.chunk(chunk)))
    done = [d["item"] for n, d in got if n == "response.output_item.done"]
    expected = [("reasoning", "completed"), ("message", "completed"), ("function_call", "incomplete")]
    assert [(i["type"], i["status"]) for i in done] == expected
    name, final = got[-1]
    assert name == "response.completed"  # not vLLM 0.33's response.incomplete: docs/messages-responses.md
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"] == done


async def test_a_stream_is_the_responses_event_protocol(rig: Rig) -> None:
    stream = await rig.pipeline(snapshot_with(*FLEET)).responses(request(stream=True), "r3")
    assert isinstance(stream, Response) and isinstance(stream.body, ResponsesStream)
    got = events(b"".join([f async for f in stream.frames()]))
    names = [n for n, _ in got]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert [d["sequence_number"] for _, d in got] == list(range(len(got)))
    assert all(d["type"] == n for n, d in got)
    text = "".join(d["delta"] for n, d in got if n == "response.output_text.delta")
    assert text == text_of(output_ids(CHAT_PROMPT, 0)[:-1])
    final = got[-1][1]["response"]
    assert final["id"] == "resp_r3" and final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["input_tokens"] == len(CHAT_PROMPT) and final["usage"]["output_tokens"] == 3


async def test_an_engine_dropping_mid_stream_is_relayed_unseen(rig: Rig) -> None:
    rig.upstreams.stream_plans["resp-r4"] = StreamPlan(end="raise", after=2)
    stream = await rig.pipeline(snapshot_with(*FLEET)).responses(request(stream=True), "r4")
    got = events(b"".join([f async for f in stream.frames()]))
    assert got[-1][0] == "response.completed" and not any(n == "error" for n, _ in got)
    first, relay = rig.upstreams.calls_of("generate")
    assert first.host != relay.host and relay.body["token_ids"] == CHAT_PROMPT + output_ids(CHAT_PROMPT, 0)[:2]


async def test_a_client_leaving_closes_the_engine_stream(rig: Rig) -> None:
    rig.upstreams.stream_plans["resp-r5"] = StreamPlan(end="hang", after=1)
    stream = await rig.pipeline(snapshot_with(*FLEET)).responses(request(stream=True), "r5")
    frames = stream.frames()
    assert b"response.created" in await anext(frames)
    await frames.aclose()  # type: ignore[attr-defined]
    await rig.client.loopback.settle()
    assert rig.upstreams.open_streams == set()


async def test_previous_response_id_keeps_the_native_path(rig: Rig) -> None:
    out = await rig.pipeline(snapshot_with(*FLEET)).responses(request(previous_response_id="resp_x"), "r6")
    assert out["path"] == "/v1/responses" and rig.upstreams.calls_of("generate") == []
    assert rig.counters.get("motor_route_decisions_total", path="native",
                            reason="api:responses:previous_response_id") == 1


async def test_a_sidecar_without_the_route_keeps_the_native_path(rig: Rig) -> None:
    rig.upstreams.override("render", "render", NO_ROUTE)
    out = await rig.pipeline(snapshot_with(*FLEET)).responses(request(), "r7")
    assert out["path"] == "/v1/responses"
    assert rig.counters.get("motor_route_decisions_total", path="native", reason="api:responses") == 1


async def test_with_obfuscation_on_nothing_goes_native(rig: Rig) -> None:
    pipeline = rig.pipeline(snapshot_with(*FLEET, obfuscation=True))
    with pytest.raises(RequestError):
        await pipeline.responses(request(previous_response_id="resp_x"), "r8")
    rig.upstreams.override("render", "render", NO_ROUTE)
    with pytest.raises(RenderUnavailable):
        await pipeline.responses(request(), "r9")
    assert rig.native.calls == [] and rig.upstreams.calls_of("generate") == []


def test_events_are_written_as_vllms_server_writes_them_utf8_and_compact() -> None:
    # vLLM writes each event with pydantic's model_dump_json: non-ASCII text as UTF-8, no
    # \u escapes (as the JSON answer of the same request goes out through the edge).
    stream = ResponsesEvents(request(stream=True), {"sampling_params": {"max_tokens": 3}}, "resp_u")
    out = b"".join(stream.chunk({"model": MODEL, "choices": [{"delta": {"content": "héllo 世界"}}]}))
    assert b'"delta":"h\xc3\xa9llo \xe4\xb8\x96\xe7\x95\x8c"' in out
    assert b"\\u" not in out and b'": ' not in out
