"""``RenderConfig.local_stream_detokenize`` through the real server: same answers, no derender calls.

The real vLLM render sidecar (no parsers) and a simulated engine (tokens-only: stop strings are
refused here; the differential test drives them through the session's hold-back), behind two coordinators (Daphne,
as ``make run`` starts it) that differ only in the option. The official ``openai`` client streams
the same requests from both: the text, finish reasons, stop reasons and usage are the same, and
the sidecar's own request counter (its Prometheus ``/metrics``) shows no derender call for the
plain streams of the coordinator with the option on, while a stream with logprobs (which does not
qualify) still goes to the sidecar.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from motorsite import stack
from motorsite.supervisor import Supervisor, free_port

from .conftest import API_KEY

pytestmark = pytest.mark.integration

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Write a short poem about the sea, é中😀."}]


@pytest.fixture(scope="module")
def cfg(base_config: stack.StackConfig, one_worker_render: int) -> Iterator[stack.StackConfig]:
    """The sidecar is ``conftest.one_worker_render``, test_local_stream_diff_real's too."""
    config = replace(base_config, render_port=one_worker_render, render_workers=1, render_parsers=False,
                     engines="sim", engine_ports=(free_port(),), log_dir=base_config.log_dir / "local-stream")
    with Supervisor(stack.engine_specs(config)):
        yield config


def _coordinator(config: stack.StackConfig, tmp: Path, local: bool) -> Iterator[openai.OpenAI]:
    name = "local-on" if local else "local-off"
    config = replace(config, coordinator_port=free_port(), database_url=f"sqlite:///{tmp / 'c.sqlite3'}",
                     log_dir=config.log_dir / name)
    stack.prepare_database(config)
    with sqlite3.connect(tmp / "c.sqlite3") as conn:
        conn.execute("UPDATE serving_renderconfig SET local_stream_detokenize = ?", (local,))
    with Supervisor([stack.coordinator_spec(config)]):
        client = openai.OpenAI(base_url=f"{config.coordinator_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        try:
            yield client
        finally:
            client.close()


@pytest.fixture(scope="module")
def local_on(cfg: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    yield from _coordinator(cfg, tmp_path_factory.mktemp("local-on"), True)


@pytest.fixture(scope="module")
def local_off(cfg: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    yield from _coordinator(cfg, tmp_path_factory.mktemp("local-off"), False)


def derender_calls(config: stack.StackConfig) -> float:
    """The sidecar's own count of derender requests (prometheus-fastapi-instrumentator's)."""
    text = httpx.get(f"http://127.0.0.1:{config.render_port}/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("http_requests_total{") and "/derender" in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def chat(client: openai.OpenAI, **extra: Any) -> dict[str, Any]:
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,  # type: ignore[call-overload]
                                            stream_options={"include_usage": True}, **extra)
    text, finish, usage = "", None, None
    extra_fields: list[Any] = []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            extra_fields.append((c.model_extra or {}).get("stop_reason"))
        usage = chunk.usage.model_dump() if chunk.usage else usage
    return {"text": text, "finish": finish, "stop_reason": [s for s in extra_fields if s is not None], "usage": usage}


def completion(client: openai.OpenAI, **extra: Any) -> dict[str, Any]:
    stream = client.completions.create(model=MODEL, prompt="The sea, é中😀, is", stream=True,  # type: ignore[call-overload]
                                       stream_options={"include_usage": True}, **extra)
    text, finish, usage = "", None, None
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
        usage = chunk.usage.model_dump() if chunk.usage else usage
    return {"text": text, "finish": finish, "usage": usage}


REQUESTS = [
    (chat, {"max_tokens": 24}),
    (chat, {"max_tokens": 20, "extra_body": {"skip_special_tokens": False, "ignore_eos": True}}),
    (chat, {"max_tokens": 30, "extra_body": {"stop_token_ids": [300, 301, 302, 303, 304, 305]}}),
    (chat, {"max_tokens": 30, "extra_body": {"include_stop_str_in_output": True, "spaces_between_special_tokens": False}}),
    (completion, {"max_tokens": 16}),
    (completion, {"max_tokens": 25, "extra_body": {"return_token_ids": True, "skip_special_tokens": False}}),
]


@pytest.mark.parametrize(("call", "extra"), REQUESTS, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(REQUESTS)])
def test_the_same_answers_with_no_derender_call(
    cfg: stack.StackConfig, local_on: openai.OpenAI, local_off: openai.OpenAI, call: Any, extra: dict[str, Any]
) -> None:
    expected = call(local_off, **extra)
    before = derender_calls(cfg)
    assert call(local_on, **extra) == expected
    assert expected["text"]
    assert derender_calls(cfg) == before


def test_a_stream_with_logprobs_keeps_the_sidecar(cfg: stack.StackConfig, local_on: openai.OpenAI,
                                                 local_off: openai.OpenAI) -> None:
    expected = chat(local_off, max_tokens=8, logprobs=True)
    before = derender_calls(cfg)
    answer = chat(local_on, max_tokens=8, logprobs=True)
    assert answer == expected
    assert derender_calls(cfg) > before
    assert re.search(r"\S", answer["text"])
