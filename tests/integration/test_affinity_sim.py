"""KV-cache affinity end to end, precise mode: two simulated union engines publish their KV cache
events (vLLM's ZMQ format, on ``ipc://`` endpoints they bind), a fresh coordinator subscribes to
them from its fleet snapshot, and requests sharing a long prefix land on the engine that caches it.

No render sidecar: the render config names a port nobody listens on, so the coordinator takes
its local tokenizer, and completions prompts given as token ids reach the engines exactly as
sent, which lets the test seed an engine's cache directly with the same ids.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from dataclasses import replace
from typing import Any, Iterator

import httpx
import pytest

from motorsite import stack
from motorsite.supervisor import Supervisor, free_port

from .conftest import API_KEY

pytestmark = pytest.mark.integration

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BLOCK = 128


@pytest.fixture(scope="module")
def affinity_stack(
    base_config: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[stack.StackConfig]:
    """Two sims with KV events, and a coordinator whose instances name their endpoints."""
    tmp = tmp_path_factory.mktemp("affinity")
    cfg = replace(
        base_config,
        engines="sim",
        engine_ports=(free_port(), free_port()),
        coordinator_port=free_port(),
        render_port=free_port(),  # nothing listens there: local tokenizer
        database_url=f"sqlite:///{tmp / 'coordinator.sqlite3'}",
        log_dir=base_config.log_dir / "affinity",
    )
    endpoints = [f"ipc://{tmp}/kv-{n}.ipc" for n in (1, 2)]
    sims = [
        replace(spec, argv=[*spec.argv, "--kv-events-endpoint", endpoint])
        for spec, endpoint in zip(stack.engine_specs(cfg), endpoints, strict=True)
    ]
    with Supervisor(sims):
        stack.prepare_database(cfg)
        # demo_fleet names the instances union-1 and union-2 in engine order.
        script = (
            "from fleet.models import EngineInstance\n"
            "from fleet.services import bump_control_version\n"
            f"for name, endpoint in (('union-1', {endpoints[0]!r}), ('union-2', {endpoints[1]!r})):\n"
            "    EngineInstance.objects.filter(name=name).update(kv_events_endpoint=endpoint)\n"
            "bump_control_version()\n"
        )
        env = {**os.environ, **stack.coordinator_env(cfg)}
        subprocess.run([cfg.app_python, "manage.py", "shell", "-c", script], check=True, env=env, cwd=stack.ROOT)
        with Supervisor([stack.coordinator_spec(cfg)]):
            yield cfg


def prefix(seed: int, blocks: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 3000) for _ in range(blocks * BLOCK)]


def complete(cfg: stack.StackConfig, ids: list[int]) -> dict[str, Any]:
    body = {"model": cfg.served_model_name, "prompt": ids, "max_tokens": 2, "temperature": 0}
    r = httpx.post(cfg.coordinator_url + "/v1/completions", json=body, headers=HEADERS, timeout=30.0, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def seed_engine(url: str, ids: list[int]) -> None:
    """A request straight to one engine, as another coordinator's traffic would be."""
    body = {"request_id": f"seed-{time.monotonic_ns()}", "token_ids": ids,
            "sampling_params": {"max_tokens": 1, "temperature": 0}}
    r = httpx.post(url + "/inference/v1/generate", json=body, timeout=30.0, trust_env=False)
    assert r.status_code == 200, r.text


def stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/sim/stats", timeout=10.0, trust_env=False).json()


def received(cfg: stack.StackConfig) -> list[int]:
    return [stats(u)["requests_received"] for u in cfg.engine_urls]


def coordinator_metrics(cfg: stack.StackConfig) -> str:
    return httpx.get(cfg.coordinator_url + "/metrics", timeout=10.0, trust_env=False).text


def series(text: str, name: str, instance: str) -> float | None:
    """The value of ``name{instance="..."}`` in a scrape, None when there is no such series."""
    for line in text.splitlines():
        if line.startswith(f'{name}{{instance="{instance}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return None


def metric(text: str, name: str, instance: str) -> float:
    """The value of a series that must exist: a renamed metric fails here instead of reading 0."""
    value = series(text, name, instance)
    assert value is not None, f"no {name} series for {instance} in /metrics"
    return value


def in_flight(text: str, instance: str) -> float:
    """Tokens in flight on ``instance``. Admission drops an instance's entry when its last lease
    returns, so an idle instance has no series; the gauge family itself must be exported."""
    assert "# TYPE motor_engine_in_flight_tokens gauge" in text, "no in-flight gauge in /metrics"
    return series(text, "motor_engine_in_flight_tokens", instance) or 0.0


def test_repeated_long_prefix_requests_land_where_the_prefix_is_cached(affinity_stack: stack.StackConfig) -> None:
    cfg = affinity_stack
    e1, e2 = cfg.engine_urls
    # The first request on the coordinator's loop starts its subscriptions; a ZMQ PUB drops
    # what it sends before a subscription arrives, so wait until union-2's events are indexed.
    complete(cfg, [11, 12, 13])
    deadline = time.monotonic() + 30
    warm = 1000
    # No series yet is "not subscribed yet": the hub adds an instance's counters when it subscribes.
    while not series(coordinator_metrics(cfg), "motor_kv_event_batches_total", "union-2"):
        assert time.monotonic() < deadline, "the coordinator never received union-2's KV events"
        warm += 1
        seed_engine(e2, prefix(warm, 1))
        time.sleep(0.05)

    # R is cached on engine 2 only (by traffic the coordinator never placed). Idle instances tie
    # and the tie goes to union-1, so only affinity sends R's requests to engine 2.
    r_prefix, q_prefix = prefix(1), prefix(2)
    batches = metric(coordinator_metrics(cfg), "motor_kv_event_batches_total", "union-2")
    seed_engine(e2, r_prefix)
    deadline = time.monotonic() + 30
    while metric(coordinator_metrics(cfg), "motor_kv_event_batches_total", "union-2") <= batches:
        assert time.monotonic() < deadline, "union-2's BlockStored for the seeded prefix never arrived"
        time.sleep(0.05)
    before = received(cfg)
    hits_before = [stats(u)["cache"]["hit_tokens"] for u in cfg.engine_urls]

    complete(cfg, q_prefix + [1, 2, 3])  # Q goes to the tie-break winner, union-1, and stays there
    for n in range(3):
        complete(cfg, r_prefix + [50 + n])
        complete(cfg, q_prefix + [60 + n])

    after = received(cfg)
    assert [a - b for a, b in zip(after, before, strict=True)] == [4, 3]
    hits = [stats(u)["cache"]["hit_tokens"] - h for u, h in zip(cfg.engine_urls, hits_before, strict=True)]
    assert hits[1] == 3 * 3 * BLOCK  # every R request found all three blocks on engine 2
    assert hits[0] >= 3 * 3 * BLOCK  # and every Q request after the first on engine 1

    # Nothing left behind: no tokens in flight on the coordinator, nothing running on the engines.
    text = coordinator_metrics(cfg)
    assert in_flight(text, "union-1") == 0
    assert in_flight(text, "union-2") == 0
    assert metric(text, "motor_kv_event_errors_total", "union-1") == 0
    assert metric(text, "motor_kv_event_errors_total", "union-2") == 0
    for url in cfg.engine_urls:
        s = stats(url)
        assert s["running"] == 0 and s["active_streams"] == 0
