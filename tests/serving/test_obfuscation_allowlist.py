"""The obfuscation boundary's response side: an allowlist of fields, scrubbed engine errors, no
engine-internal controls; pipeline tests run through the ``rig`` fixture (ends with the leak check)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from serving.pipeline.errors import UpstreamRequestError
from serving.pipeline.obfuscation.boundary import EngineBoundary
from serving.pipeline.obfuscation.fields import deobfuscate_event, deobfuscate_response, obfuscate_request
from serving.pipeline.obfuscation.mapping import ObfuscatedOutputInvalid, ObfuscationRefused, TokenMapping
from tests.serving.fakes import CHAT_PROMPT, VOCAB_SIZE, FakeUpstreams, StreamPlan, error_json, parse_frames
from tests.serving.router_fakes import Rig, chat_body, engine, snapshot_with

MAPPING = TokenMapping.from_key(b"allowlist-test-key-000001", VOCAB_SIZE)


def _response(**extra: Any) -> dict[str, Any]:
    return {
        "request_id": "generate-tokens-x", "model": "tiny", "created": 1, "output_mode": "tokens",
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "prompt_logprobs": None,
        "kv_transfer_params": None, "choices": [{"index": 0, "token_ids": [MAPPING.physical(5)],
                                                 "finish_reason": "stop", "stop_reason": None, "logprobs": None}],
        **extra,
    }


def test_known_fields_are_mapped_back() -> None:
    out = deobfuscate_response(_response(prompt_token_ids=[MAPPING.physical(9)]), MAPPING)
    assert out["choices"][0]["token_ids"] == [5]
    assert out["prompt_token_ids"] == [9]


@pytest.mark.parametrize("where", ["response", "choice"])
def test_an_unknown_id_carrying_field_is_refused_not_passed_through(where: str) -> None:
    body = _response()
    if where == "response":
        body["draft_token_ids"] = [MAPPING.physical(5)]
    else:
        body["choices"][0]["draft_token_ids"] = [MAPPING.physical(5)]
    with pytest.raises(ObfuscatedOutputInvalid, match="draft_token_ids"):
        deobfuscate_response(body, MAPPING)
    with pytest.raises(ObfuscatedOutputInvalid):
        deobfuscate_event(body, MAPPING)


def test_an_unknown_field_that_is_null_passes() -> None:
    assert deobfuscate_response(_response(future_field=None), MAPPING)["choices"][0]["token_ids"] == [5]


def test_an_in_band_engine_error_loses_its_text() -> None:
    physical = MAPPING.physical(7)
    event = {"error": {"message": f"Token id {physical} is out of vocabulary", "type": "BadRequestError",
                       "param": "prompt", "code": 400}}
    out = deobfuscate_event(event, MAPPING)
    assert str(physical) not in out["error"]["message"]
    assert (out["error"]["code"], out["error"]["param"], out["error"]["type"]) == (400, "prompt", "BadRequestError")


def test_extra_args_never_cross_the_boundary() -> None:
    request = {"request_id": "r", "token_ids": [1], "sampling_params": {"max_tokens": 4, "extra_args": {"ids": [5]}}}
    with pytest.raises(ObfuscationRefused) as info:
        obfuscate_request(request, MAPPING)
    assert info.value.param == "extra_args"


def _obfuscated(rig: Rig) -> Any:
    snap = snapshot_with(
        engine("e1", obfuscation_key_id=MAPPING.key_id), engine("e2", obfuscation_key_id=MAPPING.key_id),
        obfuscation=True, obfuscation_key_id=MAPPING.key_id,
    )
    return rig.pipeline(snap, boundary=EngineBoundary(MAPPING))


async def test_an_engine_4xx_is_scrubbed_of_physical_ids(rig: Rig) -> None:
    physical = MAPPING.physical(3)
    body = error_json(400, f"Token id {physical} is out of vocabulary", param="prompt")
    rig.upstreams.override("e1", "generate", lambda request, _b: httpx.Response(400, json=body))
    with pytest.raises(UpstreamRequestError) as info:
        await _obfuscated(rig).chat(chat_body(), "obf4xx")
    assert info.value.status == 400
    error = info.value.body()["error"]
    assert str(physical) not in error["message"]
    assert error["param"] == "prompt"


async def test_an_unknown_field_from_the_engine_is_a_502(rig: Rig) -> None:
    def generate(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        answer = FakeUpstreams.generate_response(body)
        answer["choices"][0]["spec_token_ids"] = [1, 2]
        return httpx.Response(200, json=answer)

    rig.upstreams.override("e1", "generate", generate)
    rig.upstreams.override("e2", "generate", generate)
    with pytest.raises(ObfuscatedOutputInvalid) as info:
        await _obfuscated(rig).chat(chat_body(), "obfunk")
    assert info.value.status == 502
    assert rig.upstreams.calls_of("derender") == []  # nothing unmapped went on to derender


@pytest.mark.parametrize("after", [0, 1], ids=["before-the-first-frame", "mid-stream"])
async def test_an_in_band_engine_4xx_is_scrubbed_in_a_stream_too(rig: Rig, after: int) -> None:
    rig.upstreams.default_plan = StreamPlan(end="error", after=after, error_code=400)
    stream = await _obfuscated(rig).chat(chat_body(stream=True), f"obfs{after}")
    frames = parse_frames(b"".join([f async for f in stream.frames()]))
    (error,) = [f["error"] for f in frames if isinstance(f, dict) and "error" in f]
    assert error["code"] == 400
    assert "engine failed mid-stream" not in error["message"]  # the engine's own text stays behind
    assert frames[-1] == "[DONE]"


async def test_without_obfuscation_an_engine_4xx_is_passed_unchanged(rig: Rig) -> None:
    body = error_json(400, "Token id 77 is out of vocabulary", param="prompt")
    rig.upstreams.override("e1", "generate", lambda request, _b: httpx.Response(400, json=body))
    with pytest.raises(UpstreamRequestError) as info:
        await rig.pipeline(snapshot_with(engine("e1"), engine("e2"))).chat(chat_body(), "plain4xx")
    assert info.value.body() == body


# --- what the engine receives: render's text-carrying fields stay behind --------------------------

SECRETS = ("lookup_salary", "Salary of an employee", "employee_id", "Captain Nemo", "tenant-acme")


def _render_with_text(fields: dict[str, Any]) -> Any:
    """Render's answer for a chat with tools, a reasoning parser and offsets, plus ``fields``."""
    def render(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        rendered = FakeUpstreams._generate_request("chatcmpl-leak", CHAT_PROMPT, body, True)
        rendered["parse_context"].update(
            tools=[{"type": "function", "function": {
                "name": "lookup_salary", "description": "Salary of an employee",
                "parameters": {"type": "object", "properties": {"employee_id": {"type": "string"}}}}}],
            tool_choice="auto", chat_template_kwargs={"persona": "Captain Nemo"},
        )
        rendered.update(
            reasoning_parser_kwargs={"chat_template_kwargs": {"persona": "Captain Nemo"}}, reasoning_ended=False,
            token_offsets=[[i, i + 1] for i in range(len(CHAT_PROMPT))], cache_salt="tenant-acme", **fields,
        )
        return httpx.Response(200, json=rendered)
    return render


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_no_tool_schema_kwargs_offsets_or_salt_reach_an_obfuscated_engine(rig: Rig, stream: bool) -> None:
    rig.upstreams.override("render", "render", _render_with_text({}))
    result = await _obfuscated(rig).chat(chat_body(stream=stream), "obfleak")
    if stream:
        frames = parse_frames(b"".join([f async for f in result.frames()]))  # type: ignore[union-attr]
        assert frames[-1] == "[DONE]" and not any(isinstance(f, dict) and "error" in f for f in frames)
    else:
        assert result["choices"][0]["message"]["content"]  # type: ignore[index]
    (call,) = rig.upstreams.calls_of("generate")
    wire = json.dumps(call.body)
    assert [s for s in SECRETS if s in wire] == []
    assert {"parse_context", "token_offsets", "reasoning_parser_kwargs", "reasoning_ended"}.isdisjoint(call.body)
    assert call.body["token_ids"] == MAPPING.to_physical(CHAT_PROMPT)
    assert call.body["cache_salt"] == MAPPING.salt("tenant-acme")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_multimodal_features_are_refused_before_admission(rig: Rig, stream: bool) -> None:
    features = {"mm_hashes": {"image": ["9f86d081884c7d65"]}, "mm_placeholders": {"image": [{"offset": 1, "length": 2}]},
                "kwargs_data": {"image": ["cGl4ZWxzIG9mIGEgcGFzc3BvcnQ="]}, "mm_metadata": None}
    rig.upstreams.override("render", "render", _render_with_text({"features": features}))
    with pytest.raises(ObfuscationRefused) as info:
        await _obfuscated(rig).chat(chat_body(stream=stream), "obfmm")
    assert (info.value.status, info.value.param) == (400, "messages")
    assert "multimodal" in str(info.value)
    assert rig.upstreams.calls_of("generate") == []  # the rig's teardown checks no quota is held
