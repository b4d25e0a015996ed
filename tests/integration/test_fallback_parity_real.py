"""The local fallback answers what the real render sidecar answers, or refuses.

A model with sampling defaults in its generation_config.json (the tiny model with them added,
``tests/model_variants.py``) behind the real vLLM 0.33 render sidecar started with the hermes
tool and qwen3 reasoning parsers, and a simulated engine (its output a function of the prompt
and ``max_tokens``, or scripted). Two coordinators share the engine: one renders through the
sidecar, the other's sidecar address has nothing listening, so every request there takes the
local fallback. Compared:

- the GenerateRequest the fallback builds with the sidecar's own, sampling parameters included
  (the generation defaults fill in what a request leaves out, as render fills them in; vLLM's
  normalizations: greedy, the least temperature, a null completion ``max_tokens``, seed -1);
- completions answered by both coordinators: the same text, finish reason and usage;
- a chat the sidecar's reasoning parser splits into ``reasoning`` and ``content``: the fallback
  refuses it (503 with ``Retry-After``) instead of answering with ``<think>`` inside the content.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from motorsite import stack
from motorsite.supervisor import ProcessSpec, Supervisor, free_port
from serving.pipeline.render.local_tokenizer import LocalTokenizer
from serving.pipeline.render.tokenization import local_render, local_unsupported
from serving.pipeline.snapshot import ModelView
from tests.model_variants import GENERATION_DEFAULTS, with_generation_config

from . import early
from .conftest import API_KEY

pytestmark = pytest.mark.integration

EOS = 2  # <|im_end|>
THOUGHT = "<think>reasoning</think>the answer"
# The sampling parameters the fallback builds, with vLLM 0.33's SamplingParams defaults: render's
# answer leaves out a value equal to its default (the struct is ``omit_defaults``), and the
# engine reads it back as that default.
COMPARED: dict[str, Any] = {
    "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "temperature": 1.0,
    "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "stop": [], "stop_token_ids": [], "ignore_eos": False,
    "max_tokens": 16, "min_tokens": 0, "skip_special_tokens": True, "include_stop_str_in_output": False,
}


def as_engine_reads(params: dict[str, Any]) -> dict[str, Any]:
    """The compared parameters as an engine decodes them (omitted: the default; None lists: empty)."""
    out = {k: params.get(k, default) for k, default in COMPARED.items()}
    return {k: [] if v is None and k in ("stop", "stop_token_ids") else v for k, v in out.items()}
CHAT = [{"role": "user", "content": "What is 12345 + 67890? Answer in 3 words."}]
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"messages": CHAT}),  # every default from the generation config, max_tokens too
    ("chat", {"messages": CHAT, "temperature": 0, "max_tokens": 5, "top_k": -1}),  # greedy: the knobs off
    ("chat", {"messages": CHAT, "temperature": 0.8, "top_k": -1, "min_p": 0, "max_tokens": None}),  # the request's own win
    ("chat", {"messages": CHAT, "temperature": 0.001}),  # raised to vLLM's least temperature
    ("chat", {"messages": CHAT, "max_completion_tokens": 4, "top_p": 0.5, "seed": 7, "stop": ["\n"]}),
    ("completions", {"prompt": "The year 1999 had 365 days"}),  # max_tokens: the schema's 16
    ("completions", {"prompt": "def f", "max_tokens": None, "seed": -1}),  # null: the schema's 16 again
    ("completions", {"prompt": ["first 1", "second 22"], "temperature": 1.2, "min_p": 0.1, "max_tokens": 6}),
]


def _variant_sidecar(base: stack.StackConfig) -> tuple[list[ProcessSpec], stack.StackConfig]:
    model = with_generation_config(base.model_dir, Path(tempfile.mkdtemp(prefix="motorsite-model-")) / "tiny-gen")
    config = replace(
        base, model_dir=str(model), render_port=free_port(), render_workers=1, render_parsers=True,
        engines="sim", engine_ports=(free_port(),), log_dir=base.log_dir / "fallback-parity",
    )
    return [stack.render_spec(config)], config


# Begun in the background while the tests before this module run (tests/integration/early.py).
SIDECAR = early.rig("fallback-parity-sidecar", _variant_sidecar, fixture="cfg", module=str(Path(__file__).resolve()))


@pytest.fixture(scope="module")
def cfg(base_config: stack.StackConfig) -> Iterator[stack.StackConfig]:
    """The variant model's sidecar (with parsers) and one simulated engine."""
    try:
        with SIDECAR.running(base_config) as (config, _):
            # After the sidecar: a simulated engine's 30 s readiness bound would run out while the
            # sidecar loads on a busy machine.
            with Supervisor(stack.engine_specs(config)):
                yield replace(config, database_url=base_config.database_url)
    finally:
        if SIDECAR.value is not None:  # the variant model: links to the tiny model's files, and its config
            shutil.rmtree(Path(SIDECAR.value.model_dir).parent, ignore_errors=True)


def _coordinator(config: stack.StackConfig, name: str, tmp: Path) -> Iterator[httpx.Client]:
    config = replace(config, coordinator_port=free_port(), database_url=f"sqlite:///{tmp / 'coordinator.sqlite3'}",
                     log_dir=config.log_dir / name)
    stack.prepare_database(config)
    with Supervisor([stack.coordinator_spec(config)]):
        with httpx.Client(base_url=config.coordinator_url, headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=120) as client:
            yield client


@pytest.fixture(scope="module")
def via_render(cfg: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    yield from _coordinator(cfg, "via-render", tmp_path_factory.mktemp("via-render"))


@pytest.fixture(scope="module")
def via_fallback(cfg: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    # Nothing listens on this port: every render call is refused, every request falls back.
    down = replace(cfg, render_port=free_port())
    yield from _coordinator(down, "via-fallback", tmp_path_factory.mktemp("via-fallback"))


@pytest.fixture(scope="module")
def sidecar(cfg: stack.StackConfig) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{cfg.render_port}", timeout=60) as client:
        yield client


@pytest.mark.parametrize(("kind", "extra"), BODIES, ids=[f"{k}-{n}" for n, (k, _) in enumerate(BODIES)])
def test_the_fallback_builds_the_sidecars_generate_request(
    cfg: stack.StackConfig, sidecar: httpx.Client, kind: str, extra: dict[str, Any]
) -> None:
    body = {"model": cfg.served_model_name, **extra}
    assert local_unsupported(kind, body) is None  # a request the fallback serves
    path = "/v1/chat/completions/render" if kind == "chat" else "/v1/completions/render"
    response = sidecar.post(path, json=body)
    assert response.status_code == 200, response.text
    theirs = response.json()
    theirs = [theirs] if kind == "chat" else theirs
    model = ModelView(cfg.served_model_name, cfg.model_dir, cfg.max_model_len)
    ours = local_render(LocalTokenizer(cfg.model_dir), kind, body, "x", model)  # type: ignore[arg-type]
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in theirs]
    for mine, render in zip(ours, theirs, strict=True):
        expected = as_engine_reads(render["sampling_params"])
        if kind == "chat":
            # The one difference, and why the fallback refuses chats for a sidecar with parsers:
            # vLLM's parser engine turns skip_special_tokens off for every chat it will parse.
            assert expected["skip_special_tokens"] is False
            expected["skip_special_tokens"] = True
        assert as_engine_reads(mine["sampling_params"]) == expected


def test_the_sidecar_applies_the_generation_defaults(cfg: stack.StackConfig, sidecar: httpx.Client) -> None:
    """The model's defaults are in force on the sidecar, so the comparison above could fail."""
    params = sidecar.post("/v1/chat/completions/render", json={"model": cfg.served_model_name, "messages": CHAT}
                          ).json()["sampling_params"]
    assert params["temperature"] == GENERATION_DEFAULTS["temperature"] != COMPARED["temperature"]
    assert params["top_k"] == GENERATION_DEFAULTS["top_k"] and params["max_tokens"] == GENERATION_DEFAULTS["max_new_tokens"]


def _answer(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    out = response.json()
    return {"choices": [(c["index"], c["text"], c["finish_reason"]) for c in out["choices"]], "usage": out["usage"]}


@pytest.mark.parametrize("extra", [b for k, b in BODIES if k == "completions"], ids=["omitted", "null", "batch"])
def test_a_fallback_completion_answers_what_render_answers(
    cfg: stack.StackConfig, via_render: httpx.Client, via_fallback: httpx.Client, extra: dict[str, Any]
) -> None:
    body = {"model": cfg.served_model_name, **extra}
    theirs = _answer(via_render.post("/v1/completions", json=body))
    ours = _answer(via_fallback.post("/v1/completions", json=body))
    assert ours == theirs
    assert all(text for _, text, _ in ours["choices"])


@pytest.fixture(scope="module")
def scripted_chat(cfg: stack.StackConfig, sidecar: httpx.Client) -> dict[str, Any]:
    """A chat the engine answers with reasoning then content."""
    body = {"model": cfg.served_model_name, "messages": CHAT, "max_tokens": 40, "temperature": 0}
    prompt = sidecar.post("/v1/chat/completions/render", json=body).json()["token_ids"]
    output = LocalTokenizer(cfg.model_dir).encode(THOUGHT, add_special_tokens=False) + [EOS]
    script = {"prompt_token_ids": prompt, "output_token_ids": output, "match": "exact"}
    r = httpx.post(cfg.engine_urls[0] + "/sim/script", json=script, timeout=10)
    assert r.status_code == 200, r.text
    return body


def test_a_chat_render_would_parse_for_reasoning_is_refused_by_the_fallback(
    via_render: httpx.Client, via_fallback: httpx.Client, scripted_chat: dict[str, Any]
) -> None:
    answered = via_render.post("/v1/chat/completions", json=scripted_chat)
    assert answered.status_code == 200, answered.text
    message = answered.json()["choices"][0]["message"]
    assert (message.get("reasoning") or message.get("reasoning_content") or "").strip() == "reasoning"
    assert (message["content"] or "").strip() == "the answer"

    refused = via_fallback.post("/v1/chat/completions", json=scripted_chat)
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "5"
    error = refused.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and "reasoning or tool parser" in error["message"]
    assert "<think>" not in json.dumps(refused.json())
