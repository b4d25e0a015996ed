"""Deterministic next-token function and fake logprobs.

The next token is a function of the seed and the whole context (prompt ids plus the ids
generated so far). The context is folded into a 64-bit chained hash, one step per token,
so a request replayed as ``prompt + first k outputs`` reaches the same state as the
original after k steps and continues identically, at O(1) cost per generated token.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass

_U64 = struct.Struct("<Q")
_MIX = struct.Struct("<QQQ")


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One (token, logprob, rank) entry; rank is 1-based like vLLM's."""

    token_id: int
    logprob: float
    rank: int


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The sampled token's entry and the top-k candidates in rank order."""

    sampled: Candidate
    top: tuple[Candidate, ...]


class TokenModel:
    """Pseudo language model: hash(seed, context) -> next token id."""

    def __init__(
        self,
        *,
        seed: int,
        vocab_size: int,
        eos_token_id: int,
        eos_probability: float = 0.03,
        special_token_ids: Iterable[int] = (),
        sampleable_limit: int | None = None,
    ) -> None:
        if vocab_size < 2:
            raise ValueError("vocab_size must be at least 2")
        self.seed = seed
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_probability = eos_probability
        limit = min(vocab_size, sampleable_limit or vocab_size)
        excluded = set(special_token_ids) | {eos_token_id}
        # Free-running steps draw from this pool; eos only comes from the eos branch so
        # its frequency is exactly eos_probability, not 1/vocab.
        self.pool: tuple[int, ...] = tuple(t for t in range(limit) if t not in excluded)
        if not self.pool:
            raise ValueError("no sampleable token ids left after removing special ids")
        self._initial = _h64(b"enginesim" + _U64.pack(seed & 0xFFFFFFFFFFFFFFFF))

    def state(self, token_ids: Iterable[int]) -> int:
        """The hash state after reading ``token_ids``."""
        state = self._initial
        for token in token_ids:
            state = self.advance(state, token)
        return state

    def advance(self, state: int, token_id: int) -> int:
        return _h64(_U64.pack(state) + _U64.pack(token_id))

    def sample(self, state: int, *, salt: int = 0, banned: Set[int] = frozenset()) -> int:
        """The next token after ``state``.

        ``salt`` varies the draw without changing the context (used for the first token
        of choices 1..n-1). ``banned`` ids are never returned (min_tokens bans stop ids);
        the draw is re-hashed until it lands outside them.
        """
        for attempt in range(64):
            h = _h64(_MIX.pack(state, salt & 0xFFFFFFFFFFFFFFFF, attempt))
            if (h & 0xFFFFFFFF) / 2**32 < self.eos_probability and self.eos_token_id not in banned:
                return self.eos_token_id
            token = self.pool[(h >> 32) % len(self.pool)]
            if token not in banned:
                return token
        # Only reachable if nearly the whole pool is banned; walk it deterministically.
        for token in self.pool:
            if token not in banned:
                return token
        raise ValueError("every sampleable token id is banned")

    def continuation(self, prompt: Sequence[int], length: int) -> list[int]:
        """``length`` free-running tokens after ``prompt`` (no stop handling); for tests."""
        state = self.state(prompt)
        out: list[int] = []
        for _ in range(length):
            token = self.sample(state)
            out.append(token)
            state = self.advance(state, token)
        return out

    def logprobs(self, state: int, token_id: int, k: int) -> TokenLogprobs:
        """Deterministic fake logprobs for ``token_id`` sampled after ``state``.

        The sampled token gets rank 1 most of the time and rank 2 or 3 otherwise, so
        both the "sampled is in the top-k" and the "sampled is not" shapes occur.
        Logprobs decrease strictly with rank and are rounded to 4 places so their JSON
        is short and stable.
        """
        h = _h64(_MIX.pack(state, token_id, 0x10B))
        rank = (1, 1, 1, 1, 1, 2, 2, 3)[h % 8]
        base = 0.01 + ((h >> 8) % 4000) / 10000.0

        def value(r: int) -> float:
            return round(-(base + 0.75 * (r - 1)), 4)

        sampled = Candidate(token_id, value(rank), rank)
        top: list[Candidate] = []
        used = {token_id}
        draw = 0
        for r in range(1, k + 1):
            if r == rank:
                top.append(sampled)
                continue
            while True:
                draw += 1
                candidate = self.pool[_h64(_MIX.pack(state, h, draw)) % len(self.pool)]
                if candidate not in used or draw > 8 * (k + 8):
                    break
            used.add(candidate)
            top.append(Candidate(candidate, value(r), r))
        return TokenLogprobs(sampled=sampled, top=tuple(top))
