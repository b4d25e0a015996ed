"""KV-cache affinity index: approximate and precise (events) modes, bounds, the subscriber."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import msgpack
import msgspec
import zmq
import zmq.asyncio

from enginesim import SimConfig
from enginesim.kvcache import block_hashes as sim_hashes
from enginesim.testing import LiveServer, eventually, gen_body
from motorsite.supervisor import free_port
from serving.pipeline.placement.kv_affinity import KVAffinityIndex, chain_hashes
from serving.pipeline.placement.kv_events import KVEventSubscriber, decode_message, subscriber_address
from serving.pipeline.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BS = 128
SYSTEM = list(range(1000, 1000 + 3 * BS))  # a shared three-block prefix


def prompt(tail: int, length: int = 40) -> list[int]:
    return SYSTEM + [tail] * length


def stored(hashes: list[Any], parent: Any, tokens: list[int], size: int = BS) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size)


def test_it_matches_leading_full_blocks_only() -> None:
    index = KVAffinityIndex()
    index.record("a", prompt(1))
    assert index.match("a", prompt(2)) == 3  # same system prompt, other question
    assert index.match("a", SYSTEM[:BS] + [0] * 300) == 1
    assert index.match("a", [5] + SYSTEM) == 0  # chained: a shifted prefix shares nothing
    assert index.match("a", SYSTEM[: BS - 1]) == 0  # shorter than a block
    assert index.match("b", prompt(1)) == 0


def test_it_tells_each_holders_leading_blocks() -> None:
    index = KVAffinityIndex()
    index.record("a", SYSTEM[:BS] + [9] * BS)
    index.record("b", prompt(1))
    assert index.depths(prompt(3)) == {"a": 1, "b": 3}  # "c" holds nothing: not listed
    assert index.depths([7] * 500) == {}


def test_it_uses_each_instances_block_size() -> None:
    index = KVAffinityIndex()
    index.set_block_size("small", 16)
    index.record("small", prompt(1))
    index.record("big", prompt(1))
    assert index.match("small", prompt(2)) == 3 * BS // 16
    assert index.match("big", prompt(2)) == 3
    index.set_block_size("big", 64)  # a change forgets what was indexed at the old size
    assert index.blocks("big") == 0


def test_it_bounds_memory_per_instance_and_globally() -> None:
    index = KVAffinityIndex(max_blocks_per_instance=4, max_blocks=6)
    index.record("a", prompt(1, 2 * BS))  # 5 blocks -> 4 kept
    assert index.blocks("a") == 4
    # The leaf went first: the shared prefix is still whole.
    assert index.match("a", prompt(2)) == 3
    index.record("b", [7] * (3 * BS))
    assert len(index) == 6 and index.blocks("b") == 3 and index.blocks("a") == 3
    assert index.stats.evicted == 2


def test_it_indexes_events_by_their_token_ids() -> None:
    index = KVAffinityIndex()
    index.set_block_size("a", BS)  # as read from the engine's metrics
    p = prompt(1, BS)  # four full blocks
    index.apply_events("a", [stored([11, 12], None, p[: 2 * BS]), stored([13, 14], 12, p[2 * BS : 4 * BS])])
    assert index.match("a", p) == 4
    # The coordinator's keys, not vLLM's: the same chain as approximate mode.
    approx = KVAffinityIndex()
    approx.record("a", p)
    assert index.depths(p) == approx.depths(p) == {"a": 4}

    index.apply_events("a", [BlockRemoved(block_hashes=[13], medium="GPU")])
    assert index.match("a", p) == 2
    index.apply_events("a", [stored([99], 42, p[:BS])])  # parent never seen
    assert index.stats.orphans == 1 and index.blocks("a") == 3
    index.apply_events("a", [stored([21], 11, list(range(BS // 2)), BS // 2)])  # partial block
    assert index.blocks("a") == 3
    index.apply_events("a", [AllBlocksCleared()])
    assert index.match("a", p) == 0 and len(index) == 0


def test_it_learns_the_block_size_from_the_first_full_block_event() -> None:
    index = KVAffinityIndex()
    index.apply_events("a", [stored([1, 2], None, [4] * 32, 16)])
    assert index.block_size("a") == 16 and index.match("a", [4] * 40) == 2


def test_it_forgets_engine_hashes_with_evicted_blocks() -> None:
    index = KVAffinityIndex(max_blocks_per_instance=2)
    p = [3] * (4 * BS)
    index.apply_events("a", [stored([1, 2, 3, 4], None, p)])
    assert index.blocks("a") == 2
    index.apply_events("a", [BlockRemoved(block_hashes=[1, 2, 3, 4])])
    assert len(index) == 0


def test_it_decodes_vllm_messages() -> None:
    payload = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                    "token_ids": [1] * 4, "block_size": 4}], 0])  # fmt: skip
    batch = decode_message([b"kv", (7).to_bytes(8, "big"), payload])
    assert (batch.seq, batch.data_parallel_rank, batch.events) == (7, 0, [stored([1], None, [1] * 4, 4)])


def test_it_binds_where_the_engine_connects() -> None:
    assert subscriber_address("tcp://127.0.0.1:5557") == ("tcp://127.0.0.1:5557", True)
    assert subscriber_address("tcp://*:5557") == ("tcp://127.0.0.1:5557", False)
    assert subscriber_address("ipc:///tmp/kv") == ("ipc:///tmp/kv", False)


async def test_it_follows_a_simulators_events_precisely() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    index = KVAffinityIndex()
    subscriber = KVEventSubscriber("sim-1", endpoint, index, topic="kv")
    subscriber.start()
    await subscriber.wait_ready()
    config = SimConfig(vocab_size=4096, max_model_len=4096, kv_events_endpoint=endpoint, kv_events_topic="kv")
    server = LiveServer(config)
    server.start()
    try:
        async with httpx.AsyncClient(timeout=5.0) as http:
            # PUB drops events sent before the subscription arrives: probe until one lands.
            n = 0

            async def subscribed() -> bool:
                nonlocal n
                n += 1
                await http.post(
                    server.url + "/inference/v1/generate", json=gen_body([n % 4000 + 4] * BS, {"max_tokens": 1})
                )
                return subscriber.batches > 0

            await eventually(subscribed)
            p = prompt(5)
            await http.post(server.url + "/inference/v1/generate", json=gen_body(p, {"max_tokens": 1}))
            await eventually(lambda: _true(index.match("sim-1", p) == 3))
            await http.delete(server.url + "/sim/cache")
            await eventually(lambda: _true(index.blocks("sim-1") == 0))
        assert subscriber.errors == 0
    finally:
        server.stop()
        await subscriber.aclose()
    assert subscriber._task is None


async def _true(value: bool) -> bool:
    return value


async def test_it_skips_garbage_and_keeps_listening() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    index = KVAffinityIndex()
    subscriber = KVEventSubscriber("x", address, index)
    subscriber.start()
    await subscriber.wait_ready()
    pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(address)
    good = msgspec.msgpack.encode(KVEventBatch(1.0, [stored([1], None, [1] * BS)], 0))
    try:

        async def indexed() -> bool:
            await pub.send_multipart([b"", bytes(8), b"\xc1not msgpack"])
            await pub.send_multipart([b"", (1).to_bytes(8, "big"), good])
            await asyncio.sleep(0.01)
            return index.blocks("x") == 1

        await eventually(indexed)
        assert subscriber.errors >= 1
    finally:
        pub.close(linger=0)
        await subscriber.aclose()


def test_chain_hashes_ignore_the_partial_tail() -> None:
    assert len(chain_hashes(list(range(300)), BS)) == 2
    assert chain_hashes(list(range(256)), BS) == chain_hashes(list(range(300)), BS)
    assert len(sim_hashes(list(range(300)), BS)) == 2


def test_it_scores_like_probing_each_instance_after_any_history() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    ops = st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.integers(0, 3),
            st.integers(1, 5),
            st.sampled_from(["record", "clear", "remove"]),
        ),
        max_size=30,
    )

    @settings(max_examples=60, deadline=None)
    @given(ops, st.integers(0, 3), st.integers(1, 5))
    def check(history: list[tuple[str, int, int, str]], family: int, blocks: int) -> None:
        index = KVAffinityIndex(max_blocks_per_instance=6, max_blocks=12, default_block_size=4)
        for name, fam, n, op in history:
            ids = [fam] * 4 + list(range(4 * n))
            if op == "record":
                index.record(name, ids)
            elif op == "clear":
                index.clear(name)
            else:
                index.apply_events(name, [AllBlocksCleared()])
        query = [family] * 4 + list(range(4 * blocks))
        assert index.depths(query) == {n: d for n in "abc" if (d := index.match(n, query))}
        assert len(index) == sum(index.blocks(n) for n in "abc") <= 12

    check()


async def test_it_keeps_one_subscriber_per_instance_in_sync_with_the_fleet() -> None:
    from serving.pipeline.placement.kv_events import KVEventHub

    index = KVAffinityIndex()
    hub = KVEventHub(index, topic="kv")
    a, b = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    hub.sync({"a": a, "b": b})
    first = hub.subscribers["a"]
    await first.wait_ready()
    index.record("b", prompt(1))
    hub.sync({"a": a, "b": f"tcp://127.0.0.1:{free_port()}"})  # b moved: restarted, forgotten
    assert hub.subscribers["a"] is first and index.blocks("b") == 0
    hub.sync({"a": a})
    assert set(hub.subscribers) == {"a"}
    await hub.aclose()
    assert hub.subscribers == {} and not hub._closing and first._task is None
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-events:")] == []
