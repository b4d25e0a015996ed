"""The simulator's KV cache events: vLLM's ZMQ framing and msgpack shapes, both bind rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from enginesim import SimConfig
from enginesim.kvcache import block_hashes, encode_batch, is_bind_endpoint
from enginesim.testing import LiveServer, gen_body
from motorsite.supervisor import free_port

GENERATE = "/inference/v1/generate"
CONFIG = SimConfig(
    served_model_names=("tiny",), vocab_size=512, eos_token_ids=(2,), max_model_len=4096,
    block_size=16, cache_blocks=4,
)  # fmt: skip


class Subscriber:
    def __init__(self, address: str, bind: bool) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        (self.sock.bind if bind else self.sock.connect)(address)

    async def batch(self) -> tuple[list[bytes], list[Any]]:
        frames = await self.sock.recv_multipart()
        return frames, msgpack.unpackb(frames[2], raw=False)

    def close(self) -> None:
        self.sock.close(linger=0)


async def _until_subscribed(http: httpx.AsyncClient, server: LiveServer, sub: Subscriber) -> None:
    """PUB drops what it sends before the subscription arrives: send distinct one-block
    prompts until an event comes through, then drain and start clean."""
    for n in range(200):
        await http.post(server.url + GENERATE, json=gen_body([400 + n % 50] * 16, {"max_tokens": 1}))
        if await sub.sock.poll(20):
            break
    else:
        raise AssertionError("no KV event arrived")
    while await sub.sock.poll(50):
        await sub.sock.recv_multipart()
    await http.delete(server.url + "/sim/cache")
    await sub.batch()  # AllBlocksCleared


@pytest.fixture(params=["connect", "bind"])
def endpoint(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str, bool]:
    """(engine endpoint, subscriber address, subscriber binds)."""
    if request.param == "connect":  # tcp://host:port: the engine connects, we bind
        address = f"tcp://127.0.0.1:{free_port()}"
        return address, address, True
    address = f"ipc://{tmp_path}/kv.sock"
    return address, address, False


@pytest.fixture
def published(endpoint: tuple[str, str, bool]) -> Iterator[tuple[LiveServer, Subscriber]]:
    engine_endpoint, address, bind = endpoint
    sub = Subscriber(address, bind) if bind else None
    server = LiveServer(dataclasses.replace(CONFIG, kv_events_endpoint=engine_endpoint, kv_events_topic="kv"))
    server.start()
    sub = sub or Subscriber(address, bind)
    yield server, sub
    server.stop()
    sub.close()


async def test_it_publishes_vllm_framed_block_events(published: tuple[LiveServer, Subscriber]) -> None:
    server, sub = published
    async with httpx.AsyncClient(timeout=5.0) as http:
        await _until_subscribed(http, server, sub)
        prompt = list(range(10, 50))  # two full blocks of 16 + 8
        await http.post(server.url + GENERATE, json=gen_body(prompt, {"max_tokens": 1}))
        frames, batch = await sub.batch()
        assert frames[0] == b"kv" and len(frames[1]) == 8
        ts, events, dp_rank = batch
        assert isinstance(ts, float) and dp_rank == 0
        h = block_hashes(prompt, 16)
        assert events == [
            {
                "type": "BlockStored", "block_hashes": h, "parent_block_hash": None,
                "token_ids": prompt[:32], "block_size": 16, "lora_id": None, "medium": "GPU",
                "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        ]  # fmt: skip
        assert list(events[0])[0] == "type"
        seq = int.from_bytes(frames[1], "big")

        # A continuation stores only its new block, chained to the cached parent; the
        # cache holds 4 blocks, so the next prompts evict the oldest leaves first.
        await http.post(server.url + GENERATE, json=gen_body(prompt[:32] + list(range(60, 80)), {"max_tokens": 1}))
        frames, (_, events, _) = await sub.batch()
        assert int.from_bytes(frames[1], "big") == seq + 1
        assert [e["type"] for e in events] == ["BlockStored"]
        assert events[0]["parent_block_hash"] == h[1] and events[0]["token_ids"] == list(range(60, 76))
        await http.post(server.url + GENERATE, json=gen_body(list(range(200, 240)), {"max_tokens": 1}))
        _, (_, events, _) = await sub.batch()
        assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved"]
        assert events[1] == {
            "type": "BlockRemoved",
            "block_hashes": [block_hashes(prompt[:32] + list(range(60, 80)), 16)[2]],
            "medium": "GPU",
            "group_idx": 0,
        }

        await http.delete(server.url + "/sim/cache")
        _, (_, events, _) = await sub.batch()
        assert events == [{"type": "AllBlocksCleared"}]


def test_it_binds_like_vllms_publisher() -> None:
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("ipc:///tmp/x")
    assert not is_bind_endpoint("tcp://127.0.0.1:5557")


def test_it_encodes_the_batch_array_like() -> None:
    payload = encode_batch(1.5, [{"type": "AllBlocksCleared"}])
    assert msgpack.unpackb(payload) == [1.5, [{"type": "AllBlocksCleared"}], 0]
    assert msgpack.unpackb(encode_batch(1.5, [], None)) == [1.5, []]
