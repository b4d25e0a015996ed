"""The native path: what goes to an engine's own OpenAI API, why, and how it is relayed; the
engines' native API is a fake (``router_fakes.NativeEngines``) served on 127.0.0.1 and reached
with the production client (``loopback.LoopbackClient``, the ``rig`` fixture)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from serving.pipeline.engine.native import (
    NativeEstimate,
    NativeStream,
    native_reason,
    prompt_bound,
    requested_output,
    sequences,
)
from serving.pipeline.errors import EngineError, NoCapacity, RequestError, UpstreamRequestError
from serving.pipeline.response import Response
from tests.serving.fakes import MODEL, error_json
from tests.serving.router_fakes import Rig, chat_body, engine, respond, snapshot_with

PLAIN = (engine("e1", native_openai=True), engine("e2", native_openai=True))  # tokens-only fleet
WITH_TOKENIZER = (engine("e1", native_openai=True), engine("e2", native_openai=True, tokenizer=True))



@pytest.mark.parametrize(
    ("kind", "body", "reason"),
    [
        ("chat", chat_body(stop=["\n"]), "stop_strings"),
        ("chat", chat_body(stop="x"), "stop_strings"),
        ("chat", chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
         "structured_output"),
        ("chat", chat_body(response_format={"type": "json_object"}), "structured_output"),
        ("chat", chat_body(guided_regex="a+"), "structured_output"),
        ("chat", chat_body(tool_choice="required", tools=[{"type": "function", "function": {"name": "f"}}]),
         "forced_tool_choice"),
        ("chat", chat_body(tool_choice={"type": "function", "function": {"name": "f"}}), "forced_tool_choice"),
        ("completions", {"model": MODEL, "prompt": "x", "echo": True}, "echo"),
        ("responses", {"model": MODEL, "input": "x"}, None),  # the chat token path, from render
        ("responses", {"model": MODEL, "input": "x", "previous_response_id": "resp_1"},
         "api:responses:previous_response_id"),
        ("responses", {"model": MODEL, "input": "x", "background": True}, "api:responses:background"),
        ("responses", {"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "api:responses:builtin_tools"),
        ("responses", {"model": MODEL, "input": "x", "tools": [{"type": "function", "name": "f"}],
                       "tool_choice": {"type": "function", "name": "f"}}, "forced_tool_choice"),
        ("responses", {"model": MODEL, "input": "x", "text": {"format": {"type": "json_object"}}}, "structured_output"),
        ("messages", {"model": MODEL, "messages": []}, None),  # the chat token path, from render
        ("messages", {"model": MODEL, "messages": [], "stop_sequences": ["x"]}, "stop_strings"),
        ("messages", {"model": MODEL, "messages": [], "tools": [{"name": "f"}], "tool_choice": {"type": "any"}},
         "forced_tool_choice"),
        ("chat", chat_body(stop=[], response_format={"type": "text"}, tool_choice="auto"), None),
        ("chat", chat_body(stop_token_ids=[5]), None),
    ],
)
def test_native_reason_on_a_tokens_only_fleet(kind: str, body: dict[str, Any], reason: str | None) -> None:
    assert native_reason(kind, body, snapshot_with(*PLAIN), MODEL) == reason


def test_a_tokenizer_loaded_engine_takes_engine_tokenizer_features_token_only() -> None:
    snap = snapshot_with(*WITH_TOKENIZER)
    assert native_reason("chat", chat_body(stop=["\n"]), snap, MODEL) is None
    assert native_reason("completions", {"model": MODEL, "prompt": "x", "echo": True}, snap, MODEL) == "echo"
    assert native_reason("chat", chat_body(), snapshot_with(*PLAIN, enable=False), MODEL) == "render_disabled"


async def test_a_stop_string_on_a_tokens_only_fleet_goes_native(rig: Rig) -> None:
    body = chat_body(stop=["\n"], max_tokens=5)
    out = await rig.pipeline(snapshot_with(*PLAIN)).chat(body, "n1")
    assert out == {"id": "native", "object": "native", "served_by": "e1", "path": "/v1/chat/completions"}
    assert rig.native.calls == [("e1", "/v1/chat/completions", body)]
    # Render is asked for the prompt's token count (admission), never for a generate.
    assert [c.path for c in rig.upstreams.calls] == ["/v1/chat/completions/render"]
    assert rig.counters.get("motor_route_decisions_total", path="native", reason="stop_strings") == 1


async def test_a_stop_string_goes_token_only_to_the_tokenizer_engine(rig: Rig) -> None:
    await rig.pipeline(snapshot_with(*WITH_TOKENIZER)).chat(chat_body(stop=["\n"]), "n2")
    assert rig.native.calls == []
    assert [g.host for g in rig.upstreams.calls_of("generate")] == ["e2"]


@pytest.mark.parametrize("kind", ["responses", "messages"])
async def test_responses_and_messages_pass_through(rig: Rig, kind: str) -> None:
    body = {"model": MODEL, "input": "hi"} if kind == "responses" else {"model": MODEL, "max_tokens": 5, "messages": []}
    # A sidecar without these APIs' render routes (older than vLLM 0.33).
    rig.upstreams.override("render", "render", respond(404, {"detail": "Not Found"}))
    out = await getattr(rig.pipeline(snapshot_with(*PLAIN)), kind)(body, "n3")
    assert out["path"] == f"/v1/{kind}"
    assert rig.counters.get("motor_route_decisions_total", path="native", reason=f"api:{kind}") == 1


async def test_native_streams_are_relayed_and_closed(rig: Rig) -> None:
    stream = await rig.pipeline(snapshot_with(*PLAIN)).chat(chat_body(stop=["x"], stream=True), "n4")
    assert isinstance(stream, Response) and isinstance(stream.body, NativeStream)
    assert rig.scheduler.load.snapshot() == {"e1": 1}  # held while the stream is open
    raw = b"".join([chunk async for chunk in stream.frames()])
    assert raw.endswith(b"data: [DONE]\n\n") and b'"content":"hi"' in raw


async def test_a_native_stream_never_read_is_released_by_aclose(rig: Rig) -> None:
    stream = await rig.pipeline(snapshot_with(*PLAIN)).completions({"model": MODEL, "prompt": "x", "echo": True,
                                                                     "stream": True}, "n5")
    assert isinstance(stream, Response) and isinstance(stream.body, NativeStream) and rig.native.open_streams
    await stream.aclose()


async def test_with_obfuscation_on_native_requests_are_refused(rig: Rig) -> None:
    with pytest.raises(RequestError) as info:
        await rig.pipeline(snapshot_with(*PLAIN, obfuscation=True)).chat(chat_body(stop=["\n"]), "n6")
    assert info.value.status == 400 and "obfuscation" in info.value.message
    assert rig.native.calls == [] and rig.upstreams.calls == []
    assert rig.counters.get("motor_route_decisions_total", path="refused", reason="stop_strings") == 1


async def test_render_disabled_goes_native(rig: Rig) -> None:
    await rig.pipeline(snapshot_with(*PLAIN, enable=False)).completions({"model": MODEL, "prompt": "x"}, "n7")
    assert [p for _, p, _ in rig.native.calls] == ["/v1/completions"]


async def test_without_a_native_engine_it_is_503(rig: Rig) -> None:
    # The fleet has native engines, none available now: they may come back (a fleet that
    # never could serve it refuses it with 400: test_unservable.py).
    fleet = snapshot_with(engine("e1", native_openai=True, state="draining"), engine("e2"))
    with pytest.raises(NoCapacity):
        await rig.pipeline(fleet).chat(chat_body(stop=["\n"]), "n8")


async def test_a_failed_native_engine_is_retried_elsewhere_and_4xx_is_not(rig: Rig) -> None:
    rig.native.status["e1"] = 500
    out = await rig.pipeline(snapshot_with(*PLAIN)).chat(chat_body(stop=["\n"]), "n9")
    assert out["served_by"] == "e2"
    rig.native.status.update(e1=400, e2=400)
    with pytest.raises(UpstreamRequestError) as info:
        await rig.pipeline(snapshot_with(*PLAIN)).chat(chat_body(stop=["\n"]), "n10")
    assert info.value.status == 400
    rig.native.status.update(e1=502, e2=500)
    with pytest.raises(EngineError):
        await rig.pipeline(snapshot_with(*PLAIN)).chat(chat_body(stop=["\n"]), "n11")


@pytest.mark.parametrize(
    "answer",
    [respond(404, {"detail": "Not Found"}), respond(501, error_json(501, "no", "NotImplementedError")),
     respond(403, error_json(403, "scale-out disabled", "Forbidden"))],
    ids=["route-404", "501", "403"],
)
async def test_an_engine_without_token_generate_sends_the_request_native(rig: Rig, answer: Any) -> None:
    for host in ("e1", "e2"):
        rig.upstreams.override(host, "generate", answer)
    out = await rig.pipeline(snapshot_with(*PLAIN)).chat(chat_body(), "n12")
    assert out["path"] == "/v1/chat/completions"
    assert len(rig.upstreams.calls_of("generate")) == 1  # no retry on a capability verdict
    assert set(rig.scheduler.breakers.snapshot().values()) == {"closed"}  # and no breaker count
    assert rig.counters.get("motor_route_decisions_total", path="native", reason="engine_capability") == 1


async def test_a_not_found_error_about_the_model_is_the_requests_fault(rig: Rig) -> None:
    err = error_json(404, "The model `tiny` does not exist.", "NotFoundError", "model")
    rig.upstreams.override("e1", "generate", respond(404, err))
    with pytest.raises(UpstreamRequestError) as info:
        await rig.pipeline(snapshot_with(*PLAIN)).chat(chat_body(), "n13")
    assert info.value.body() == err and rig.native.calls == []


async def test_a_missing_capability_with_obfuscation_on_is_not_sent_native(rig: Rig) -> None:
    rig.upstreams.override("e1", "generate", respond(404, {"detail": "Not Found"}))
    # The engines carry the deployment's key: only such engines may take obfuscated traffic.
    keyed = [replace(e, obfuscation_key_id="k1") for e in PLAIN]
    with pytest.raises(EngineError):
        await rig.pipeline(snapshot_with(*keyed, obfuscation=True, obfuscation_key_id="k1")).chat(chat_body(), "n14")
    assert rig.native.calls == []


# -- the native estimate (pure) --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "body", "requested"),
    [
        ("chat", {"max_completion_tokens": 7, "max_tokens": 9}, 7),  # vLLM's order: the first present
        ("chat", {"max_tokens": 9}, 9),
        ("chat", {}, None),  # up to the context
        ("completions", {}, 16),  # CompletionRequest's default
        ("completions", {"max_tokens": 0, "echo": True}, 1),  # echo without generation: one step
        ("responses", {"max_tokens": 1, "max_completion_tokens": 2}, None),  # not Responses fields
        ("responses", {"max_output_tokens": 50}, 50),
        ("messages", {"max_tokens": 8}, 8),
    ],
)
def test_the_output_bound_is_read_from_the_field_each_api_uses(
    kind: Any, body: dict[str, Any], requested: int | None
) -> None:
    assert requested_output(kind, body) == requested


def test_only_chat_and_completions_decode_n_sequences() -> None:
    assert [sequences(k, {"n": 4}) for k in ("chat", "completions", "responses", "messages")] == [4, 4, 1, 1]


def test_the_prompt_bound_counts_ids_exactly_and_text_by_its_bytes() -> None:
    assert prompt_bound("completions", {"prompt": [5, 6, 7]}) == (3,)
    assert prompt_bound("completions", {"prompt": [[5, 6], [7]]}) == (2, 1)
    assert prompt_bound("completions", {"prompt": ["ab", "ñ"]}) == (3, 3)  # UTF-8 bytes, + a BOS each
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "héllo"}]}
    assert prompt_bound("chat", chat) == (len(json.dumps(chat, ensure_ascii=False).encode()),)


def test_the_estimate_resolves_the_output_against_the_context_left() -> None:
    est = NativeEstimate.of("chat", {"max_tokens": 100, "n": 2}, [50], "render")
    assert (est.tokens(1000), est.output(1000)) == (50 + 2 * 100, 100)
    assert (est.tokens(120), est.output(120)) == (50 + 2 * 70, 70)  # capped at the room left
    to_context = NativeEstimate.of("responses", {}, [50], "render")
    assert (to_context.tokens(1000), to_context.output(1000)) == (1000, 950)
    # A prompt bound past the context counts as the context: the engine refuses anything longer.
    over = NativeEstimate.of("completions", {"prompt": ["x", "y"]}, [5000, 10], "bound")
    assert over.tokens(1000) == (999 + 1) + (10 + 16)
    assert over.output(1000) == 16
