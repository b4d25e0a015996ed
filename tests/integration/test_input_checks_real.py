"""request_checks against the real tiers: the coordinator refuses bad input with the status a
real vLLM engine's own OpenAI API gives for the same body, its vocabulary size comes from the
control plane (demo_fleet / the version probe read config.json), and engine controls stop at it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from motorsite import stack

from .conftest import API_KEY

pytestmark = pytest.mark.integration

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=HEADERS, timeout=120.0, trust_env=False)


def vocab(cfg: stack.StackConfig) -> int:
    return int(json.loads((Path(cfg.model_dir) / "config.json").read_text())["vocab_size"])


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


CASES = [
    ("/v1/chat/completions", chat(max_tokens=-1)),
    ("/v1/chat/completions", chat(max_tokens=0)),
    ("/v1/chat/completions", chat(max_tokens=1.5)),
    ("/v1/chat/completions", chat(n=0)),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -3}),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": -1000}),
]


@pytest.mark.parametrize(("path", "body"), CASES, ids=[f"{p.split('/')[-1]}-{i}" for i, (p, _) in enumerate(CASES)])
def test_bad_numbers_get_the_status_vllm_gives(coordinator: stack.StackConfig, path: str, body: dict[str, Any]) -> None:
    theirs = post(coordinator.engine_urls[0], path, body)
    ours = post(coordinator.coordinator_url, path, body)
    assert theirs.status_code == 400, theirs.text
    assert ours.status_code == theirs.status_code, ours.text
    assert set(ours.json()["error"]) == {"message", "type", "param", "code"}


def test_an_id_outside_the_vocabulary_is_refused_as_vllm_refuses_it(coordinator: stack.StackConfig) -> None:
    body = {"model": "tiny", "prompt": [1, vocab(coordinator)], "max_tokens": 2}
    theirs = post(coordinator.engine_urls[0], "/v1/completions", body)
    ours = post(coordinator.coordinator_url, "/v1/completions", body)
    assert theirs.status_code == ours.status_code == 400, (theirs.text, ours.text)
    assert ours.json()["error"]["param"] == "prompt"
    # The vocabulary is known (demo_fleet wrote it), so an in-vocabulary request is served.
    ok = post(coordinator.coordinator_url, "/v1/completions", {**body, "prompt": [1, vocab(coordinator) - 1]})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("field", ["kv_transfer_params", "vllm_xargs"])
def test_engine_controls_stop_at_the_coordinator(coordinator: stack.StackConfig, field: str) -> None:
    value = {"do_remote_prefill": True, "remote_host": "10.0.0.1"} if field == "kv_transfer_params" else {"k": "v"}
    ours = post(coordinator.coordinator_url, "/v1/chat/completions", chat(**{field: value}))
    assert ours.status_code == 400
    assert ours.json()["error"]["param"] == field
    served = post(coordinator.coordinator_url, "/v1/chat/completions", chat())
    assert served.status_code == 200 and served.json()["kv_transfer_params"] is None


# (Content-Type, body): valid JSON under another label, and a multipart body Twisted cannot parse.
MEDIA_CASES = [
    ("text/plain", json.dumps(chat()).encode()),
    ("application/x-www-form-urlencoded", json.dumps(chat()).encode()),
    ("multipart/form-data; boundary=motor", b"not a multipart body"),
]


@pytest.mark.parametrize(("content_type", "body"), MEDIA_CASES, ids=["text", "form", "broken-multipart"])
def test_a_body_not_declared_json_is_refused_as_vllm_refuses_it(
    coordinator: stack.StackConfig, content_type: str, body: bytes
) -> None:
    """Daphne's Twisted requests used to parse form bodies first and answer a broken one themselves
    (a bare 400 and a dropped connection); the edge now sees every body and answers in OpenAI's shape."""
    headers = {**HEADERS, "Content-Type": content_type}
    theirs, ours = (
        httpx.post(base + "/v1/chat/completions", content=body, headers=headers, timeout=120.0, trust_env=False)
        for base in (coordinator.engine_urls[0], coordinator.coordinator_url)
    )
    assert theirs.status_code == ours.status_code == 400, (theirs.text, ours.text)
    assert ours.headers["content-type"] == "application/json"
    assert set(ours.json()["error"]) == {"message", "type", "param", "code"}
    assert "Only 'application/json' is allowed" in ours.json()["error"]["message"]


# Sampling fields as vLLM 0.33's own server reads them (pydantic's lax mode), on the token-only path.
MISTYPED = [chat(temperature="hot"), chat(top_k="x"), chat(stream="maybe"), chat(ignore_eos="maybe")]


@pytest.mark.parametrize("body", MISTYPED, ids=["temperature", "top_k", "stream", "ignore_eos"])
def test_a_mistyped_sampling_field_gets_vllms_schema_400(coordinator: stack.StackConfig, body: dict[str, Any]) -> None:
    theirs = post(coordinator.engine_urls[0], "/v1/chat/completions", body)
    ours = post(coordinator.coordinator_url, "/v1/chat/completions", body)
    assert theirs.status_code == ours.status_code == 400, (theirs.text, ours.text)
    mine, vllm = ours.json()["error"], theirs.json()["error"]
    assert (mine["type"], mine["param"]) == (vllm["type"], vllm["param"])
    assert mine["message"].split("'input'")[0] == vllm["message"].split("'input'")[0]


def test_stream_false_as_a_string_is_a_json_answer_as_vllm_gives(coordinator: stack.StackConfig) -> None:
    body = chat(stream="false", temperature=0)
    theirs = post(coordinator.engine_urls[0], "/v1/chat/completions", body)
    ours = post(coordinator.coordinator_url, "/v1/chat/completions", body)
    assert theirs.status_code == ours.status_code == 200, (theirs.text, ours.text)
    assert theirs.headers["content-type"] == ours.headers["content-type"] == "application/json"
    assert ours.json()["choices"][0]["message"]["content"] == theirs.json()["choices"][0]["message"]["content"]
