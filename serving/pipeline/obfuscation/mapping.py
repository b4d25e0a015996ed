"""Token obfuscation: semantic ids in the coordinator, physical ids at the engine.

Deployments that serve obfuscated weights (rows of the embedding and of the output layer
permuted by a secret key) must never send a plain token id to an engine. The boundary is:

    render (semantic ids) -> obfuscate_request -> engine (physical ids)
    engine (physical ids) -> deobfuscate_response / deobfuscate_event -> derender (semantic ids)

``TokenMapping`` is a keyed bijection of the whole vocabulary, special tokens included (the
obfuscated model's configs carry the physical eos/bos/pad ids, see ``tinymodel.obfuscate``).
Who uses which ids:

- physical: the engine, placement and the KV affinity index (they must match the engines'
  caches, which hold physical ids), P/D legs (each leg is one obfuscated GenerateRequest);
- semantic: flow control, derender, the relay/replay ledger of committed output (a replay
  prompt is re-obfuscated, like any request, right before it goes to the new attempt).

The request and response walkers (``obfuscate_request`` and the rest) and the table of what an
obfuscated engine receives, field by field, are in ``fields.py``.

Errors (all in the ``serving.pipeline.errors`` tree):

RequestError
 +-- ObfuscationRefused       this request cannot be sent obfuscated
MotorError
 +-- ObfuscationKeyError      503: obfuscation on, key missing/invalid/mismatched: refuse, never fall back
 +-- ObfuscatedOutputInvalid  502: the engine returned an id outside the vocabulary (wrong key/model),
                              or a response field ``fields.py`` does not know how to map
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from serving.pipeline.errors import MotorError, RequestError

# Domain separation: the permutation and the key id are different functions of the same key.
_PERMUTATION_DOMAIN = b"motorsite/token-permutation/v1"
_KEY_ID_DOMAIN = b"motorsite/token-key-id/v1"
_SALT_DOMAIN = b"motorsite/cache-salt/v1"
MIN_KEY_BYTES = 16


class ObfuscationKeyError(MotorError):
    """Obfuscation is on but its key is missing, invalid or not the configured one: the server's
    fault, not the request's, so 503 (traffic resumes once the key is back)."""

    status = 503
    type = "ServiceUnavailableError"


class ObfuscationRefused(RequestError):
    """The request would expose text or plain ids to an engine, or has an unmappable field."""


class ObfuscatedOutputInvalid(MotorError):
    """The engine answered ids outside the vocabulary: its key or model is not ours."""

    status = 502
    type = "BadGatewayError"


def key_id(key: bytes) -> str:
    """Return the public identifier of ``key``: 16 hex digits of a domain-separated SHA-256.

    Engines declare it and the render config names it; it reveals nothing usable about the key.
    """
    return hashlib.sha256(_KEY_ID_DOMAIN + key).hexdigest()[:16]


def permutation(key: bytes, vocab_size: int) -> np.ndarray:
    """Return ``forward`` with ``forward[semantic] == physical``, a keyed permutation of the vocabulary.

    Each id gets a 64-bit sort key from one SHAKE-256 stream seeded by the key and the vocabulary
    size; sorting them gives the permutation. Only hashlib and a stable sort: the coordinator and
    the model builder agree on every platform and numpy version (numpy's own shuffles promise no
    stream stability across releases).
    """
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"an obfuscation key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    seed = _PERMUTATION_DOMAIN + vocab_size.to_bytes(8, "little") + key
    stream = hashlib.shake_256(seed).digest(8 * vocab_size)
    sort_keys = np.frombuffer(stream, dtype="<u8")
    # argsort gives, for rank r, the semantic id placed there; rank is the physical id.
    order = np.argsort(sort_keys, kind="stable")
    forward = np.empty(vocab_size, dtype=np.int64)
    forward[order] = np.arange(vocab_size, dtype=np.int64)
    return forward


@dataclass(frozen=True, eq=False)
class TokenMapping:
    """A keyed bijection semantic id <-> physical id over ``range(vocab_size)``; vectorized both ways."""

    key_id: str
    forward: np.ndarray = field(repr=False)  # semantic -> physical
    inverse: np.ndarray = field(repr=False)  # physical -> semantic
    # The same tables as Python lists, for short id lists (see _SHORT).
    _forward_list: list[int] = field(init=False, repr=False)
    _inverse_list: list[int] = field(init=False, repr=False)
    # Keys the cache-salt digest. Derived from the permutation, which is exactly as secret as the
    # key (whoever has it has broken the obfuscation anyway), so every way of building a mapping
    # has one.
    _salt_key: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_forward_list", self.forward.tolist())
        object.__setattr__(self, "_inverse_list", self.inverse.tolist())
        table = np.ascontiguousarray(self.forward, dtype="<i8").tobytes()
        object.__setattr__(self, "_salt_key", hashlib.sha256(_SALT_DOMAIN + table).digest())

    @classmethod
    def from_key(cls, key: bytes, vocab_size: int) -> TokenMapping:
        forward = permutation(key, vocab_size)
        inverse = np.empty_like(forward)
        inverse[forward] = np.arange(vocab_size, dtype=np.int64)
        forward.setflags(write=False)
        inverse.setflags(write=False)
        return cls(key_id(key), forward, inverse)

    @property
    def vocab_size(self) -> int:
        return int(self.forward.shape[0])

    def to_physical(self, ids: Sequence[int]) -> list[int]:
        """Map semantic ids to physical ones; raise ``ObfuscationRefused`` for an id outside the vocabulary."""
        return _apply(self.forward, self._forward_list, ids, ObfuscationRefused, "token id")

    def to_semantic(self, ids: Sequence[int]) -> list[int]:
        """Map physical ids back; raise ``ObfuscatedOutputInvalid`` for an id outside the vocabulary."""
        return _apply(self.inverse, self._inverse_list, ids, ObfuscatedOutputInvalid, "engine token id")

    def physical(self, token_id: int) -> int:
        return self.to_physical([token_id])[0]

    def semantic(self, token_id: int) -> int:
        return self.to_semantic([token_id])[0]

    def salt(self, cache_salt: str) -> str:
        """The ``cache_salt`` an obfuscated engine gets: a keyed digest of the client's, 64 hex digits.

        Equal salts stay equal and different ones different, so the engine's prefix cache is
        partitioned exactly as the client asked, but the engine never reads the client's string.
        """
        return hmac.new(self._salt_key, cache_salt.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


# Below this many ids a Python list lookup beats numpy's per-call overhead (streaming deltas,
# stop ids, logprob alternatives); above it the vectorized gather wins (prompts).
_SHORT = 48


def _apply(
    table: np.ndarray, lookup: list[int], ids: Sequence[int], error: type[MotorError], what: str
) -> list[int]:
    if len(ids) == 0:
        return []
    if len(ids) <= _SHORT and isinstance(ids, list):
        try:
            if min(ids) >= 0 and max(ids) < len(lookup):
                return [lookup[i] for i in ids]
        except TypeError:
            raise error(f"{what}s must be integers") from None
        # Out of range, or not ints (floats index nothing): the vectorized path says which.
    try:
        arr = np.asarray(ids, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise error(f"{what}s must be integers") from None
    if arr.ndim != 1:
        raise error(f"{what}s must be a flat list of integers")
    if int(arr.min()) < 0 or int(arr.max()) >= table.shape[0]:
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        raise error(f"{what} {bad} is outside the vocabulary (0..{table.shape[0] - 1})")
    out: list[int] = table[arr].tolist()
    return out
