"""The rig test_messages_real.py and test_responses_real.py share: a render sidecar and a
tokenizer-loaded vLLM engine, both with the hermes tool and qwen3 reasoning parsers, behind a
coordinator, started once per module that requests ``cfg``; and the coordinator's count of
requests it sent to the native path."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import httpx
import pytest

from motorsite import stack
from motorsite.supervisor import Supervisor, free_port


@pytest.fixture(scope="module")
def cfg(
    base_config: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[stack.StackConfig]:
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").removesuffix("_real")
    config = replace(
        base_config, render_port=free_port(), render_workers=1, render_parsers=True, engine_ports=(free_port(),),
        coordinator_port=free_port(),
        database_url=f"sqlite:///{tmp_path_factory.mktemp(name) / 'coordinator.sqlite3'}",
        log_dir=base_config.log_dir / name,
    )
    stack.prepare_database(config)
    with Supervisor([stack.render_spec(config)]), Supervisor(stack.engine_specs(config)):
        with Supervisor([stack.coordinator_spec(config)]):
            yield config


def native_routes(cfg: stack.StackConfig) -> float:
    """Every request the coordinator has routed to the native path so far (any reason)."""
    text = httpx.get(cfg.coordinator_url + "/metrics", timeout=30.0, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("motor_route_decisions_total{") and 'path="native"' in line)
