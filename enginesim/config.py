"""Configuration of one simulated engine: identity, vocabulary, limits, latency, role.

Everything that later issues may grow (P/D roles, prefix cache, KV events) hangs off
:class:`SimConfig`, so a new capability is a new field with a default, not a new code path
threaded through every constructor.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class EngineRole(enum.Enum):
    """What part of a request this engine serves."""

    # Prefill and decode on one instance; kv_transfer_params are ignored.
    UNION = "union"
    # Answers the max_tokens=1 leg with kv_transfer_params (pull) or pushes to D (push).
    PREFILL = "prefill"
    # Consumes kv_transfer_params: pulls from P, or waits for P's push (see enginesim.pd).
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Frozen settings of one simulator process; built once by the CLI or a test."""

    served_model_names: tuple[str, ...] = ("tiny",)
    vocab_size: int = 4096
    # The first id is the one the simulator emits; every id here stops a sequence
    # (a tokens-only vLLM merges generation_config's eos ids into stop_token_ids).
    eos_token_ids: tuple[int, ...] = (2,)
    max_model_len: int = 2048
    seed: int = 0
    # Probability that a free-running step emits eos: small, so "stop" happens
    # sometimes and "length" sometimes.
    eos_probability: float = 0.03
    # Ids the sampler never emits on its own (the tokenizer's added tokens); scripts may.
    special_token_ids: frozenset[int] = frozenset()
    # Ids at or above this are never sampled: a padded config.json vocab can exceed the
    # tokenizer, and derender cannot decode ids the tokenizer lacks.
    sampleable_limit: int | None = None
    # vLLM's generation-config default for a missing max_tokens (max_new_tokens).
    default_max_new_tokens: int | None = None
    model_root: str | None = None
    version: str = "0.32.0"
    max_num_seqs: int = 256
    max_logprobs: int = 20
    # Latency model; 0 keeps tests instant.
    ttft_per_token_ms: float = 0.0
    tpot_ms: float = 0.0
    role: EngineRole = EngineRole.UNION
    # KV transfer between P and D (enginesim.pd): "pull" (NIXL / Mooncake, Handoff) or
    # "push" (layer-wise Mooncake, Trigger); the connector name is only reported.
    kv_transfer: str = "pull"
    kv_connector: str | None = None
    # Pull only: who makes the decode leg's kv_transfer_params. "returned": P answers with them
    # (NIXL, vllm-ascend's MooncakeConnectorV1). "router": upstream vLLM's MooncakeConnector, where
    # the router gives both legs a transfer_id and D also P's engine id and bootstrap address, and
    # P answers kv_transfer_params null (enginesim.pd).
    kv_pull_params: str = "returned"
    # The engine id P's params name and D must name back (vLLM's kv_transfer_config.engine_id);
    # None: a random "sim-<hex>".
    kv_engine_id: str | None = None
    # How long P keeps a finished prefill's blocks for D (vLLM frees them after 30 s).
    kv_hold_seconds: float = 30.0
    # How long D waits for P's push once the metaserver accepted its announcement.
    kv_push_timeout_seconds: float = 30.0
    # Where peers reach this instance (what remote_host / remote_port in the params say);
    # the CLI and LiveServer fill the port in.
    host: str = "127.0.0.1"
    port: int = 0
    # Prefix cache: full blocks of block_size tokens, LRU of cache_blocks (vLLM's default
    # block size; 512 blocks is what --kv-cache-memory-bytes 32M gives tinymodel).
    block_size: int = 128
    cache_blocks: int = 512
    # vLLM's --kv-events-config endpoint and topic; None publishes nothing.
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    capabilities: frozenset[str] = field(default_factory=lambda: frozenset({"tokens_only"}))
    # vLLM's --tokens-only: no tokenizer, so /tokenize of text and the OpenAI routes answer the
    # 400 a real one gives (the routes stay registered, as vLLM keeps them).
    tokens_only: bool = False
    # Routes this engine does not serve (an older vLLM, or one started without scale-out):
    # neither routed nor listed in /openapi.json, so a request there gets the router's 404.
    omitted_routes: frozenset[str] = frozenset()

    @property
    def model_name(self) -> str:
        """The name responses carry (vLLM uses the first served name)."""
        return self.served_model_names[0]

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    @property
    def root(self) -> str:
        return self.model_root or self.model_name

    def ttft_seconds(self, uncached_prompt_tokens: int) -> float:
        """Time to first token; grows with the prompt tokens not found in a cache."""
        return self.ttft_per_token_ms * uncached_prompt_tokens / 1000.0

    def tpot_seconds(self) -> float:
        return self.tpot_ms / 1000.0


@dataclass(frozen=True, slots=True)
class ModelDirInfo:
    """What the simulator reads from a Hugging Face style model directory."""

    vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    special_token_ids: frozenset[int] = frozenset()
    tokenizer_size: int | None = None
    max_new_tokens: int | None = None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def read_model_dir(model_dir: str | Path) -> ModelDirInfo:
    """Read vocab size, eos ids and special token ids from ``model_dir``.

    Missing files give empty fields; the caller decides what is mandatory.
    """
    root = Path(model_dir)
    config = _read_json(root / "config.json")
    generation = _read_json(root / "generation_config.json")
    tokenizer = _read_json(root / "tokenizer.json")

    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    eos_ids: tuple[int, ...]
    if isinstance(eos, int):
        eos_ids = (eos,)
    elif isinstance(eos, list):
        eos_ids = tuple(int(e) for e in eos)
    else:
        eos_ids = ()

    specials: set[int] = set()
    max_id = -1
    added = tokenizer.get("added_tokens") or []
    for token in added:
        if isinstance(token, dict) and isinstance(token.get("id"), int):
            max_id = max(max_id, token["id"])
            # Every added token, special or not: a random <tool_call> or <think> would
            # send the sidecar's parsers down paths no test asked for. Scripts emit them.
            specials.add(token["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and vocab:
        max_id = max(max_id, max(int(v) for v in vocab.values()))
    tokenizer_config = _read_json(root / "tokenizer_config.json")
    for key, token in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        if isinstance(token, dict) and token.get("special", False) and str(key).isdigit():
            specials.add(int(key))

    vocab_size = config.get("vocab_size")
    max_new = generation.get("max_new_tokens")
    return ModelDirInfo(
        vocab_size=int(vocab_size) if isinstance(vocab_size, int) else None,
        eos_token_ids=eos_ids,
        special_token_ids=frozenset(specials),
        tokenizer_size=max_id + 1 if max_id >= 0 else None,
        max_new_tokens=int(max_new) if isinstance(max_new, int) else None,
    )
