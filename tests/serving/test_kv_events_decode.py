"""KV event batches decode into the Structs of ``protocol.py`` exactly as vLLM encodes them."""

from __future__ import annotations

import os

import msgpack
import pytest

from serving.pipeline.placement.kv_affinity import KVAffinityIndex
from serving.pipeline.placement.kv_events import KVEventDecodeError, KVEventSubscriber, decode_message
from serving.pipeline.protocol import AllBlocksCleared, BlockRemoved, BlockStored
from tests.env_memo import run_in_env

# Run in the render env: vLLM's own structs and its publisher's encoder (``ZmqEventPublisher``).
VLLM_ENCODE = """
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
stored = BlockStored(block_hashes=[b"\\x01" * 32, 7], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                     block_size=2, lora_id=None, medium="GPU", lora_name=None,
                     extra_keys=[("a", 1), None], group_idx=0, lookahead_token_ids=[[5], [6]])
removed = BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0)
encoder = msgspec.msgpack.Encoder()
print(encoder.encode(KVEventBatch(ts=1.5, events=[stored, removed, AllBlocksCleared()], data_parallel_rank=1)).hex())
print(encoder.encode(KVEventBatch(ts=2.0, events=[])).hex())
"""


@pytest.fixture(scope="module")
def vllm_payloads() -> list[bytes]:
    python = os.environ.get("MOTOR_RENDER_PYTHON")
    if not python:
        pytest.fail("MOTOR_RENDER_PYTHON is not set; run with `python3 -m toolchain exec -m pytest`", pytrace=False)
    # vLLM's output for this script is kept with the render environment (``env_memo``): importing
    # vLLM is 8 s of CPU, and its encoder writes the same bytes for as long as that environment lives.
    out = run_in_env(python, VLLM_ENCODE)
    return [bytes.fromhex(line) for line in out.split()]


def test_it_decodes_what_vllms_publisher_encodes(vllm_payloads: list[bytes]) -> None:
    full, empty = vllm_payloads
    batch = decode_message([b"kv", (7).to_bytes(8, "big"), full])
    assert (batch.seq, batch.ts, batch.data_parallel_rank) == (7, 1.5, 1)
    assert batch.events == [
        BlockStored(
            block_hashes=[b"\x01" * 32, 7], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
            medium="GPU", extra_keys=[("a", 1), None], group_idx=0, lookahead_token_ids=[[5], [6]],
        ),
        BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0),
        AllBlocksCleared(),
    ]  # fmt: skip
    # data_parallel_rank None is omitted on the wire (omit_defaults).
    assert decode_message([b"kv", bytes(8), empty]).data_parallel_rank is None


def test_the_index_applies_vllms_events(vllm_payloads: list[bytes]) -> None:
    index = KVAffinityIndex()
    index.set_block_size("a", 2)
    index.apply_events("a", decode_message([b"", bytes(8), vllm_payloads[0]]).events[:1])
    assert index.match("a", [1, 2, 3, 4, 9]) == 2


MALFORMED = [
    b"\xc1",  # not msgpack
    msgpack.packb({"ts": 1.0, "events": []}),  # a map, not array-like
    msgpack.packb([1.0, {"type": "AllBlocksCleared"}]),  # events not a list
    msgpack.packb([1.0, [{"type": "BlockEvicted", "block_hashes": [1]}]]),  # unknown tag
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                          "token_ids": [1, 2], "block_size": "2"}]]),  # fmt: skip
    msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [[1]]}]]),  # unhashable hash
    msgpack.packb([1.0, [["BlockRemoved", [5], None]]]),  # array-like events: not how vLLM sends them
]


@pytest.mark.parametrize("payload", MALFORMED)
def test_a_malformed_batch_is_an_error(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_message([b"", bytes(8), payload])


async def test_the_subscriber_counts_malformed_batches_and_goes_on() -> None:
    index = KVAffinityIndex()
    subscriber = KVEventSubscriber("a", "ipc:///nonexistent", index)
    for seq, payload in enumerate(MALFORMED):
        subscriber._handle([b"", seq.to_bytes(8, "big"), payload])
    subscriber._handle([b"", bytes(7), b""])  # a short seq frame
    assert subscriber.errors == len(MALFORMED) + 1 and subscriber.batches == 0
    good = msgpack.packb([1.0, [{"type": "AllBlocksCleared"}]])
    subscriber._handle([b"", (99).to_bytes(8, "big"), good])
    assert subscriber.batches == 1 and index.stats.cleared_events == 1
