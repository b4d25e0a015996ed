"""The data plane's wire vocabulary: request kinds, topology names and vLLM's token-only shapes.

Kinds are ``Literal`` types so a misspelt kind is a type error, not a branch never taken. The
msgspec Structs are vLLM's wire types where the coordinator decodes or validates them: render's
generate requests, the generate answers and stream events (vllm-protocol.md 3.1, 3.4 and 3.5)
and the KV cache events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

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


# vLLM's token-mode generate request as render returns it and the generate answers
# (vllm-protocol.md 3.1, 3.4, 3.5), as msgspec Structs that validate what the coordinator relies
# on: ids, request ids, sampling params, every choice's token ids. The data plane keeps
# the answers as dicts (it rewrites them in place on the way to derender); these Structs are
# checked with ``msgspec.convert`` and unknown fields are ignored, so vLLM may add fields.
class GenerateRequest(msgspec.Struct, gc=False):
    """``POST /inference/v1/generate`` (3.1) as render returns it: what the pipeline reads of it
    (engine request ids and logs, budgets and admission) before it sends it on as a dict."""

    token_ids: Annotated[list[int], msgspec.Meta(min_length=1)]
    request_id: Annotated[str, msgspec.Meta(min_length=1)]
    sampling_params: dict[str, Any]


class GenerateChoice(msgspec.Struct, gc=False):
    token_ids: list[int]
    index: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: dict[str, Any] | None = None


class Usage(msgspec.Struct, gc=False):
    prompt_tokens: int = 0
    completion_tokens: int | None = None
    total_tokens: int = 0


class GenerateResponse(msgspec.Struct, gc=False):
    """The non-streaming answer (3.4): one choice per sample, P's ``kv_transfer_params``."""

    choices: list[GenerateChoice]
    request_id: str | None = None
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: list[Any] | None = None


class GenerateEvent(msgspec.Struct, gc=False):
    """One SSE event of a streaming generate (3.5): a choice's new ids, the usage event
    (``choices == []``), or an in-band ``error``."""

    choices: list[GenerateChoice] = []
    request_id: str | None = None
    usage: Usage | None = None
    output_mode: str = "tokens"
    error: Any = None  # any shape: raise_for_error_event classifies it


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
