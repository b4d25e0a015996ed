"""The rig test_messages_real.py and test_responses_real.py share: a render sidecar and a
tokenizer-loaded vLLM engine, both with the hermes tool and qwen3 reasoning parsers, behind a
coordinator (``conftest.parser_rig``: started once for both modules, stopped after the last test
that uses it); and the coordinator's count of requests it sent to the native path."""

from __future__ import annotations

import httpx
import pytest

from motorsite import stack


@pytest.fixture(scope="module")
def cfg(parser_rig: stack.StackConfig) -> stack.StackConfig:
    return parser_rig


def native_routes(cfg: stack.StackConfig) -> float:
    """Every request the coordinator has routed to the native path so far (any reason)."""
    text = httpx.get(cfg.coordinator_url + "/metrics", timeout=30.0, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("motor_route_decisions_total{") and 'path="native"' in line)
