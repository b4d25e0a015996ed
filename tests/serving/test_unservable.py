"""A feature only a tokenizer-loaded engine can run, on a fleet that has none: render judges the
body first (a malformed one gets render's 400), a valid one gets a 400 saying why (as a
``--tokens-only`` vLLM engine answers), never the native path's 503 "no engine"; nothing reaches
an engine and nothing is held afterwards."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from serving.pipeline.errors import NoCapacity, RequestError, UpstreamRequestError, error_body
from serving.pipeline.request_checks import FeatureUnavailable, unservable
from tests.serving.fakes import MODEL, error_json
from tests.serving.router_fakes import Rig, assert_no_leaks, chat_body, engine, respond, snapshot_with

TOKENS_ONLY = (engine("e1"), engine("e2"))
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_body(response_format=JSON_SCHEMA), "response_format"),
        (chat_body(structured_outputs={"choice": ["a", "b"]}), "structured_outputs"),
        (chat_body(stop=["\n"]), "stop"),
        (chat_body(tool_choice="required", tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),
    ],
)
async def test_a_valid_body_is_a_400_naming_the_feature(rig: Rig, body: dict[str, Any], param: str) -> None:
    before = set(asyncio.all_tasks())
    with pytest.raises(FeatureUnavailable) as info:
        await rig.pipeline(snapshot_with(*TOKENS_ONLY)).chat(body, "u1")
    status, shown = error_body(info.value)
    assert status == 400 and shown["error"]["type"] == "BadRequestError"
    assert shown["error"]["param"] == param and "tokens-only" in shown["error"]["message"]
    assert [c.kind for c in rig.upstreams.calls] == ["render"]  # judged by render, sent nowhere
    assert rig.native.calls == []
    await assert_no_leaks(rig, before)


async def test_a_malformed_body_gets_renders_own_400(rig: Rig) -> None:
    verdict = error_json(400, "You can only use one kind of constraints for structured outputs", "BadRequestError")
    rig.upstreams.override("render", "render", respond(400, verdict))
    body = chat_body(structured_outputs={"choice": ["a"], "regex": "a+"})
    before = set(asyncio.all_tasks())
    with pytest.raises(UpstreamRequestError) as info:
        await rig.pipeline(snapshot_with(*TOKENS_ONLY)).chat(body, "u2")
    assert error_body(info.value)[1] == verdict  # render's words, not the fleet's
    assert rig.native.calls == [] and [c.kind for c in rig.upstreams.calls] == ["render"]
    await assert_no_leaks(rig, before)


async def test_with_render_away_the_fleets_refusal_stands(rig: Rig) -> None:
    def connect_error(request: Any, _body: Any) -> Any:
        import httpx

        raise httpx.ConnectError("refused", request=request)

    rig.upstreams.override("render", "render", connect_error)
    with pytest.raises(FeatureUnavailable):
        await rig.pipeline(snapshot_with(*TOKENS_ONLY)).completions(
            {"model": MODEL, "prompt": "x", "stop": "y"}, "u3"
        )


async def test_echo_needs_an_engines_own_api(rig: Rig) -> None:
    body = {"model": MODEL, "prompt": "x", "echo": True}
    with pytest.raises(FeatureUnavailable) as info:
        await rig.pipeline(snapshot_with(engine("e1", tokenizer=True))).completions(body, "u4")
    assert info.value.param == "echo" and "its own OpenAI API" in info.value.message
    assert [c.kind for c in rig.upstreams.calls] == ["render"]


def test_a_fleet_that_could_serve_it_is_not_refused() -> None:
    body = chat_body(response_format=JSON_SCHEMA)
    draining_native = snapshot_with(engine("e1", native_openai=True, state="draining"), engine("e2"))
    with_tokenizer = snapshot_with(engine("e1", tokenizer=True), engine("e2"))
    assert unservable(draining_native, MODEL, "structured_output", body) is None  # may come back: 503
    assert unservable(with_tokenizer, MODEL, "structured_output", body) is None
    # Only tokenizer features: the other native reasons keep their own answers.
    assert unservable(snapshot_with(*TOKENS_ONLY), MODEL, "no_streaming_derender", body) is None
    assert unservable(snapshot_with(*TOKENS_ONLY), MODEL, "local:logprobs", body) is None


def test_a_pd_pair_serving_its_own_api_could_serve_it() -> None:
    # Issue 33: the native path's P/D flow (topologies/native_pd.py), in either transfer mode; a
    # prefill and a decode of different modes make no pair.
    def pair(p_transfer: str, d_transfer: str) -> Any:
        return snapshot_with(
            engine("e1", role="prefill", native_openai=True, kv_transfer=p_transfer, state="draining"),
            engine("e2", role="decode", native_openai=True, kv_transfer=d_transfer),
        )

    body = chat_body(response_format=JSON_SCHEMA)
    for reason in ("api:responses", "api:messages", "echo", "structured_output"):
        assert unservable(pair("pull", "pull"), MODEL, reason, body) is None
        assert unservable(pair("push", "push"), MODEL, reason, body) is None
        assert unservable(pair("pull", "push"), MODEL, reason, body) is not None


@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("value", ["yes", ["a"], 5])
async def test_structured_outputs_that_is_not_an_object_is_the_schemas_400_on_every_fleet(
    rig: Rig, kind: str, value: Any
) -> None:
    # vLLM's own servers answer 500 here (their before-validator calls .get on it).
    body = chat_body(structured_outputs=value) if kind == "chat" else {"model": MODEL, "prompt": "x",
                                                                      "structured_outputs": value}
    before = set(asyncio.all_tasks())
    for fleet in (TOKENS_ONLY, (engine("e1", native_openai=True, tokenizer=True),)):
        with pytest.raises(RequestError) as info:
            await getattr(rig.pipeline(snapshot_with(*fleet)), kind)(dict(body), "u5")
        error = info.value.body()["error"]
        assert (error["type"], error["param"], error["code"]) == ("Bad Request", "body.structured_outputs", 400)
    assert rig.upstreams.calls == [] and rig.native.calls == []
    await assert_no_leaks(rig, before)


@pytest.mark.parametrize("value", [True, 5, [1], [["x"]], {"a": "b"}])
async def test_a_stop_of_the_wrong_type_is_the_schemas_400_before_routing(rig: Rig, value: Any) -> None:
    # Found by tests/integration/test_fuzz_openai.py: routing iterated `stop: true` (500).
    before = set(asyncio.all_tasks())
    for kind, body in (("chat", chat_body(stop=value)), ("completions", {"model": MODEL, "prompt": "x", "stop": value})):
        with pytest.raises(RequestError) as info:
            await getattr(rig.pipeline(snapshot_with(*TOKENS_ONLY)), kind)(body, "u6")
        assert (info.value.status, info.value.param) == (400, "body.stop")
    assert rig.upstreams.calls == [] and rig.native.calls == []
    await assert_no_leaks(rig, before)


async def test_a_stop_string_or_list_of_strings_passes(rig: Rig) -> None:
    await rig.pipeline(snapshot_with(engine("e1", tokenizer=True))).chat(chat_body(stop="x"), "u7")
    await rig.pipeline(snapshot_with(engine("e1", tokenizer=True))).chat(chat_body(stop=["x", "y"]), "u8")
    assert len(rig.upstreams.calls_of("generate")) == 2


# (Messages and Responses take the chat token path where render renders them; what only an
# engine's own Responses API serves: ``previous_response_id``. tests/serving/test_*_api.py.)
@pytest.mark.parametrize("kind", ["responses"])
async def test_responses_and_messages_on_a_fleet_without_any_native_engine_are_a_400_saying_why(
    rig: Rig, kind: str
) -> None:
    before = set(asyncio.all_tasks())
    fleet = snapshot_with(engine("e1", tokenizer=True), engine("e2"))  # token-only, a tokenizer or not
    with pytest.raises(FeatureUnavailable) as info:
        await getattr(rig.pipeline(fleet), kind)({"model": MODEL, "input": "hi", "max_tokens": 5,
                                                  "previous_response_id": "resp_1"}, "u5")
    status, shown = error_body(info.value)
    assert status == 400 and shown["error"]["type"] == "BadRequestError"
    assert "its own OpenAI API" in shown["error"]["message"] and f"/v1/{kind}" in shown["error"]["message"]
    assert rig.upstreams.calls == [] and rig.native.calls == []  # no render verdict, no engine
    await assert_no_leaks(rig, before)


@pytest.mark.parametrize("kind", ["responses"])
async def test_responses_and_messages_with_native_engines_all_unavailable_stay_a_503(rig: Rig, kind: str) -> None:
    before = set(asyncio.all_tasks())
    fleet = snapshot_with(engine("e1", native_openai=True, state="draining"), engine("e2"))  # may come back
    with pytest.raises(NoCapacity) as info:
        await getattr(rig.pipeline(fleet), kind)({"model": MODEL, "input": "hi", "max_tokens": 5,
                                                  "previous_response_id": "resp_1"}, "u6")
    assert error_body(info.value)[0] == 503
    assert rig.native.calls == []
    await assert_no_leaks(rig, before)
