"""The engines' capability probe (``fleet.engine_probes``) against real vLLM engines: the version,
routes, tokenizer and LoRA it records are what the real engine serves, for a union engine
(``vllm serve --enable-scale-out``) and a tokens-only one (``--tokens-only``)."""

from __future__ import annotations

import httpx
import pytest

from fleet.engine_probes import engine_capabilities
from motorsite import stack

from .conftest import TokensOnlyEngine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

ALL_NATIVE = ["chat", "completions", "messages", "responses"]


@pytest.fixture(scope="module")
def engines(tiers: stack.StackConfig, tokens_only_engine: TokensOnlyEngine) -> dict[str, str]:
    """One real engine of each mode: the session's first union engine, and the tokens-only one
    test_kv_events_real indexes (started once for both)."""
    return {"union": tiers.engine_urls[0], "tokens-only": tokens_only_engine.url}


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
