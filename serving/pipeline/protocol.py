"""The data plane's wire vocabulary: request kinds, topology names and vLLM's token-only shapes.

Kinds are ``Literal`` types so a misspelt kind is a type error, not a branch never taken. The
TypedDicts describe vLLM's ``/inference/v1/generate`` wire shapes (vllm-protocol.md sections 3
and 4) as the coordinator uses them: every key optional where vLLM may omit it. They document
and type the engine boundary; code that copies or rewrites bodies keeps plain dicts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal, TypedDict

import msgspec

# OpenAI APIs the coordinator serves token-only (render + derender exist for them).
TokenKind = Literal["chat", "completions"]
# Every client API; Responses and Anthropic Messages always pass through natively.
ApiKind = Literal["chat", "completions", "responses", "messages"]
# How one prompt runs on the engines (``topologies/``).
TopologyName = Literal["union", "handoff", "trigger"]
# Where a prompt's ids came from.
TokenizerSource = Literal["render", "local"]
# A streaming generate's events, a list per read: those that arrived together (never empty), so
# the reader downstream sees what queued while it was busy without a task of its own to look.
# The reader empties each list it takes; every layer passes the same list on (or changes it in
# place), so none holds an event the reader has taken while the stream waits on a slow client.
EventBatches = AsyncIterator[list[dict[str, Any]]]


class SamplingParams(TypedDict, total=False):
    max_tokens: int
    min_tokens: int
    n: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None


class GenerateRequest(TypedDict, total=False):
    """``POST /inference/v1/generate`` (section 3.1); ``token_ids`` and ``request_id`` always set."""

    request_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    stream: bool
    stream_options: dict[str, Any] | None
    kv_transfer_params: dict[str, Any] | None
    cache_salt: str | None
    priority: int


class GenerateChoice(TypedDict, total=False):
    index: int
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: dict[str, Any] | None


class Usage(TypedDict, total=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateResponse(TypedDict, total=False):
    """The non-streaming answer (section 3.3): one choice per sample, P's ``kv_transfer_params``."""

    request_id: str
    choices: list[GenerateChoice]
    usage: Usage | None
    kv_transfer_params: dict[str, Any] | None
    prompt_logprobs: list[Any] | None


class GenerateEvent(TypedDict, total=False):
    """One SSE event of a streaming generate (section 4): choices with new ids, or the usage event
    (``choices == []``), or an in-band ``error``."""

    request_id: str
    choices: list[GenerateChoice]
    usage: Usage | None
    output_mode: Literal["tokens"]
    error: dict[str, Any]



# vLLM's KV cache events (``vllm/distributed/kv_events.py``, 0.32 and 0.33), decoded by msgspec
# as vLLM encodes them: the batch array-like, each event a map tagged by ``"type"`` with
# ``omit_defaults``. Unknown fields are skipped, so a newer engine's additions decode.
ExternalBlockHash = bytes | int


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
