"""The Responses API through the token path, compared with vLLM's own ``/v1/responses``.

A render sidecar and a tokenizer-loaded vLLM engine, both with the hermes tool and qwen3
reasoning parsers, behind a coordinator (``api_rigs.py``, shared with ``test_messages_real.py``).
Each greedy request (plain text, reasoning, tools with a tool choice, a forced call, one the
output bound cut, a conversation carrying a function call and its output, ``max_output_tokens``
1) is answered by the coordinator through render, generate and the chat derender, and by the engine's own ``/v1/responses``: the output items
(each one's status included), status, incomplete details and usage are the same, whole and
streamed (every ``output_item.done`` and the final response), read by the official
``openai`` client. None of them goes to the native path; ``previous_response_id`` does.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from motorsite import stack

from . import api_rigs
from .api_rigs import native_routes
from .conftest import API_KEY
from .test_fuzz_openai import assert_idle

pytestmark = pytest.mark.integration

cfg = api_rigs.cfg  # the stack both modules share (conftest.parser_rig)

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
]
CASES: dict[str, dict[str, Any]] = {
    "text": {"input": "Tell me about lists in Python.", "max_output_tokens": 12, "extra_body": NO_THINKING},
    "instructions-tool-output": {"instructions": "You are terse.", "input": CONVERSATION, "tools": [TOOL],
                                 "max_output_tokens": 10, "extra_body": NO_THINKING},
    "tool-choice-auto": {"input": CONVERSATION[:1], "tools": [TOOL], "tool_choice": "auto",
                         "max_output_tokens": 16, "extra_body": NO_THINKING},
    "forced-tool": {"input": CONVERSATION[:1], "tools": [TOOL],
                    "tool_choice": {"type": "function", "name": "get_weather"},
                    "max_output_tokens": 40, "extra_body": NO_THINKING},
    # Cut inside the forced call: vLLM's whole answer is a message, its stream has no item.
    "forced-tool-cut": {"input": CONVERSATION[:1], "tools": [TOOL],
                        "tool_choice": {"type": "function", "name": "get_weather"},
                        "max_output_tokens": 5, "extra_body": NO_THINKING},
    "max-output-tokens-1": {"input": "Tell me about lists in Python.", "max_output_tokens": 1,
                            "extra_body": NO_THINKING},
    # With the qwen3 parser the tiny model's whole answer is reasoning.
    "reasoning": {"input": "Tell me about lists in Python.", "max_output_tokens": 30},
}


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120.0)


def body(case: str) -> dict[str, Any]:
    return {"model": "tiny", "temperature": 0, **CASES[case]}


# Random on every answer: the response's id and time, each item's id, a parsed call's id.
_RANDOM = {"id", "created_at", "call_id"}


def summary(response: Any, *, engine: bool = False) -> dict[str, Any]:
    """The whole answer without what is random on every answer. ``engine``: the 0.32 engine's,
    read as vLLM 0.33 answers (the coordinator follows 0.33): an item the output bound cut is
    ``incomplete`` (0.32 says ``completed``); and the two counts the coordinator does not have
    (docs/messages-responses.md): the engine's prefix-cache hits are 0."""
    data = response.model_dump(exclude_none=True)
    data = {k: v for k, v in data.items() if k not in _RANDOM}
    data["output"] = [{k: v for k, v in item.items() if k not in _RANDOM} for item in data["output"]]
    if engine:
        last = data["output"][-1] if data["output"] else {}
        if data["status"] == "incomplete" and last.get("status") is not None:
            assert last["status"] == "completed"  # 0.32's, which 0.33's response_item_status corrects
            last["status"] = "incomplete"
        data["usage"]["input_tokens_details"]["cached_tokens"] = 0
    return data


def streamed(api: openai.OpenAI, request: dict[str, Any], *, engine: bool = False
             ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The stream's events (ids left out, text deltas joined per item: how many tokens one delta
    carries depends on timing) and the final response's summary."""
    events: list[dict[str, Any]] = []
    final = None
    with api.responses.stream(**request) as stream:
        for e in stream:
            data = e.model_dump(exclude_none=True)
            for key in ("item_id", "snapshot"):
                data.pop(key, None)
            if "item" in data:
                data["item"] = {k: v for k, v in data["item"].items() if k not in _RANDOM}
            if "response" in data:
                data["response"] = {k: v for k, v in data["response"].items() if k not in _RANDOM}
                data["response"]["output"] = [{k: v for k, v in i.items() if k not in _RANDOM}
                                              for i in data["response"]["output"]]
            last = events[-1] if events else {}
            if data["type"].endswith(".delta") and last.get("type") == data["type"]:
                last["delta"] += data["delta"]
                continue
            data.pop("sequence_number")
            events.append(data)
        final = stream.get_final_response()
    summed = summary(final, engine=engine)
    if engine:  # the last item's done event and the final event as 0.33 sends them
        done = [e for e in events if e["type"] == "response.output_item.done"]
        if summed["status"] == "incomplete" and done:
            assert done[-1]["item"]["status"] == "completed"
            done[-1]["item"]["status"] = "incomplete"
        events[-1]["response"]["output"] = summed["output"]
        events[-1]["response"]["usage"] = summed["usage"]
    return events, summed


@pytest.mark.parametrize("case", list(CASES))
def test_an_answer_is_vllms_own(cfg: stack.StackConfig, case: str) -> None:
    before = native_routes(cfg)
    ours = client(cfg.coordinator_url).responses.create(**body(case))
    theirs = client(cfg.engine_urls[0]).responses.create(**body(case))
    assert summary(ours) == summary(theirs, engine=True)
    assert ours.id.startswith("resp_")
    assert native_routes(cfg) == before  # the token path served it
    assert_idle(cfg, sims=False)


@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_is_vllms_own(cfg: stack.StackConfig, case: str) -> None:
    before = native_routes(cfg)
    ours, ours_final = streamed(client(cfg.coordinator_url), body(case))
    theirs, theirs_final = streamed(client(cfg.engine_urls[0]), body(case), engine=True)
    assert ours[0]["type"] == "response.created" and ours[-1]["type"] == "response.completed"
    assert ours == theirs
    assert ours_final == theirs_final
    assert native_routes(cfg) == before
    assert_idle(cfg, sims=False)


def test_a_cut_reasoning_item_has_vllms_status_whole_and_streamed(cfg: stack.StackConfig) -> None:
    """vLLM gives the reasoning item no status in a whole answer (``build_response_output_items``)
    and the streamed status in a stream (``emit_simple_reasoning_done``); the openai client's
    final response of a stream is the streamed items. The coordinator keeps both, as its
    summary above compares them; this says so plainly for an answer the output bound cut."""
    def statuses(base_url: str) -> tuple[list[Any], list[Any], list[Any]]:
        api = client(base_url)
        whole = api.responses.create(**body("reasoning"))
        with api.responses.stream(**body("reasoning")) as stream:
            done = [e.item.status for e in stream if e.type == "response.output_item.done"]
            final = stream.get_final_response()
        assert whole.status == final.status == "incomplete"
        return [i.status for i in whole.output], done, [i.status for i in final.output]

    assert statuses(cfg.coordinator_url) == ([None], ["incomplete"], ["incomplete"])
    assert statuses(cfg.engine_urls[0]) == ([None], ["completed"], ["completed"])  # 0.32: 0.33 says incomplete


def test_sequence_numbers_count_every_event(cfg: stack.StackConfig) -> None:
    with client(cfg.coordinator_url).responses.stream(**body("text")) as stream:
        numbers = [e.sequence_number for e in stream]
    assert numbers == list(range(len(numbers)))


def test_previous_response_id_keeps_the_native_path(cfg: stack.StackConfig) -> None:
    before = native_routes(cfg)
    response = httpx.post(cfg.coordinator_url + "/v1/responses", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={**body("text"), "previous_response_id": "resp_missing"}, timeout=60.0,
                          trust_env=False)
    assert response.status_code in (400, 404)  # the engine's own answer: no such stored response
    assert native_routes(cfg) == before + 1


ERRORS = [
    ("unknown-model", {"model": "nope", "input": "hi", "max_output_tokens": 4}),
    ("bad-tool-choice", {"model": "tiny", "input": "hi", "max_output_tokens": 4, "tools": [TOOL],
                         "tool_choice": {"type": "function", "name": "missing"}}),
]


@pytest.mark.parametrize(("name", "request_body"), ERRORS, ids=[n for n, _ in ERRORS])
def test_an_error_is_vllms_shape(cfg: stack.StackConfig, name: str, request_body: dict[str, Any]) -> None:
    def post(base: str) -> httpx.Response:
        return httpx.post(base + "/v1/responses", json=request_body, headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=60.0, trust_env=False)

    ours, theirs = post(cfg.coordinator_url), post(cfg.engine_urls[0])
    assert ours.status_code == theirs.status_code, (ours.text, theirs.text)
    assert set(ours.json()) == {"error"} and ours.json()["error"]["type"] == theirs.json()["error"]["type"]
    with pytest.raises(openai.APIStatusError) as raised:
        client(cfg.coordinator_url).responses.create(**request_body)
    assert raised.value.status_code == ours.status_code
