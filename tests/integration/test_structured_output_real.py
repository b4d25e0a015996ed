"""Structured output end to end, compared with vLLM's own server on the same request.

On the real tiers (union engines with ``--enable-scale-out``: a tokenizer and their own OpenAI
API) a JSON schema or a choice runs token-only (render, generate on a tokenizer-loaded engine,
derender), and an echoing completion takes the native path: both give exactly what the engine's
own ``/v1/chat/completions`` / ``/v1/completions`` gives, through the official openai client.
On simulated tokens-only engines the same valid body is a 400 saying why; a malformed one is
refused as vLLM refuses it, on both fleets. Nothing stays in flight afterwards.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from motorsite import stack

from .conftest import API_KEY
from .test_fuzz_openai import assert_idle, error_shape_problem

pytestmark = pytest.mark.integration

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "n": {"type": "integer"}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
MALFORMED = [
    {"structured_outputs": {"choice": ["a"], "regex": "a+"}},  # two kinds of constraint
    {"structured_outputs": {"choice": "yes"}},  # choice is a list
    {"response_format": {"type": "json_schema"}},  # no json_schema
    {"response_format": {"type": "xml"}},
]


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "temperature": 0, **extra}


def post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=HEADERS, timeout=120.0, trust_env=False)


def client(cfg: stack.StackConfig) -> openai.OpenAI:
    return openai.OpenAI(base_url=cfg.coordinator_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120.0)


def comparable(response: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"content": c["message"]["content"], "finish_reason": c["finish_reason"]} if "message" in c
        else {"text": c["text"], "finish_reason": c["finish_reason"]}
        for c in response["choices"]
    ]


@pytest.mark.parametrize(
    "extra",
    [{"response_format": JSON_SCHEMA}, {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
     {"response_format": {"type": "json_object"}}],
    ids=["json_schema", "choice", "json_object"],
)
def test_on_a_tokenizer_loaded_engine_it_is_what_vllm_gives(coordinator: stack.StackConfig, extra: dict[str, Any]) -> None:
    theirs = post(coordinator.engine_urls[0], "/v1/chat/completions", chat(**extra))
    assert theirs.status_code == 200, theirs.text
    ours = client(coordinator).chat.completions.create(**chat(), extra_body=extra).model_dump()
    assert comparable(ours) == comparable(theirs.json())
    assert ours["usage"]["completion_tokens"] == theirs.json()["usage"]["completion_tokens"]
    if "choice" in extra.get("structured_outputs", {}):
        assert ours["choices"][0]["message"]["content"] in ("yes", "no", "maybe")
    assert_idle(coordinator, sims=False)


def test_the_native_path_serves_it_as_vllm_does(coordinator: stack.StackConfig) -> None:
    # echo has no derender: the whole request goes to an engine's own API.
    body = {"model": "tiny", "prompt": "Is it?", "max_tokens": 4, "temperature": 0, "echo": True,
            "structured_outputs": {"choice": ["yes", "no"]}}
    theirs = post(coordinator.engine_urls[0], "/v1/completions", body)
    assert theirs.status_code == 200, theirs.text
    ours = client(coordinator).completions.create(
        model="tiny", prompt="Is it?", max_tokens=4, temperature=0, echo=True,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    ).model_dump()
    assert comparable(ours) == comparable(theirs.json())
    assert ours["choices"][0]["text"] in ("Is it?yes", "Is it?no")
    assert_idle(coordinator, sims=False)


@pytest.mark.parametrize("extra", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_a_malformed_one_is_refused_as_vllm_refuses_it(
    coordinator: stack.StackConfig, sim_stack: stack.StackConfig, extra: dict[str, Any]
) -> None:
    theirs = post(coordinator.engine_urls[0], "/v1/chat/completions", chat(**extra))
    assert theirs.status_code == 400, theirs.text
    for cfg in (coordinator, sim_stack):  # tokenizer-loaded engines, then tokens-only ones
        ours = post(cfg.coordinator_url, "/v1/chat/completions", chat(**extra))
        assert ours.status_code == theirs.status_code, (cfg.engines, ours.text)
        assert error_shape_problem(ours.status_code, ours.content) is None, ours.text
        assert "tokenizer" not in ours.json()["error"]["message"], ours.text  # the body's fault, said so
    assert_idle(coordinator, sims=False)
    assert_idle(sim_stack, sims=True)


def test_a_structured_outputs_string_is_a_400_where_vllm_answers_500(
    coordinator: stack.StackConfig, sim_stack: stack.StackConfig
) -> None:
    body = chat(structured_outputs="yes")
    theirs = post(coordinator.engine_urls[0], "/v1/chat/completions", body)
    # vLLM's before-validator calls .get on it ahead of its schema: "'str' object has no attribute 'get'".
    assert theirs.status_code == 500, theirs.text
    for cfg in (coordinator, sim_stack):
        ours = post(cfg.coordinator_url, "/v1/chat/completions", body)
        assert ours.status_code == 400, ours.text
        assert ours.json()["error"]["param"] == "body.structured_outputs", ours.text
    assert_idle(coordinator, sims=False)
    assert_idle(sim_stack, sims=True)


@pytest.mark.parametrize(
    "extra", [{"response_format": JSON_SCHEMA}, {"structured_outputs": {"regex": "[ab]+"}}], ids=["json_schema", "regex"]
)
def test_a_tokens_only_fleet_says_it_needs_a_tokenizer(sim_stack: stack.StackConfig, extra: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(sim_stack).chat.completions.create(**chat(), extra_body=extra)
    error = info.value.body
    assert isinstance(error, dict) and "needs an engine that loads a tokenizer" in error["message"], error
    assert error["param"] in ("response_format", "structured_outputs")
    assert_idle(sim_stack, sims=True)
