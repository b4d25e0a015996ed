"""Parity: the coordinator answers exactly what vLLM's own OpenAI server answers for the same model.

The reference is a real union engine's native ``/v1/chat/completions`` and ``/v1/completions``
(``vllm serve --enable-scale-out`` on the same model). Compared: prompt token ids, output token
ids, text, finish and stop reason, usage, logprobs, streaming concatenation, and the status and
error type of the error cases. Ids and timestamps differ by design and are not compared.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from motorsite import stack

from .conftest import API_KEY

pytestmark = pytest.mark.integration

CHAT = [
    {"messages": [{"role": "user", "content": "Tell me about parity."}], "max_tokens": 24, "temperature": 0},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Seeded sampling, please."},
        ],
        "max_tokens": 20,
        "temperature": 0.9,
        "seed": 1234,
    },
    {
        "messages": [{"role": "user", "content": "With logprobs"}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    },
    {"messages": [{"role": "user", "content": "Two choices"}], "max_tokens": 8, "temperature": 0.7, "seed": 7, "n": 2},
    {"messages": [{"role": "user", "content": "Exactly sixteen"}], "max_tokens": 16, "temperature": 0},
]
COMPLETIONS = [
    {"prompt": "import json\n", "max_tokens": 20, "temperature": 0},
    {"prompt": "def f(x):", "max_tokens": 10, "temperature": 0, "logprobs": 2},
    {"prompt": "# seeded", "max_tokens": 12, "temperature": 1.0, "seed": 99},
    {"prompt": ["one", "two two", "three three three"], "max_tokens": 6, "temperature": 0},
    {"prompt": "no max_tokens given: vLLM's default of 16 applies", "temperature": 0},
]


@pytest.fixture(scope="module")
def ours(coordinator: stack.StackConfig) -> httpx.Client:
    return httpx.Client(base_url=coordinator.coordinator_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


@pytest.fixture(scope="module")
def native(coordinator: stack.StackConfig) -> httpx.Client:
    return httpx.Client(base_url=coordinator.engine_urls[0], timeout=60)


def _choices(body: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    out = []
    for c in sorted(body["choices"], key=lambda c: c["index"]):
        item = {
            "index": c["index"],
            "finish_reason": c["finish_reason"],
            "stop_reason": c.get("stop_reason"),
            "token_ids": c.get("token_ids"),
            "logprobs": c.get("logprobs"),
        }
        item["text"] = c["message"]["content"] if kind == "chat" else c["text"]
        if kind == "chat":
            item["role"] = c["message"]["role"]
        out.append(item)
    return out


def _comparable(body: dict[str, Any], kind: str) -> dict[str, Any]:
    usage = body["usage"]
    return {
        "model": body["model"],
        "object": body["object"],
        "choices": _choices(body, kind),
        "usage": {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        "prompt_token_ids": body.get("prompt_token_ids"),
    }


@pytest.mark.parametrize("request_body", CHAT, ids=lambda b: b["messages"][-1]["content"])
def test_chat_matches_native_vllm(ours: httpx.Client, native: httpx.Client, request_body: dict[str, Any]) -> None:
    body = {"model": "tiny", "return_token_ids": True, **request_body}
    a = ours.post("/v1/chat/completions", json=body)
    b = native.post("/v1/chat/completions", json=body)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert _comparable(a.json(), "chat") == _comparable(b.json(), "chat")
    assert a.json()["prompt_token_ids"], "prompt token ids must be reported when asked for"


@pytest.mark.parametrize("request_body", COMPLETIONS, ids=lambda b: str(b["prompt"])[:20])
def test_completion_matches_native_vllm(ours: httpx.Client, native: httpx.Client, request_body: dict[str, Any]) -> None:
    body = {"model": "tiny", "return_token_ids": True, **request_body}
    a = ours.post("/v1/completions", json=body)
    b = native.post("/v1/completions", json=body)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    ca, cb = _comparable(a.json(), "completions"), _comparable(b.json(), "completions")
    assert ca == cb


def _stream(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], bytes]:
    frames: list[dict[str, Any]] = []
    raw = b""
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for chunk in response.iter_bytes():
            raw += chunk
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            frames.append(json.loads(block[6:]))
    return frames, raw


def _stream_summary(frames: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    text: dict[int, str] = {}
    finish: dict[int, Any] = {}
    usage = None
    for f in frames:
        if f.get("usage") and not f.get("choices"):
            usage = {k: f["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        for c in f.get("choices") or []:
            piece = (c.get("delta") or {}).get("content") if kind == "chat" else c.get("text")
            text[c["index"]] = text.get(c["index"], "") + (piece or "")
            if c.get("finish_reason"):
                finish[c["index"]] = (c["finish_reason"], c.get("stop_reason"))
    return {"text": text, "finish": finish, "usage": usage}


STREAMS = [
    ("/v1/chat/completions", "chat", {"messages": [{"role": "user", "content": "stream parity"}], "max_tokens": 30, "temperature": 0}),
    ("/v1/chat/completions", "chat", {"messages": [{"role": "user", "content": "n=2"}], "max_tokens": 12, "temperature": 0.8, "seed": 5, "n": 2}),
    ("/v1/completions", "completions", {"prompt": "async def main():", "max_tokens": 25, "temperature": 0}),
    ("/v1/completions", "completions", {"prompt": ["a", "bb"], "max_tokens": 8, "temperature": 0}),
]


@pytest.mark.parametrize("path,kind,request_body", STREAMS, ids=["chat", "chat-n2", "completion", "completion-2-prompts"])
def test_streaming_matches_native_vllm(
    ours: httpx.Client, native: httpx.Client, path: str, kind: str, request_body: dict[str, Any]
) -> None:
    body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, **request_body}
    fa, raw_a = _stream(ours, path, body)
    fb, raw_b = _stream(native, path, body)
    assert _stream_summary(fa, kind) == _stream_summary(fb, kind)
    # SSE framing: data frames only, exactly one [DONE], last.
    assert raw_a.endswith(b"data: [DONE]\n\n") and raw_a.count(b"data: [DONE]") == 1
    assert all(block.startswith("data: ") for block in raw_a.decode().split("\n\n") if block)


ERRORS = [
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/chat/completions", {"model": "tiny"}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
    ("/v1/completions", {"model": "tiny", "prompt": "word " * 5000, "max_tokens": 4}),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}),
]


@pytest.mark.parametrize("path,request_body", ERRORS, ids=["unknown-model", "no-messages", "max-tokens-too-big", "bad-type", "prompt-too-long", "negative-max-tokens"])
def test_errors_match_native_vllm(ours: httpx.Client, native: httpx.Client, path: str, request_body: dict[str, Any]) -> None:
    a = ours.post(path, json=request_body)
    b = native.post(path, json=request_body)
    assert a.status_code == b.status_code, (a.text, b.text)
    ea, eb = a.json()["error"], b.json()["error"]
    assert (ea["type"], ea["param"], ea["code"]) == (eb["type"], eb["param"], eb["code"])
    assert set(ea) == {"message", "type", "param", "code"}


def test_malformed_json_gets_an_openai_error(ours: httpx.Client, native: httpx.Client) -> None:
    a = ours.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    b = native.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert a.status_code == b.status_code == 400
    assert set(a.json()["error"]) == {"message", "type", "param", "code"}
    assert a.json()["error"]["code"] == 400
