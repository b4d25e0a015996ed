"""The Anthropic Messages API through the token path, compared with vLLM's own ``/v1/messages``.

A render sidecar and a tokenizer-loaded vLLM engine, both with the hermes tool and qwen3
reasoning parsers, behind a coordinator (``api_rigs.py``, shared with test_responses_real.py). Each greedy request (plain text, a system prompt and a
conversation with tool results, a forced tool, a stop sequence, ``max_tokens`` 1) is answered by
the coordinator through render, generate and the chat derender, and by the engine's own
``/v1/messages``: the content blocks, stop reason, stop sequence and usage are the same, whole
and streamed, read by the official ``anthropic`` client. None of them goes to the native path.
Errors come in Anthropic's shape with vLLM's status and type.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from motorsite import stack

from . import api_rigs
from .api_rigs import native_routes
from .conftest import API_KEY
from .test_fuzz_openai import assert_idle

pytestmark = pytest.mark.integration

cfg = api_rigs.cfg  # the stack both modules share (conftest.parser_rig)

USER = [{"role": "user", "content": "Tell me about lists in Python."}]
TOOL = {"name": "get_weather", "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}]},
]
CASES: dict[str, dict[str, Any]] = {
    "plain": {"messages": USER, "max_tokens": 12},
    "system-tool-results": {"system": "You are terse.", "messages": CONVERSATION, "tools": [TOOL], "max_tokens": 10},
    "forced-tool": {"messages": CONVERSATION[:1], "tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"},
                    "max_tokens": 40},
    "max-tokens-1": {"messages": USER, "max_tokens": 1},
    # Without reasoning: text and tool_use blocks.
    "text": {"messages": USER, "max_tokens": 12, "thinking": {"type": "disabled"}},
    "forced-tool-text": {"messages": CONVERSATION[:1], "tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"},
                         "max_tokens": 40, "thinking": {"type": "disabled"}},
}


HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def client(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=None, auth_token=API_KEY, max_retries=0, timeout=120.0)


def body(case: str, **extra: Any) -> dict[str, Any]:
    """A greedy request as the SDK takes it (its 2.17 signature has no ``temperature``)."""
    return {"model": "tiny", "extra_body": {"temperature": 0}, **CASES[case], **extra}


def blocks(message: anthropic.types.Message) -> list[dict[str, Any]]:
    """Content blocks without what is random on every answer (tool call ids, signatures)."""
    return [block.model_dump(exclude={"id", "signature"}, exclude_none=True) for block in message.content]


def summary(message: anthropic.types.Message) -> dict[str, Any]:
    return {"content": blocks(message), "stop_reason": message.stop_reason, "stop_sequence": message.stop_sequence,
            "usage": (message.usage.input_tokens, message.usage.output_tokens), "model": message.model,
            "role": message.role, "type": message.type}


def raw_streamed(base_url: str, request: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's events read off the wire (the SDK's stream helper refuses a tool call whose
    arguments the model left unfinished, which the tiny model's forced calls are)."""
    body = {**{k: v for k, v in request.items() if k != "extra_body"}, **request.get("extra_body", {}), "stream": True}
    events = []
    with httpx.stream("POST", base_url + "/v1/messages", json=body, headers=HEADERS, timeout=120.0,
                      trust_env=False) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = json.loads(line[6:])
                if data["type"] == "message_start":
                    data["message"].pop("id")
                if data["type"] == "content_block_start":
                    data["content_block"].pop("id", None)
                if data["type"] == "content_block_delta" and data["delta"]["type"] == "signature_delta":
                    data["delta"].pop("signature")
                events.append(data)
    return merged(events)


_DELTA_TEXT = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}


def merged(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``events`` with a block's consecutive deltas of one kind joined: how many tokens one delta
    carries depends on timing (derender coalesces what queued meanwhile), what they spell does not."""
    out: list[dict[str, Any]] = []
    for e in events:
        last = out[-1] if out else {}
        key = _DELTA_TEXT.get(e.get("delta", {}).get("type", ""))
        if (key and e["type"] == "content_block_delta" and last.get("type") == "content_block_delta"
                and last["index"] == e["index"] and last["delta"]["type"] == e["delta"]["type"]):
            last["delta"][key] += e["delta"][key]
            continue
        out.append(e)
    return out


def streamed(api: anthropic.Anthropic, request: dict[str, Any]) -> tuple[list[dict[str, Any]], anthropic.types.Message]:
    """The stream's events (random ids and signatures left out, deltas ``merged``) and the message
    the SDK builds from them."""
    events = []
    with api.messages.stream(**request) as stream:
        for e in stream:
            if e.type in ("text", "thinking", "input_json", "signature", "citation"):
                continue  # the SDK's own derived events
            data = e.model_dump(exclude_none=True)
            data.pop("snapshot", None)
            if e.type in ("content_block_stop", "message_stop"):  # the SDK's snapshot of what came before
                data.pop("content_block", None)
                data.pop("message", None)
            if e.type == "message_start":
                data["message"].pop("id")
            if e.type == "content_block_start":
                data["content_block"].pop("id", None)
            if e.type == "content_block_delta" and data["delta"].get("type") == "signature_delta":
                data["delta"].pop("signature")
            events.append(data)
        return merged(events), stream.get_final_message()


@pytest.mark.parametrize("case", list(CASES))
def test_an_answer_is_vllms_own(cfg: stack.StackConfig, case: str) -> None:
    before = native_routes(cfg)
    ours = client(cfg.coordinator_url).messages.create(**body(case))
    theirs = client(cfg.engine_urls[0]).messages.create(**body(case))
    assert summary(ours) == summary(theirs)
    assert ours.id.startswith("msg_")
    assert native_routes(cfg) == before  # the token path served it
    assert_idle(cfg, sims=False)


@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_is_vllms_own(cfg: stack.StackConfig, case: str) -> None:
    before = native_routes(cfg)
    if case == "forced-tool-text":
        assert raw_streamed(cfg.coordinator_url, body(case)) == raw_streamed(cfg.engine_urls[0], body(case))
        assert native_routes(cfg) == before
        return
    ours, ours_final = streamed(client(cfg.coordinator_url), body(case))
    theirs, theirs_final = streamed(client(cfg.engine_urls[0]), body(case))
    assert [e["type"] for e in ours][0] == "message_start" and ours[-1]["type"] == "message_stop"
    assert ours == theirs
    assert summary(ours_final) == summary(theirs_final)
    assert native_routes(cfg) == before
    assert_idle(cfg, sims=False)


def test_a_stop_sequence_ends_it_as_vllm_does(cfg: stack.StackConfig) -> None:
    text = client(cfg.engine_urls[0]).messages.create(**body("text")).content[0].text  # type: ignore[union-attr]
    stop = text[6:9]
    assert stop.strip() and text.find(stop) >= 6
    request = body("text", stop_sequences=[stop])
    before = native_routes(cfg)
    ours = client(cfg.coordinator_url).messages.create(**request)
    theirs = client(cfg.engine_urls[0]).messages.create(**request)
    assert summary(ours) == summary(theirs)
    assert ours.stop_reason == "stop_sequence" and ours.stop_sequence == stop
    ours_events, ours_final = streamed(client(cfg.coordinator_url), request)
    theirs_events, theirs_final = streamed(client(cfg.engine_urls[0]), request)
    assert summary(ours_final) == summary(theirs_final) == summary(ours)
    assert ours_events[-2] == theirs_events[-2]  # message_delta: stop reason, sequence, usage
    assert native_routes(cfg) == before


TYPES = {400: "invalid_request_error", 404: "not_found_error"}
ERRORS = [
    ("no-max-tokens", {"model": "tiny", "messages": USER}),
    ("unknown-model", {"model": "nope", "messages": USER, "max_tokens": 4}),
    ("bad-tool-choice", {"model": "tiny", "messages": USER, "max_tokens": 4, "tools": [TOOL],
                         "tool_choice": {"type": "tool", "name": "missing"}}),
]


@pytest.mark.parametrize(("name", "request_body"), ERRORS, ids=[n for n, _ in ERRORS])
def test_an_error_is_in_anthropics_shape_as_vllm_gives_it(
    cfg: stack.StackConfig, name: str, request_body: dict[str, Any]
) -> None:
    def post(base: str) -> httpx.Response:
        return httpx.post(base + "/v1/messages", json=request_body, headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=60.0, trust_env=False)

    ours, theirs = post(cfg.coordinator_url), post(cfg.engine_urls[0])
    assert ours.status_code == theirs.status_code, (ours.text, theirs.text)
    assert ours.json()["type"] == "error"
    # The type in vLLM 0.33's vocabulary (Anthropic's, by status: ``translate_error_type``); the
    # 0.32 engines here still send their exception's class name.
    assert ours.json()["error"]["type"] == TYPES[ours.status_code]
    if "max_tokens" in request_body:  # (the SDK refuses a body without it before sending)
        with pytest.raises(anthropic.APIStatusError) as raised:
            client(cfg.coordinator_url).messages.create(**request_body)
        assert raised.value.status_code == ours.status_code
