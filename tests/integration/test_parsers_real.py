"""Tool calls and reasoning through a real render sidecar started with parsers (hermes + qwen3).

A simulated engine is scripted to answer the rendered prompt with the ids of
``<think>reasoning</think><tool_call>{...}</tool_call>`` and EOS. Checked, through coordinators
with derender coalescing on and off: the non-streaming message and the streamed reasoning and
tool-call deltas, ``finish_reason: tool_calls``. Because whether chunks merge over HTTP depends
on timing, the sidecar's streaming derender is also driven directly with the same events merged
in every grouping (``merge_events``): each grouping must concatenate to the same output.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from tokenizers import Tokenizer

from motorsite import stack
from motorsite.supervisor import Supervisor, free_port
from serving.pipeline.derender.coalesce import merge_events

from .conftest import API_KEY

pytestmark = pytest.mark.integration

EOS = 2  # <|im_end|>
OUTPUT = '<think>reasoning</think><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
        "tool_choice": "auto", "max_tokens": 100, "temperature": 0}


@pytest.fixture(scope="module")
def sim_engine(tiers: stack.StackConfig, parser_render: str, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[stack.StackConfig]:
    cfg = replace(tiers, engines="sim", engine_ports=(free_port(),), render_port=int(parser_render.rsplit(":", 1)[1]),
                  log_dir=tiers.log_dir / "parsers")
    with Supervisor(stack.engine_specs(cfg)):
        yield cfg


@pytest.fixture(scope="module")
def output_ids(tiers: stack.StackConfig) -> list[int]:
    tok = Tokenizer.from_file(str(Path(tiers.model_dir) / "tokenizer.json"))
    ids = tok.encode(OUTPUT, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == OUTPUT
    return ids + [EOS]


@pytest.fixture(scope="module")
def scripted(sim_engine: stack.StackConfig, parser_render: str, output_ids: list[int]) -> list[int]:
    """Script the engine for the rendered prompt; return the prompt ids."""
    rendered = httpx.post(parser_render + "/v1/chat/completions/render", json=CHAT, timeout=60).json()
    prompt = rendered["token_ids"]
    r = httpx.post(sim_engine.engine_urls[0] + "/sim/script",
                   json={"prompt_token_ids": prompt, "output_token_ids": output_ids, "match": "exact"}, timeout=10)
    assert r.status_code == 200, r.text
    return prompt


@pytest.fixture(scope="module", params=["coalesce-on", "coalesce-off"])
def ours(request: pytest.FixtureRequest, sim_engine: stack.StackConfig, scripted: list[int],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    db = tmp_path_factory.mktemp("parsers") / "coordinator.sqlite3"
    cfg = replace(sim_engine, coordinator_port=free_port(), database_url=f"sqlite:///{db}", prefill_ports=(),
                  decode_ports=(), log_dir=sim_engine.log_dir / request.param)
    stack.prepare_database(cfg)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE serving_renderconfig SET derender_coalesce = ?", (request.param == "coalesce-on",))
    with Supervisor([stack.coordinator_spec(cfg)]):
        with httpx.Client(base_url=cfg.coordinator_url, headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=120) as client:
            yield client


def assemble(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate streamed chat deltas per field, tool calls by index."""
    out: dict[str, Any] = {"reasoning": "", "content": "", "tool_calls": {}, "finish_reason": None}
    for chunk in chunks:
        for c in chunk.get("choices") or []:
            d = c.get("delta") or {}
            out["reasoning"] += d.get("reasoning") or d.get("reasoning_content") or ""
            out["content"] += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                slot = out["tool_calls"].setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                slot["id"] = slot["id"] or tc.get("id")
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            if c.get("finish_reason"):
                out["finish_reason"] = c["finish_reason"]
    calls = [out["tool_calls"][i] for i in sorted(out["tool_calls"])]
    return {"reasoning": out["reasoning"].strip(), "content": out["content"].strip(),
            "tool_calls": [(c["name"], json.loads(c["arguments"])) for c in calls],
            "finish_reason": out["finish_reason"]}


EXPECTED = {"reasoning": "reasoning", "content": "", "tool_calls": [("get_weather", {"city": "Paris"})],
            "finish_reason": "tool_calls"}


def test_non_streaming_tool_call_and_reasoning(ours: httpx.Client) -> None:
    r = ours.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert (message.get("reasoning") or message.get("reasoning_content") or "").strip() == "reasoning"
    assert not (message.get("content") or "").strip()
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_streaming_tool_call_and_reasoning_deltas(ours: httpx.Client) -> None:
    raw = b""
    with ours.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for part in response.iter_bytes():
            raw += part
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"data: [DONE]") == 1
    chunks = [json.loads(b[6:]) for b in raw.decode().split("\n\n") if b.startswith("data: ") and b != "data: [DONE]"]
    assert all("error" not in c for c in chunks), chunks
    assert assemble(chunks) == EXPECTED
    roles = [c["choices"][0]["delta"].get("role") for c in chunks if c.get("choices")]
    assert roles.count("assistant") == 1


@pytest.mark.parametrize("group", [1, 2, 3, 5, 1000])
def test_merged_events_derender_to_the_same_output(
    parser_render: str, scripted: list[int], output_ids: list[int], group: int
) -> None:
    """The sidecar's parser path, fed coalesced events (``group`` engine events per call)."""
    events = []
    for i, token in enumerate(output_ids):
        last = i == len(output_ids) - 1
        events.append({"request_id": "generate-tokens-x", "usage": None, "output_mode": "tokens",
                       "choices": [{"index": 0, "finish_reason": "stop" if last else None, "stop_reason": None,
                                    "token_ids": [token], "routed_experts": None, "sampling_mask": None,
                                    "weight_versions": None, "logprobs": None}]})
    state = None
    chunks = []
    with httpx.Client(base_url=parser_render, timeout=60) as client:
        for start in range(0, len(events), group):
            body = {"stream": True, "model": "tiny", "generate_chunk": merge_events(events[start:start + group]),
                    "stream_state": state, "prompt_tokens": len(scripted), "prompt_token_ids": scripted,
                    "chat_request": CHAT}
            r = client.post("/v1/chat/completions/derender", json=body)
            assert r.status_code == 200, r.text
            chunks.append(r.json()["chunk"])
            state = r.json()["stream_state"]
    assert assemble(chunks) == EXPECTED
