"""Checks every client body passes before anything uses it, on every path, and the response scrub.

``ServingPipeline`` calls ``check_body`` first for each API (token-only, the local fallback and
the native path all start there), ``check_ids`` on every tokenized request before admission, and
``scrub_response`` on every JSON answer. Nothing else in the data plane needs to distrust a
number or an id field afterwards: admission, rate limits and fan-out read validated values.

What is refused, with vLLM 0.33's status and message where it has one (400, ``BadRequestError``):

- numbers: ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` (Anthropic
  ``max_tokens``) not an integer, below 1 or above ``max_model_len``; ``n`` and ``best_of`` not
  an integer in [1, ``VLLM_MAX_N_SEQUENCES``]; more completion prompts than
  ``RequestLimits.max_prompts``; ``n`` x prompts over ``RequestLimits.max_choices`` (the
  coordinator's own cap, ``MOTOR_MAX_CHOICES``), on all four APIs alike;
- types: the sampling fields the coordinator reads (``temperature``, ``top_k``, ``stream``,
  ``echo``, ...) as vLLM's lax schema reads them (``"stream": "false"`` is false, as vLLM
  takes it; ``"temperature": "hot"`` is vLLM's schema 400), rewritten in the body;
- ``structured_outputs`` that is not an object (vLLM itself answers 500 there), ``stop`` that is
  not a string or a list of strings: routing reads both, so the schema's 400 comes first;
- engine controls (one rule: refused, never silently dropped, so a client learns its field had
  no effect): ``kv_transfer_params``, ``ec_transfer_params``, ``vllm_xargs``, ``extra_args``
  with any non-null value; ``priority`` other than 0 unless the caller's key allows it;
- ids outside the vocabulary in the prompt and in every id-valued sampling field; with the
  vocabulary size unknown the token-only path answers 503 (``VocabularyUnknown``);
- a feature that needs a tokenizer on the engine (stop strings, structured output, a forced
  tool choice) or an engine's own API (``echo``) on a fleet where no engine of the model could
  ever run it (all tokens-only, none with its own OpenAI API): 400 as a ``--tokens-only`` vLLM engine gives for the same input, but
  saying why (``FeatureUnavailable``, ``unservable``), once render has judged the body, so a
  malformed one gets render's own 400 (vLLM's validation); never the native path's 503. The
  same for ``/v1/responses`` and ``/v1/messages`` when no engine of the model serves its own
  OpenAI API (there is no render verdict to wait for there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from serving.pipeline.errors import MotorError, RequestError
from serving.pipeline.placement.filters import has_native_pd, unpaired_native_pd
from serving.pipeline.protocol import ApiKind
from serving.pipeline.snapshot import FleetSnapshot, ModelView

# vLLM's defaults for the same bounds (envs.VLLM_MAX_N_SEQUENCES, VLLM_MAX_COMPLETION_PROMPTS).
VLLM_MAX_N_SEQUENCES = 16384
VLLM_MAX_COMPLETION_PROMPTS = 1024

# Client fields that steer an engine's internals: KV/EC connector params can pin KV blocks or
# point an engine at an address of the client's choosing; xargs reach custom logits processors.
ENGINE_CONTROLS = ("kv_transfer_params", "ec_transfer_params", "vllm_xargs", "extra_args")
# The engine-internal fields answers can carry: nulled in JSON answers and in SSE frames alike.
RESPONSE_CONTROLS = ("kv_transfer_params", "ec_transfer_params")


class VocabularyUnknown(MotorError):
    """The model's vocabulary size is not in the snapshot yet: ids cannot be checked, so refuse."""

    status = 503
    type = "ServiceUnavailableError"


class FeatureUnavailable(RequestError):
    """The body is valid, but no engine of this fleet could ever serve what it asks for.

    400, not 501: a ``--tokens-only`` vLLM engine refuses these with 400 ("... requires a
    tokenizer"), and retrying cannot help, which a 5xx would suggest.
    """


# Native-path reasons that are properties of the request itself (engine/native.native_reason):
# what it asks for, the field that asks, and whether a tokenizer-loaded token-only engine runs it
# too. The first three are what a --tokens-only engine refuses (400, "... requires a tokenizer");
# ``echo`` has no derender, and the Responses and Messages APIs no render nor derender at all, so
# only an engine's own OpenAI API serves them.
_FEATURES: dict[str, tuple[str, str | None, bool]] = {
    "stop_strings": ("stop strings (use `stop_token_ids` instead)", "stop", True),
    "structured_output": ("structured output (`response_format` json_schema / json_object / structural_tag, "
                          "`structured_outputs`)", None, True),
    "forced_tool_choice": ('a forced tool choice (`tool_choice` "required" or a named function)', "tool_choice", True),
    "echo": ("`echo` (the prompt in the answer)", "echo", False),
    "api:responses": ("the Responses API (`/v1/responses`)", None, False),
    "api:messages": ("the Anthropic Messages API (`/v1/messages`)", None, False),
    "api:responses:previous_response_id": ("`previous_response_id` on the Responses API (`/v1/responses`)",
                                           None, False),
    "api:responses:background": ("`background` on the Responses API (`/v1/responses`)", None, False),
    "api:responses:stored_state": ("`conversation` or `prompt` on the Responses API (`/v1/responses`)",
                                   None, False),
    "api:responses:builtin_tools": ("a built-in tool on the Responses API (`/v1/responses`)", None, False),
    "api:responses:tool_choice": ("that tool choice on the Responses API (`/v1/responses`)", None, False),
}


def unservable(
    snapshot: FleetSnapshot, model: str, reason: str, body: Mapping[str, Any], kind: ApiKind | None = None,
) -> FeatureUnavailable | None:
    """The refusal of a request routed native for ``reason`` when no instance of ``model``, whatever
    its state, could ever serve it (on ``kind``'s own route, as the engines' probes found them);
    None when one could (an unavailable one may come back: the native path's 503) or ``reason``
    is not a property of the request (render down, ...)."""
    feature = _FEATURES.get(reason)
    if feature is None:
        return None
    what, param, tokenizer_serves = feature
    if any(i.serves(model) and i.role == "union"
           and (i.serves_native(kind) or (tokenizer_serves and i.tokenizer and i.token_generate))
           for i in snapshot.instances) or has_native_pd(snapshot, model, kind):
        # (A prefill/decode pair serving its own OpenAI API runs the native path too.)
        return None
    unpaired = unpaired_native_pd(snapshot, model, kind)
    if unpaired:
        # Its P and D engines do serve their own OpenAI API; they just cannot serve it as a pair.
        union = "a union engine that loads a tokenizer or serves its own OpenAI API" if tokenizer_serves else (
            "a union engine that serves its own OpenAI API")
        return FeatureUnavailable(
            f"This server cannot serve {what} for model `{model}`: it needs {union}, or a prefill and a decode "
            f"engine that serve their own OpenAI API and pair; this model has no such union engine, and "
            f"{unpaired}, so no prefill/decode pair forms.",
            param=None if reason.startswith("api:") else param or _structured_param(body),
        )
    if reason.startswith("api:"):
        if any(i.model == model and i.native_openai for i in snapshot.instances):
            # Engines with their own API, none of which lists this route (an older vLLM).
            return FeatureUnavailable(
                f"This server cannot serve {what} for model `{model}`: it needs an engine that serves that "
                "route of its own OpenAI API with a tokenizer loaded, and no engine of this model does (their "
                "probed routes lack it); use `/v1/chat/completions` or `/v1/completions`.",
            )
        return FeatureUnavailable(
            f"This server cannot serve {what} for model `{model}`: it needs an engine that serves its own "
            "OpenAI API, and no engine of this model does (they serve token-only generation); use "
            "`/v1/chat/completions` or `/v1/completions`.",
        )
    needs = "an engine that loads a tokenizer or serves its own OpenAI API" if tokenizer_serves else (
        "an engine that serves its own OpenAI API")
    return FeatureUnavailable(
        f"This server cannot serve {what} for model `{model}`: it needs {needs}, and every engine of "
        "this model is tokens-only (vLLM's `--tokens-only` engines refuse it too).",
        param=param or _structured_param(body),
    )


def _structured_param(body: Mapping[str, Any]) -> str:
    """The field that asked for structured output."""
    return "response_format" if body.get("response_format") is not None else "structured_outputs"


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The coordinator's caps on one request, from settings via the composition root."""

    max_choices: int = 128  # n x prompts: each choice is a sequence on an engine and a derender stream
    max_prompts: int = VLLM_MAX_COMPLETION_PROMPTS


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """What the caller's client key may ask for beyond the plain API."""

    allow_priority: bool = False


NO_EXTRAS = KeyPolicy()  # an unauthenticated caller's (open access) and the tests' default


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SchemaError(RequestError):
    """A field of the wrong type: vLLM's request-validation handler answers these (section 4.2)."""

    type = "Bad Request"


# vLLM parses bodies with pydantic in lax mode: "5", 5.0 and true are the integers 5, 5 and 1;
# "0.5" is the number 0.5; "false", "0", "off" and 0 are the boolean false. Its answer to
# anything else is a schema 400 (``"temperature": "hot"``, ``"stream": "maybe"``).
_LAX_INT: TypeAdapter[int] = TypeAdapter(int)
_LAX_FLOAT: TypeAdapter[float] = TypeAdapter(float)
_LAX_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


def _schema_error(name: str, value: Any, exc: ValidationError) -> SchemaError:
    first = exc.errors()[0]
    detail = {"type": first["type"], "loc": f"body.{name}", "msg": first["msg"], "input": str(value)[:100]}
    return SchemaError(f"1 validation error:\n  {detail}", param=f"body.{name}")


def _lax(body: dict[str, Any], name: str, adapter: TypeAdapter[Any], kept: tuple[type, ...]) -> Any:
    """``body[name]`` as vLLM's schema reads it (None when absent or null), written back in that
    type unless it already is one of ``kept``, so every later reader (routing, accounting, the
    local fallback) sees what the engines will; 400 with vLLM's schema error otherwise."""
    value = body.get(name)
    if value is None:
        return None
    try:
        parsed = adapter.validate_python(value)
    except ValidationError as exc:
        raise _schema_error(name, value, exc) from None
    if not isinstance(value, kept) or (isinstance(value, bool) and bool not in kept):
        body[name] = parsed
    return parsed


def _integer(body: dict[str, Any], name: str) -> int | None:
    number: int | None = _lax(body, name, _LAX_INT, (int,))
    return number


# The typed fields each API's schema holds that the coordinator reads on some path (routing,
# accounting, the local tokenizer's GenerateRequest) beyond the output bound and ``n``. A string
# in a boolean field is the trap: Python's truth of "false" is True, vLLM's is False.
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTS = ("top_k", "seed", "min_tokens")
_BOOLS = ("stream", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "return_token_ids")
_TYPED: dict[ApiKind, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {  # floats, ints, bools
    "chat": (_FLOATS, _INTS, _BOOLS),
    "completions": (_FLOATS, _INTS, (*_BOOLS, "echo")),
    "responses": (("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"), ("top_k",),
                  ("stream",)),
    "messages": (("temperature", "top_p"), ("top_k",), ("stream",)),
}


def _check_types(kind: ApiKind, body: dict[str, Any]) -> None:
    floats, ints, bools = _TYPED[kind]
    for name in floats:
        _lax(body, name, _LAX_FLOAT, (int, float))
    for name in ints:
        _integer(body, name)
    for name in bools:
        _lax(body, name, _LAX_BOOL, (bool,))


# vLLM's schema for ``stop``: a string or a list of strings (no lax coercion from numbers).
_STOP: TypeAdapter[str | list[str] | None] = TypeAdapter(str | list[str] | None)


def _typed(body: Mapping[str, Any], name: str, adapter: TypeAdapter[Any]) -> None:
    """400 with vLLM's schema error unless ``body[name]`` is what its schema accepts."""
    try:
        adapter.validate_python(body.get(name))
    except ValidationError as exc:
        raise _schema_error(name, body.get(name), exc) from None


def _dataclass_field(body: Mapping[str, Any], name: str, schema: str) -> None:
    """400 unless ``body[name]`` is an object or null, as vLLM's schema reads it. vLLM 0.32/0.33's
    own before-validators call ``.get`` on ``structured_outputs`` ahead of the schema and answer
    500 for a string; the coordinator gives the schema's verdict instead, before any path."""
    value = body.get(name)
    if value is None or isinstance(value, dict):
        return
    detail = {"type": "dataclass_type", "loc": f"body.{name}",
              "msg": f"Input should be a dictionary or an instance of {schema}", "input": str(value)[:100]}
    raise SchemaError(f"1 validation error:\n  {detail}", param=f"body.{name}")


def _max_output(value: int | None, name: str, max_model_len: int) -> None:
    if value is None:
        return
    if value < 1:
        raise RequestError(f"{name} must be at least 1, got {value}.", param=name)
    if value > max_model_len:
        raise RequestError(
            f"{name}={value} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param=name,
        )


def _sequences(value: int | None, name: str) -> int:
    if value is None:
        return 1
    if value < 1:
        raise RequestError(f"{name} must be at least 1, got {value}.", param=name)
    if value > VLLM_MAX_N_SEQUENCES:
        raise RequestError(f"{name} must be at most {VLLM_MAX_N_SEQUENCES}, got {value}.", param=name)
    return value


def prompt_count(body: Mapping[str, Any]) -> int:
    """How many prompts a completions body holds (vLLM: a flat id list or a string is one)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(_is_int(t) for t in prompt):
        return len(prompt)
    return 1


def check_body(
    kind: ApiKind, body: dict[str, Any], model: ModelView, limits: RequestLimits, policy: KeyPolicy = NO_EXTRAS
) -> None:
    """Refuse a body whose numbers, types or engine controls must not go further (400); return None.

    Every API is checked the same way, whichever path serves it (token-only, the local fallback,
    an engine's own API): values the schema accepts in another spelling ("5", 5.0, "0.5",
    "false") are rewritten in ``body`` as vLLM reads them, so routing and accounting read what
    the engines will; ``n`` x prompts is bounded by ``RequestLimits.max_choices``.
    """
    _check_controls(body, policy)
    _check_types(kind, body)
    n = _sequences(_integer(body, "n"), "n")
    if kind == "messages":
        # Anthropic requires max_tokens and validates it positive (vLLM's AnthropicMessagesRequest).
        value = _integer(body, "max_tokens")
        if value is None:
            raise RequestError("1 validation error:\n  max_tokens: Field required", param="max_tokens")
        _max_output(value, "max_tokens", model.max_model_len)
    elif kind == "responses":
        _max_output(_integer(body, "max_output_tokens"), "max_output_tokens", model.max_model_len)
    else:
        _dataclass_field(body, "structured_outputs", "StructuredOutputsParams")
        _typed(body, "stop", _STOP)  # routing reads it (engine/native.engine_tokenizer_feature)
        max_tokens = _integer(body, "max_tokens")
        completion = _integer(body, "max_completion_tokens") if kind == "chat" else None
        # vLLM bounds the field it uses: max_completion_tokens wins over max_tokens (chat only).
        if completion is not None:
            _max_output(completion, "max_completion_tokens", model.max_model_len)
        elif not (kind == "completions" and max_tokens == 0 and body.get("echo")):  # echo without generation
            _max_output(max_tokens, "max_tokens", model.max_model_len)
        _sequences(_integer(body, "best_of"), "best_of")
    prompts = prompt_count(body) if kind == "completions" else 1
    if prompts > limits.max_prompts:
        raise RequestError(
            f"prompt list length {prompts} exceeds the maximum allowed count of {limits.max_prompts}.",
            param="prompt",
        )
    if n * prompts > limits.max_choices:
        raise RequestError(
            f"n x prompts = {n * prompts} exceeds this server's limit of {limits.max_choices} choices per request.",
            param="n",
        )


def _check_controls(body: dict[str, Any], policy: KeyPolicy) -> None:
    for name in ENGINE_CONTROLS:
        if body.get(name) is not None:
            raise RequestError(f"`{name}` is an engine-internal control and is not accepted by this server.", param=name)
    priority = _integer(body, "priority")
    if priority is not None and priority != 0 and not policy.allow_priority:
        raise RequestError("`priority` is not allowed for this API key.", param="priority")


# --- ids ----------------------------------------------------------------------------------------

# Sampling fields holding token ids (vllm-protocol.md 3.2), each bounded by vLLM's engine the same way.
_ID_LISTS = ("stop_token_ids", "allowed_token_ids", "logprob_token_ids", "trace_decode_token_ids")
# Fields holding lists of id lists: bad words as ids (one list per word), prompt logprob rows.
_ID_ROWS = ("bad_words_token_ids", "prompt_logprob_token_ids")


def _out_of_vocab(ids: Iterable[Any], vocab: int, *, pad: bool = False) -> list[Any]:
    low = -1 if pad else 0
    return [t for t in ids if not _is_int(t) or not low <= t < vocab]


def _refuse(name: str, bad: Sequence[Any], vocab: int) -> RequestError:
    return RequestError(
        f"token_id(s) {list(bad)[:8]} in {name} contain out-of-vocab token ids. Vocabulary size: {vocab}",
        param=name,
    )


def check_sampling_ids(params: Mapping[str, Any], vocab: int) -> None:
    """Every id-valued sampling field within ``range(vocab)``; 400 naming the field otherwise."""
    for name in _ID_LISTS:
        value = params.get(name)
        if value is None:
            continue
        if not isinstance(value, list):
            raise RequestError(f"{name} must be a list of token ids.", param=name)
        bad = _out_of_vocab(value, vocab)
        if bad:
            raise _refuse(name, bad, vocab)
    bias = params.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, Mapping):
            raise RequestError("logit_bias must map token ids to biases.", param="logit_bias")
        keys: list[Any] = []
        for k in bias:
            try:
                keys.append(int(k))
            except (TypeError, ValueError):
                keys.append(k)
        bad = _out_of_vocab(keys, vocab)
        if bad:
            raise _refuse("logit_bias", bad, vocab)
    for name in _ID_ROWS:
        rows = params.get(name)
        if rows is None:
            continue
        if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
            raise RequestError(f"{name} must be a list of id lists.", param=name)
        # -1 pads prompt logprob rows to one width (vLLM scores it -inf); it is not a token.
        bad = [t for r in rows for t in _out_of_vocab(r, vocab, pad=name == "prompt_logprob_token_ids")]
        if bad:
            raise _refuse(name, bad, vocab)


def check_prompt_ids(token_ids: Sequence[Any], vocab: int, *, param: str) -> None:
    bad = _out_of_vocab(token_ids, vocab)
    if bad:
        raise RequestError(f"Token id {bad[0]} is out of vocabulary (vocabulary size {vocab}).", param=param)


def require_vocab(model: ModelView) -> int:
    """The model's vocabulary size; ``VocabularyUnknown`` (503) while the control plane has none."""
    if model.vocab_size is None:
        raise VocabularyUnknown(
            f"The vocabulary size of model `{model.name}` is not known yet (the version probe reads it from the "
            "model files); token ids cannot be checked, so requests are refused until it is.",
        )
    return model.vocab_size


def check_tokenized(prompts: Iterable[Any], *, kind: ApiKind, model: ModelView) -> None:
    """Every prompt of a tokenized request: ids in the vocabulary, sampling ids too, and room left.

    ``prompts`` are ``TokenizedPrompt``s (render's or the local fallback's GenerateRequests): the
    check runs on what will be sent, whatever built it, before admission counts a token of it.
    """
    vocab = require_vocab(model)
    param = "messages" if kind == "chat" else "prompt"
    for prompt in prompts:
        check_prompt_ids(prompt.token_ids, vocab, param=param)
        check_sampling_ids(prompt.sampling_params, vocab)
        if len(prompt.token_ids) >= model.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {model.max_model_len} tokens. However, your request "
                f"has {len(prompt.token_ids)} input tokens.",
                param=param,
            )


def check_body_ids(kind: ApiKind, body: Mapping[str, Any], vocab: int) -> None:
    """The id-valued fields of a client body (used on the native path, where render never ran)."""
    check_sampling_ids(body, vocab)
    if kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            check_prompt_ids(prompt, vocab, param="prompt")
        elif isinstance(prompt, list):
            for p in prompt:
                if isinstance(p, list):
                    check_prompt_ids(p, vocab, param="prompt")


# --- responses ----------------------------------------------------------------------------------


def scrub_response(response: dict[str, Any]) -> dict[str, Any]:
    """Drop engine-internal fields from a JSON answer before the client sees it.

    ``kv_transfer_params`` names the prefill engine's host, port and KV blocks; derender and the
    native API pass it through. It stays in the body as ``null`` (vLLM's shape when unset).
    Streams get the same through ``sse.FieldScrub`` at the edge. Two, not one: a JSON answer has
    these fields at its top level only (vLLM's response schemas), so two look-ups do, where a
    stream's events nest them (a Responses ``response.completed`` event carries the whole
    response) and arrive as bytes cut anywhere. One deep walk for both would walk every JSON
    answer whole (logprobs included): vLLM writes the keys, as null, in every answer.
    """
    for name in RESPONSE_CONTROLS:
        if response.get(name) is not None:
            response[name] = None
    return response
