"""The Messages converters on chat answers and chunks of the shapes the chat derender gives:
block order, held text after a tool call, stop reasons, and an error after the stream started."""

from __future__ import annotations

import json
from typing import Any

from serving.pipeline.apis.messages import anthropic_error, chat_view, to_message
from serving.pipeline.apis.messages_stream import MessagesEvents

USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


def chunk(**delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def decoded(out: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    return [(b.split(b"\n")[0][7:].decode(), json.loads(b.split(b"\n")[1][6:])) for b in out]


def test_a_whole_answer_has_thinking_text_and_tool_use_in_that_order() -> None:
    chat = {"model": "tiny", "usage": USAGE, "choices": [{"finish_reason": "tool_calls", "stop_reason": None, "message": {
        "content": "ok", "reasoning": "hmm",
        "tool_calls": [{"id": "call_1", "function": {"name": "f", "arguments": '{"a": 1}'}}]}}]}
    out = to_message(chat, "msg_x")
    assert [b["type"] for b in out["content"]] == ["thinking", "text", "tool_use"]
    assert out["content"][2] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}
    assert out["stop_reason"] == "tool_use" and "stop_sequence" not in out
    assert out["usage"] == {"input_tokens": 7, "output_tokens": 5}


def test_a_stop_string_is_a_stop_sequence_and_an_empty_answer_one_empty_text_block() -> None:
    chat = {"model": "tiny", "usage": USAGE, "choices": [{"finish_reason": "stop", "stop_reason": "##",
                                                          "message": {"content": ""}}]}
    out = to_message(chat, "msg_y")
    assert out["content"] == [{"type": "text", "text": ""}]
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "##")


def test_text_during_a_tool_call_becomes_its_own_block_after_it() -> None:
    conv = MessagesEvents("msg_z", "tiny", 7)
    out = conv.chunk(chunk(role="assistant", content=""))
    out += conv.chunk(chunk(tool_calls=[{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": '{"a"'}}]))
    out += conv.chunk(chunk(content="stray"))
    out += conv.chunk(chunk(tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}]))
    out += conv.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    out += conv.chunk({"choices": [], "usage": USAGE})
    out += conv.end()
    got = decoded(out)
    assert [n for n, _ in got] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert got[1][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    assert got[5][1] == {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}
    assert got[6][1]["delta"] == {"type": "text_delta", "text": "stray"}
    assert got[8][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_an_error_after_the_start_closes_the_block_and_ends_without_message_stop() -> None:
    conv = MessagesEvents("msg_e", "tiny", 7)
    out = conv.chunk(chunk(reasoning="a"))
    out += conv.chunk({"error": {"message": "engines are busy", "type": "ServiceUnavailableError", "code": 503}})
    got = decoded(out)
    assert [n for n, _ in got][-3:] == ["content_block_delta", "content_block_stop", "error"]
    assert got[-3][1]["delta"]["type"] == "signature_delta"
    assert got[-1][1] == {"type": "error", "error": {"type": "overloaded_error", "message": "engines are busy"}}


def test_errors_take_anthropics_shape_and_an_engines_own_passes_as_it_is() -> None:
    openai = {"error": {"message": "bad", "type": "BadRequestError", "param": "x", "code": 400}}
    assert anthropic_error(400, openai) == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert anthropic_error(502, openai)["error"]["type"] == "api_error"
    theirs = {"type": "error", "error": {"type": "not_found_error", "message": "no"}}
    assert anthropic_error(404, theirs) == theirs


def test_the_chat_view_carries_renders_parse_context_and_decoding_options() -> None:
    rendered = {"sampling_params": {"stop": ["##"], "skip_special_tokens": False},
                "parse_context": {"tools": [], "tool_choice": None, "include_reasoning": True,
                                  "chat_template_kwargs": {"enable_thinking": False}}}
    view = chat_view({"model": "tiny", "max_tokens": 9, "stream": True, "messages": [{"role": "user"}]}, rendered)
    assert view["stop"] == ["##"] and view["skip_special_tokens"] is False and view["max_tokens"] == 9
    assert "tools" not in view and "tool_choice" not in view  # an empty tool list is no tool list for chat
    assert view["chat_template_kwargs"] == {"enable_thinking": False}
    assert view["stream_options"] == {"include_usage": True}


def test_events_are_written_as_vllms_server_writes_them_utf8_and_compact() -> None:
    # vLLM writes each event with pydantic's model_dump_json: non-ASCII text as UTF-8, no
    # \u escapes (as the JSON answer of the same request goes out through the edge).
    conv = MessagesEvents("msg_u", "tiny", 7)
    out = b"".join(conv.chunk(chunk(role="assistant", content="")) + conv.chunk(chunk(content="héllo 世界")))
    assert b'"text":"h\xc3\xa9llo \xe4\xb8\x96\xe7\x95\x8c"' in out
    assert b"\\u" not in out and b'": ' not in out
