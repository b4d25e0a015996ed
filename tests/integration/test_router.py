"""The token-only router against the real tiers: the native path and the local-tokenizer fallback.

- A chat with a stop string through the coordinator equals the engine's own OpenAI answer.
- A coordinator whose render sidecar is gone (its RenderConfig names a dead port) still answers
  a chat, tokenized by the model's own files, with the same prompt ids and output as through
  render and as vLLM's own server.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Iterator

import httpx
import pytest

from motorsite import stack
from motorsite.supervisor import free_port
from serving.pipeline.http11 import Http11Client
from serving.pipeline.protocol import ApiKind
from serving.pipeline.render.client import RenderClient

from .conftest import API_KEY, _coordinator

pytestmark = pytest.mark.integration

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def renderless(tiers: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackConfig]:
    """A coordinator of its own whose render sidecar never answers."""
    cfg = replace(
        tiers,
        coordinator_port=free_port(),
        render_port=free_port(),  # nothing listens there
        database_url=f"sqlite:///{tmp_path_factory.mktemp('renderless') / 'coordinator.sqlite3'}",
        log_dir=tiers.log_dir / "renderless",
    )
    yield from _coordinator(cfg)


def post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(base + path, json=body, headers=HEADERS, timeout=60.0, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about lists"}],
            "temperature": 0, "max_tokens": 24, **extra}


def test_a_chat_with_a_stop_string_equals_the_engines_native_answer(coordinator: stack.StackConfig) -> None:
    native = post(coordinator.engine_urls[0], "/v1/chat/completions", chat(max_tokens=40))
    text = native["choices"][0]["message"]["content"]
    assert len(text) > 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # a string the greedy output certainly contains

    ours = post(coordinator.coordinator_url, "/v1/chat/completions", chat(max_tokens=40, stop=[stop]))
    theirs = post(coordinator.engine_urls[0], "/v1/chat/completions", chat(max_tokens=40, stop=[stop]))

    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"] == "stop"
    assert ours["usage"] == theirs["usage"]


def test_without_render_a_chat_is_tokenized_locally_with_the_same_ids(
    coordinator: stack.StackConfig, renderless: stack.StackConfig
) -> None:
    body = chat(return_token_ids=True)
    local = post(renderless.coordinator_url, "/v1/chat/completions", body)
    through_render = post(coordinator.coordinator_url, "/v1/chat/completions", body)
    native = post(coordinator.engine_urls[0], "/v1/chat/completions", body)

    assert local["prompt_token_ids"] == native["prompt_token_ids"]
    assert local["choices"][0]["token_ids"] == native["choices"][0]["token_ids"]
    assert local["choices"][0]["message"]["content"] == through_render["choices"][0]["message"]["content"]
    assert local["choices"][0]["message"]["content"] == native["choices"][0]["message"]["content"]
    assert local["usage"]["prompt_tokens"] == through_render["usage"]["prompt_tokens"] == len(native["prompt_token_ids"])
    assert local["choices"][0]["finish_reason"] == through_render["choices"][0]["finish_reason"]


def test_without_render_a_completion_is_tokenized_locally(
    coordinator: stack.StackConfig, renderless: stack.StackConfig
) -> None:
    body = {"model": "tiny", "prompt": ["def main(", "import os"], "temperature": 0, "max_tokens": 8}
    local = post(renderless.coordinator_url, "/v1/completions", body)
    through_render = post(coordinator.coordinator_url, "/v1/completions", body)
    assert [c["text"] for c in local["choices"]] == [c["text"] for c in through_render["choices"]]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert local["usage"][key] == through_render["usage"][key]


NATIVE_APIS = [
    ("responses", "/v1/responses", {"model": "tiny", "input": "Tell me about lists", "max_output_tokens": 8,
                                    "temperature": 0}),
    ("messages", "/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about lists"}],
                                  "max_tokens": 8, "temperature": 0}),
]


@pytest.mark.parametrize(("kind", "path", "body"), NATIVE_APIS, ids=[k for k, _, _ in NATIVE_APIS])
async def test_the_native_path_counts_the_prompt_the_engine_reads(
    coordinator: stack.StackConfig, kind: ApiKind, path: str, body: dict[str, Any]
) -> None:
    """The real sidecar's count-only render (what admission and the key's window hold on the
    native path) equals the prompt tokens the real engine reports for the same body, served
    through the coordinator by that engine's own API."""
    async with contextlib.aclosing(Http11Client()) as upstream:  # the production client
        render = RenderClient(upstream, f"http://127.0.0.1:{coordinator.render_port}", 60.0)
        (count,) = await render.prompt_lengths(kind, dict(body), "count")
    answer = post(coordinator.coordinator_url, path, body)
    assert answer["usage"]["input_tokens"] == count
