"""KV-cache affinity: which instance already holds a prompt's leading blocks.

Engines cache the KV of *full* blocks (``block_size`` tokens, 128 by default) keyed by a chain
of hashes: block i's key covers block i's tokens and every block before it, so a prompt hits
exactly its leading blocks that some earlier request shared. The index mirrors that per
instance with the coordinator's own chained hashes (parent hash + the block's token ids), so
it never depends on vLLM's hash function or seed, over the ids the engines actually see
(physical ids when obfuscation is on).

Two ways to fill it, usable together:

- approximate: :meth:`KVAffinityIndex.record` after placing a request (assumes the engine
  keeps what it computed; eviction is only guessed by the index's own LRU);
- precise: :meth:`KVAffinityIndex.apply_events` with the engine's KV cache events
  (``serving.pipeline.placement.kv_events``): BlockStored blocks are indexed by the token ids the
  event carries, chained through the engine's parent hash; BlockRemoved and AllBlocksCleared
  forget.

Per LoRA adapter: vLLM keys an adapter's blocks apart from the base model's (and from other
adapters') even for the same tokens, since their KV differs. The index does the same: the chain
of a prompt run under an adapter starts from a root of the adapter's name (``lora_root``), on
lookup and record (``PromptBlocks(..., lora=name)``) as for BlockStored events that name it
(``lora_name``), so an adapter's request never counts the base's blocks as a hit, nor the reverse.

Memory is bounded: an LRU per instance (``max_blocks_per_instance``) and a global cap
(``max_blocks``) that evicts from the largest instance first. Pure data structure, no I/O,
not thread-safe (one per event loop).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from serving.pipeline.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 128


def _block_key(parent: int | None, tokens: Sequence[int]) -> int:
    # CPython's tuple hash over ints: 64-bit, the same in every process (PYTHONHASHSEED salts
    # only str and bytes), and about six times cheaper than blake2b over packed ids. A collision
    # only misplaces one request; engines check their own hashes.
    return hash((0 if parent is None else parent, tuple(tokens)))


def lora_root(lora: str | None) -> int | None:
    """The parent of a chain's first block: None for the base model, else a 64-bit key of the
    adapter's name (blake2b: the same in every process, unlike ``hash`` of a str)."""
    if not lora:
        return None
    return int.from_bytes(hashlib.blake2b(lora.encode(), digest_size=8).digest(), "big")


def chain_hashes(token_ids: Sequence[int], block_size: int, lora: str | None = None) -> list[int]:
    """The coordinator's chained hashes of the full blocks of ``token_ids`` (run under ``lora``)."""
    keys: list[int] = []
    parent = lora_root(lora)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _block_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


class PromptBlocks:
    """One prompt's chained block hashes, computed once per block size and then reused.

    One placement looks a prompt up and then records it; hashing is most of what either costs,
    so the scheduler hashes through one of these per decision.
    """

    __slots__ = ("token_ids", "lora", "_keys")

    def __init__(self, token_ids: Sequence[int], lora: str | None = None) -> None:
        self.token_ids = token_ids
        self.lora = lora  # the LoRA adapter the prompt runs under; None: the base model
        self._keys: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def keys(self, block_size: int) -> list[int]:
        keys = self._keys.get(block_size)
        if keys is None:
            keys = self._keys[block_size] = chain_hashes(self.token_ids, block_size, self.lora)
        return keys


Prompt = Sequence[int] | PromptBlocks


def prompt_blocks(prompt: Prompt) -> PromptBlocks:
    return prompt if isinstance(prompt, PromptBlocks) else PromptBlocks(prompt)


@dataclass(slots=True)
class _Instance:
    block_size: int
    # Set from the engine's metrics or its first full-block event; until then the default.
    known: bool = False
    # Our block key -> the engine's hash for it (None when only recorded), LRU order.
    blocks: OrderedDict[int, Hashable | None] = field(default_factory=OrderedDict)
    # The engine's hash -> our key, to chain BlockStored parents and resolve BlockRemoved.
    by_engine_hash: dict[Hashable, int] = field(default_factory=dict)


@dataclass(slots=True)
class IndexStats:
    recorded: int = 0
    stored_events: int = 0
    removed_events: int = 0
    cleared_events: int = 0
    # BlockStored whose parent the index never saw (events missed): not indexable.
    orphans: int = 0
    evicted: int = 0


class KVAffinityIndex:
    """Per-instance index of cached block chains; see the module docstring."""

    def __init__(
        self,
        *,
        default_block_size: int = DEFAULT_BLOCK_SIZE,
        max_blocks_per_instance: int = 65_536,
        max_blocks: int = 1_048_576,
    ) -> None:
        if default_block_size < 1 or max_blocks_per_instance < 1 or max_blocks < 1:
            raise ValueError("block size and capacities must be positive")
        self.default_block_size = default_block_size
        self.max_blocks_per_instance = max_blocks_per_instance
        self.max_blocks = max_blocks
        self.stats = IndexStats()
        self._instances: dict[str, _Instance] = {}
        self._total = 0
        # Block key -> instances holding it: scoring walks a prompt's chain once and only
        # touches the instances that hold each block, instead of probing every candidate.
        self._holders: dict[int, set[str]] = {}
        # Block size -> instances using it (one chain of hashes per size per decision).
        self._by_size: dict[int, set[str]] = {}

    # -- configuration ----------------------------------------------------------------

    def _get(self, instance: str) -> _Instance:
        state = self._instances.get(instance)
        if state is None:
            state = self._instances[instance] = _Instance(self.default_block_size)
            self._by_size.setdefault(state.block_size, set()).add(instance)
        return state

    def _resize(self, instance: str, state: _Instance, block_size: int) -> None:
        self._by_size[state.block_size].discard(instance)
        if not self._by_size[state.block_size]:
            del self._by_size[state.block_size]
        state.block_size = block_size
        self._by_size.setdefault(block_size, set()).add(instance)

    def block_size(self, instance: str) -> int:
        state = self._instances.get(instance)
        return state.block_size if state is not None else self.default_block_size

    def set_block_size(self, instance: str, block_size: int) -> None:
        """Set an instance's block size (from its metrics); a change forgets its blocks."""
        if block_size < 1:
            raise ValueError("block_size must be positive")
        state = self._get(instance)
        state.known = True
        if state.block_size != block_size:
            self.clear(instance)
            self._resize(instance, state, block_size)

    def forget(self, instance: str) -> None:
        """Drop an instance entirely (removed from the fleet)."""
        self.clear(instance)
        state = self._instances.pop(instance, None)
        if state is not None:
            members = self._by_size[state.block_size]
            members.discard(instance)
            if not members:
                del self._by_size[state.block_size]

    def clear(self, instance: str) -> None:
        state = self._instances.get(instance)
        if state is not None:
            self._total -= len(state.blocks)
            for key in state.blocks:
                self._unhold(key, instance)
            state.blocks.clear()
            state.by_engine_hash.clear()

    def clear_all(self) -> None:
        for name in list(self._instances):
            self.clear(name)

    def _unhold(self, key: int, instance: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(instance)
            if not holders:
                del self._holders[key]

    # -- queries ----------------------------------------------------------------------

    def __len__(self) -> int:
        return self._total

    def blocks(self, instance: str) -> int:
        state = self._instances.get(instance)
        return len(state.blocks) if state is not None else 0

    def match(self, instance: str, token_ids: Prompt) -> int:
        """Number of leading full blocks of ``token_ids`` cached on ``instance``."""
        state = self._instances.get(instance)
        if state is None or not state.blocks:
            return 0
        return self._match(state, prompt_blocks(token_ids).keys(state.block_size))

    @staticmethod
    def _match(state: _Instance, keys: Sequence[int]) -> int:
        blocks = state.blocks
        n = 0
        for key in keys:
            if key not in blocks:
                break
            n += 1
        return n

    def depths(self, token_ids: Prompt) -> dict[str, int]:
        """Leading cached blocks per instance that holds at least the first one."""
        out: dict[str, int] = {}
        for levels in self.levels(token_ids):
            for depth, names in enumerate(levels, start=1):
                for name in names:
                    if out.get(name, 0) == depth - 1:
                        out[name] = depth
        return out

    def levels(self, token_ids: Prompt) -> list[list[set[str]]]:
        """Per block size, the holders of each of the prompt's leading blocks, until a block
        nobody holds: ``levels[k]`` holds block k (an instance's depth is how many leading
        levels it is in). Dictionary lookups only: the cost follows the prompt, not the fleet.
        """
        blocks = prompt_blocks(token_ids)
        out: list[list[set[str]]] = []
        for size in self._by_size:
            levels: list[set[str]] = []
            for key in blocks.keys(size):
                holders = self._holders.get(key)
                if not holders:
                    break
                levels.append(holders)
            if levels:
                out.append(levels)
        return out

    def depth_of(self, name: str, levels: list[list[set[str]]]) -> int:
        """``name``'s leading cached blocks, from ``levels(...)``."""
        for chain in levels:
            depth = 0
            for holders in chain:
                if name not in holders:
                    break
                depth += 1
            if depth:
                return depth
        return 0

    # -- updates ----------------------------------------------------------------------

    def record(self, instance: str, token_ids: Prompt) -> int:
        """Approximate mode: assume ``instance`` now caches ``token_ids``' full blocks.

        Returns how many blocks were new to the index.
        """
        state = self._get(instance)
        self.stats.recorded += 1
        keys = prompt_blocks(token_ids).keys(state.block_size)
        return self._insert(instance, state, [(k, None) for k in keys])

    def _insert(self, instance: str, state: _Instance, entries: Sequence[tuple[int, Hashable | None]]) -> int:
        blocks = state.blocks
        new = 0
        for key, engine_hash in entries:
            if key in blocks:
                if engine_hash is not None and blocks[key] is None:
                    blocks[key] = engine_hash
            else:
                blocks[key] = engine_hash
                self._holders.setdefault(key, set()).add(instance)
                new += 1
            if engine_hash is not None:
                state.by_engine_hash[engine_hash] = key
        # Children first, so a prefix stays more recent than its continuations and the
        # LRU evicts leaves before the blocks they hang off.
        for key, _ in reversed(entries):
            blocks.move_to_end(key)
        self._total += new
        while len(blocks) > self.max_blocks_per_instance:
            self._evict_one(instance, state)
        while self._total > self.max_blocks:
            name = max(self._instances, key=lambda n: len(self._instances[n].blocks))
            self._evict_one(name, self._instances[name])
        return new

    def _evict_one(self, instance: str, state: _Instance) -> None:
        key, engine_hash = state.blocks.popitem(last=False)
        self._unhold(key, instance)
        if engine_hash is not None:
            state.by_engine_hash.pop(engine_hash, None)
        self._total -= 1
        self.stats.evicted += 1

    def apply_events(self, instance: str, events: Iterable[KVEvent]) -> None:
        """Precise mode: apply vLLM's KV cache events (decoded by ``kv_events``)."""
        state = self._get(instance)
        for event in events:
            if isinstance(event, BlockStored):
                self.stats.stored_events += 1
                self._stored(instance, state, event)
            elif isinstance(event, BlockRemoved):
                self.stats.removed_events += 1
                for engine_hash in event.block_hashes:
                    self._removed(instance, state, engine_hash)
            elif isinstance(event, AllBlocksCleared):
                self.stats.cleared_events += 1
                self.clear(instance)

    def _removed(self, instance: str, state: _Instance, engine_hash: Hashable) -> None:
        key = state.by_engine_hash.pop(engine_hash, None)
        if key is not None and key in state.blocks:
            del state.blocks[key]
            self._unhold(key, instance)
            self._total -= 1

    def _stored(self, instance: str, state: _Instance, event: BlockStored) -> None:
        hashes, tokens, size = event.block_hashes, event.token_ids, event.block_size
        if size < 1:
            return
        if size != state.block_size:
            if state.known or len(tokens) != size * len(hashes):
                # A partial-block event (vLLM reports block_size = its token count), or
                # another size than the engine's metrics said: not a full block here.
                return
            # No size known yet: the engine's own full-block event says it.
            self.set_block_size(instance, size)
        parent = lora_root(event.lora_name)
        if event.parent_block_hash is not None:
            parent = state.by_engine_hash.get(event.parent_block_hash)
            if parent is None:
                self.stats.orphans += 1
                return
        entries: list[tuple[int, Hashable | None]] = []
        for i, engine_hash in enumerate(hashes):
            block = tokens[i * size : (i + 1) * size]
            if len(block) < size:
                break
            parent = _block_key(parent, block)
            entries.append((parent, engine_hash))
        if entries:
            self._insert(instance, state, entries)
