"""The engines' capability probe (``fleet.engine_probes``) against real vLLM engines: the version,
routes, tokenizer and LoRA it records are what the real engine serves, for a union engine
(``vllm serve --enable-scale-out``) and a tokens-only one (``--tokens-only``)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Iterator

import httpx
import pytest

from fleet.engine_probes import engine_capabilities
from motorsite import stack, tiers
from motorsite.supervisor import Supervisor, free_port, together

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

ALL_NATIVE = ["chat", "completions", "messages", "responses"]


@pytest.fixture(scope="module")
def engines(base_config: stack.StackConfig) -> Iterator[dict[str, str]]:
    """One real engine of each mode, on its own core (a loaded machine: generous readiness)."""
    cfg = replace(base_config, engine_ports=(free_port(), free_port()), prefill_ports=(), decode_ports=(),
                  restart=None, log_dir=base_config.log_dir / "engine-probe")
    union, second = stack.engine_specs(cfg)
    port = cfg.engine_ports[1]
    argv, env = tiers.vllm_engine_command(
        python=cfg.engine_python, model_dir=cfg.model_dir, served_model_name=cfg.served_model_name, port=port,
        mode="tokens-only", core=1 % max(os.cpu_count() or 1, 1), max_model_len=cfg.max_model_len,
    )
    union = replace(union, ready_timeout=900.0)
    tokens_only = replace(second, name="tokens-only", argv=argv, env=env, ready_timeout=900.0)
    with Supervisor(together([union, tokens_only])):
        yield {"union": union.ready_base_url or "", "tokens-only": tokens_only.ready_base_url or ""}


def test_it_records_the_real_engines_version_and_routes(engines: dict[str, str], base_config: stack.StackConfig) -> None:
    with httpx.Client(trust_env=False, timeout=60) as client:
        union = engine_capabilities(client, engines["union"], base_config.served_model_name)
        tokens_only = engine_capabilities(client, engines["tokens-only"], base_config.served_model_name)
    assert union == {
        "version": "0.32.0", "token_in": True,
        "routes": {"generate": True, "native": ALL_NATIVE},
        "tokenizer_loaded": True, "lora": {"enabled": False},
    }
    # --tokens-only keeps its OpenAI routes registered (vllm-protocol.md 1.2), with no tokenizer behind them.
    assert tokens_only["routes"] == {"generate": True, "native": ALL_NATIVE}
    assert tokens_only["tokenizer_loaded"] is False and tokens_only["token_in"] is True
