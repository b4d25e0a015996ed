"""``RenderConfig.local_stream_detokenize`` through the real server: same answers, no derender calls.

The real vLLM render sidecar (no parsers) and a simulated engine (tokens-only: stop strings are
refused here; the differential test drives them through the session's hold-back), behind two coordinators (Daphne,
as ``make run`` starts it) that differ only in the option. The official ``openai`` client streams
the same requests from both: the text, finish reasons, stop reasons and usage are the same, and
a recording proxy in front of the sidecar (every byte the coordinators send it) shows no derender
call for the plain streams of the coordinator with the option on, while a stream with logprobs
(which does not qualify) still goes to the sidecar. Not the sidecar's own ``/metrics``: the
sidecar ``make run`` starts leaves streaming derender calls out of them (``motorsite/render_site``),
and out of its access log.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest

from motorsite import stack
from motorsite.supervisor import Supervisor, free_port

from .conftest import API_KEY
from .cutting_proxy import Cut, CuttingProxy

pytestmark = pytest.mark.integration

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Write a short poem about the sea, é中😀."}]


@pytest.fixture(scope="module")
def sidecar_proxy(tiers: stack.StackConfig) -> Iterator[CuttingProxy]:
    """The sidecar is the session's (``conftest.tiers``), test_local_stream_diff_real's too; the
    coordinators reach it through this proxy (never armed: it only records what they send, so
    no other test's calls to that sidecar are counted)."""
    with CuttingProxy(tiers.render_port, Cut()) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def cfg(base_config: stack.StackConfig, sidecar_proxy: CuttingProxy) -> Iterator[stack.StackConfig]:
    config = replace(base_config, render_port=sidecar_proxy.port, render_parsers=False,
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


DERENDER_LINES = (b"POST /v1/chat/completions/derender ", b"POST /v1/completions/derender ")


def derender_calls(proxy: CuttingProxy) -> int:
    """The derender requests the coordinators have sent the sidecar so far (request lines)."""
    return sum(conn.count(line) for conn in proxy.sent() for line in DERENDER_LINES)


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
    sidecar_proxy: CuttingProxy, local_on: openai.OpenAI, local_off: openai.OpenAI, call: Any, extra: dict[str, Any]
) -> None:
    before = derender_calls(sidecar_proxy)
    expected = call(local_off, **extra)
    assert derender_calls(sidecar_proxy) > before  # the proxy sees the option-off coordinator's calls
    before = derender_calls(sidecar_proxy)
    assert call(local_on, **extra) == expected
    assert expected["text"]
    assert derender_calls(sidecar_proxy) == before


def test_a_stream_with_logprobs_keeps_the_sidecar(sidecar_proxy: CuttingProxy, local_on: openai.OpenAI,
                                                 local_off: openai.OpenAI) -> None:
    expected = chat(local_off, max_tokens=8, logprobs=True)
    before = derender_calls(sidecar_proxy)
    answer = chat(local_on, max_tokens=8, logprobs=True)
    assert answer == expected
    assert derender_calls(sidecar_proxy) > before
    assert re.search(r"\S", answer["text"])
