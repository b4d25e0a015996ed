"""Placement's scorer weights end to end: an operator sets them with ``PATCH /api/models/{name}``,
and the coordinator (Daphne, as ``make run`` starts it) places the next request by them.

Two simulated union engines, no render sidecar (the local tokenizer; completions prompts given as
token ids reach the engines as sent). A prompt's blocks are cached on union-1 and a long request
keeps union-1 busy; union-2 is idle. Weighted towards affinity, the prompt's repeats go to
union-1, which holds its KV blocks (the engine reports the cache hits); weighted towards load
with affinity 0, they go to union-2, the least loaded.
"""

from __future__ import annotations

import json
import random
import socket
import time
import uuid
from dataclasses import replace
from typing import Any, Iterator

import httpx
import pytest

from motorsite import stack
from motorsite.supervisor import Supervisor, free_port

from .conftest import API_KEY

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # three processes start in its setup

ADMIN_KEY = "mk-test-" + uuid.uuid4().hex[:12]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BLOCK = 128  # the simulator's KV block size, and the coordinator's default


@pytest.fixture(scope="module")
def weights_stack(
    base_config: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[stack.StackConfig]:
    tmp = tmp_path_factory.mktemp("weights")
    cfg = replace(
        base_config,
        engines="sim",
        engine_ports=(free_port(), free_port()),
        coordinator_port=free_port(),
        render_port=free_port(),  # nothing listens there: local tokenizer
        database_url=f"sqlite:///{tmp / 'coordinator.sqlite3'}",
        log_dir=base_config.log_dir / "placement-weights",
        extra_env={"MOTOR_DEMO_ADMIN_KEY": ADMIN_KEY},
    )
    # 100 ms a token: the busy engine's 2000-token answer outlasts the test (abandoned at the end).
    sims = [replace(spec, argv=[*spec.argv, "--tpot-ms", "100"]) for spec in stack.engine_specs(cfg)]
    with Supervisor(sims):
        stack.prepare_database(cfg)
        # Two minutes to start: Django and Daphne import slowly on a busy 2-core machine.
        with Supervisor([replace(stack.coordinator_spec(cfg), ready_timeout=120.0)]):
            yield cfg


def stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/sim/stats", timeout=10.0, trust_env=False).json()


def complete(cfg: stack.StackConfig, ids: list[int]) -> list[int]:
    """Complete ``ids``; return how many requests and cache-hit tokens each engine saw for it."""
    before = [stats(u) for u in cfg.engine_urls]
    body = {"model": cfg.served_model_name, "prompt": ids, "max_tokens": 1, "temperature": 0}
    r = httpx.post(cfg.coordinator_url + "/v1/completions", json=body, headers=HEADERS, timeout=30.0, trust_env=False)
    assert r.status_code == 200, r.text
    after = [stats(u) for u in cfg.engine_urls]
    assert [a["requests_received"] - b["requests_received"] for a, b in zip(after, before, strict=True)] in (
        [1, 0], [0, 1]
    )
    return [a["cache"]["hit_tokens"] - b["cache"]["hit_tokens"] if a["requests_received"] > b["requests_received"]
            else -1 for a, b in zip(after, before, strict=True)]


def weigh(cfg: stack.StackConfig, **weights: float) -> None:
    """Set the model's weights over the REST API and wait until the coordinator serves them."""
    with httpx.Client(base_url=cfg.coordinator_url, timeout=30.0, trust_env=False) as client:
        version = client.get("/healthz").json()["fleet_version"]
        r = client.patch(f"/api/models/{cfg.served_model_name}", json=weights,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 200, r.text
        assert {k: r.json()[k] for k in weights} == weights
        deadline = time.monotonic() + 30  # one snapshot poll (MOTOR_SNAPSHOT_POLL_MS) in practice
        while client.get("/healthz").json()["fleet_version"] == version:
            assert time.monotonic() < deadline, "the coordinator never picked up the new weights"
            time.sleep(0.05)


def test_the_weights_decide_between_the_prefix_holder_and_the_least_loaded_engine(
    weights_stack: stack.StackConfig,
) -> None:
    cfg = weights_stack
    e1, e2 = cfg.engine_urls
    rng = random.Random(7)
    cached = [rng.randrange(10, 3000) for _ in range(3 * BLOCK)]

    # Both idle: the tie goes to union-1, which now caches the prompt's three blocks.
    assert complete(cfg, [*cached, 1]) == [0, -1]
    # A long answer keeps union-1 busy (the tie goes to it again). Sent on a socket the test never
    # reads: closing it is the client hanging up, which aborts the request on the engine.
    body = json.dumps({"model": cfg.served_model_name, "prompt": [5, 6, 7], "max_tokens": 2000,
                       "temperature": 0, "ignore_eos": True}).encode()
    url = httpx.URL(cfg.coordinator_url)
    with socket.create_connection((url.host, url.port), timeout=30.0) as busy:
        busy.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (url.host.encode(), url.port, API_KEY.encode(), len(body), body)
        )
        deadline = time.monotonic() + 60
        while stats(e1)["running"] != 1:
            assert time.monotonic() < deadline, "the long request never started on union-1"
            time.sleep(0.05)
        assert stats(e2)["running"] == 0

        # The defaults weigh only affinity: the repeat goes to the busy holder and hits its cache.
        assert complete(cfg, [*cached, 2]) == [3 * BLOCK, -1]
        # Affinity weighted high against load still does.
        weigh(cfg, prefix_weight=10.0, queue_weight=1.0)
        assert complete(cfg, [*cached, 3]) == [3 * BLOCK, -1]
        # Load weighted high and affinity 0: the least loaded engine, which has none of it cached.
        weigh(cfg, prefix_weight=0.0, queue_weight=5.0)
        assert complete(cfg, [*cached, 4]) == [-1, 0]
        assert stats(e1)["running"] == 1  # the long request was there all along

    # The client hung up: the coordinator aborts the request on the engine; nothing is left running.
    deadline = time.monotonic() + 30
    while stats(e1)["running"] or stats(e1)["active_streams"]:
        assert time.monotonic() < deadline, "the abandoned request kept running on union-1"
        time.sleep(0.05)
