"""Wire models: vLLM 0.33.0's token-only generate protocol plus the simulator's control API.

Request models parse like vLLM's: unknown keys are ignored, ``SamplingParams`` range
checks are value errors that carry the offending parameter (vLLM's validation handler
reports it as ``param``). Response models keep vLLM's field order, because clients and
tests compare JSON text, not only parsed values.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ParameterError(ValueError):
    """A ``SamplingParams`` check failure; ``parameter`` becomes the error's ``param``."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(message)
        self.parameter = parameter


# -- requests -----------------------------------------------------------------------------


class SamplingParams(BaseModel):
    """The subset of vLLM's SamplingParams the simulator reads; the rest is accepted."""

    model_config = ConfigDict(extra="ignore")

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprob_token_ids: list[list[int]] | None = None
    detokenize: bool = True
    output_kind: int = 0
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    extra_args: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _post_init_checks(self) -> SamplingParams:
        # The checks of vLLM's SamplingParams.__post_init__ / _verify_args, same order.
        if self.n < 1:
            raise ParameterError(f"n must be at least 1, got {self.n}.", "n")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ParameterError(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.",
                "presence_penalty",
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ParameterError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.",
                "frequency_penalty",
            )
        if self.repetition_penalty <= 0.0:
            raise ParameterError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
                "repetition_penalty",
            )
        if self.temperature < 0.0:
            raise ParameterError(
                f"temperature must be non-negative, got {self.temperature}.", "temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ParameterError(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if self.top_k < -1:
            raise ParameterError(
                f"top_k must be 0 (disable), or at least 1, got {self.top_k}.", "top_k"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ParameterError(f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParameterError(
                f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens"
            )
        if self.min_tokens < 0:
            raise ParameterError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.",
                "min_tokens",
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.",
                "min_tokens",
            )
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise ParameterError(
                f"logprobs must be non-negative or -1, got {self.logprobs}.", "logprobs"
            )
        if self.temperature < 1e-5 and self.n > 1:
            raise ParameterError(
                f"n must be 1 when using greedy sampling, got {self.n}.", "n"
            )
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class GenerateRequest(BaseModel):
    """``POST /inference/v1/generate`` body (render's output)."""

    model_config = ConfigDict(extra="ignore")

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    token_ids: list[int] = Field(min_length=1)
    token_offsets: list[tuple[int, int]] | None = None
    # Multimodal inputs are accepted and ignored: the simulator only sees token ids.
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    sampling_params: SamplingParams
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    parse_context: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v

    @model_validator(mode="after")
    def _exclusive_mm(self) -> GenerateRequest:
        if self.content_parts and self.features:
            raise ValueError("content_parts and features are mutually exclusive")
        return self

    def max_tokens_provided(self) -> bool:
        """Whether the client sent ``max_tokens`` (vLLM re-defaults a missing key)."""
        return (
            "max_tokens" in self.sampling_params.model_fields_set
            and self.sampling_params.max_tokens is not None
        )


# -- responses ----------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None


class GenerateLogProb(BaseModel):
    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    top_logprobs: list[GenerateLogProb] = []


class GenerateLogProbs(BaseModel):
    content: list[GenerateLogProbsContent] | None = None


class GenerateResponseChoice(BaseModel):
    index: int
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[dict[str, Any]] | None = None
    logprobs: GenerateLogProbs | None = None


class GenerateResponse(BaseModel):
    request_id: str
    model: str | None = None
    created: int | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: list[Any] | None = None
    prompt_token_id_logprobs: str | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateResponseChoice]


class GenerateStreamChoice(BaseModel):
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[dict[str, Any]] | None = None
    logprobs: GenerateLogProbs | None = None


class GenerateStreamResponse(BaseModel):
    request_id: str
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateStreamChoice]

    def to_sse_json(self) -> str:
        """A token event as vLLM writes it: only these three keys dropped when null."""
        exclude = {
            name
            for name in ("prompt_token_ids", "mm_placeholders", "metrics")
            if getattr(self, name) is None
        }
        return self.model_dump_json(exclude=exclude)


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = []


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


# -- control API --------------------------------------------------------------------------


class ScriptIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int] = Field(min_length=1)
    output_token_ids: list[int] = Field(min_length=1)
    match: Literal["exact", "suffix"] = "exact"


class FaultIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal[
        "fail_before_first_token",
        "drop_after_tokens",
        "http_status",
        "stall_after_tokens",
        "error_event_after_tokens",
    ]
    tokens: int = Field(default=0, ge=0)
    status: int = Field(default=500, ge=400, le=599)
    count: int = Field(default=1, ge=0)
