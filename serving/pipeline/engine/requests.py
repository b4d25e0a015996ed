"""Builds every engine request from render's output, the one place that knows the wire quirks.

An attempt's GenerateRequest (``engine_request``: render's, with ``max_tokens`` resolved or
clamped and the attempt's own id), a relay's (``relay_request``: the replay ids and the budget
left) and a P/D run's two legs (``prefill_request``, ``decode_request``, ids from ``leg_ids``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import msgspec

from serving.pipeline.protocol import GenerateEvent, GenerateResponse

# msgspec's omit_defaults drops a resolved max_tokens of 16 from render's JSON (identity with the
# cached small int), and generate then re-defaults it to the remaining context. After render
# max_tokens is always an int, so a missing key means 16 (vllm-protocol.md section 3.2).
RENDER_OMITTED_MAX_TOKENS = 16
# The prefix an engine puts before the request id in its generate answers and events.
GENERATE_PREFIX = "generate-tokens-"


def resolved_max_tokens(generate_request: Mapping[str, Any]) -> int:
    value = generate_request.get("sampling_params", {}).get("max_tokens")
    return RENDER_OMITTED_MAX_TOKENS if value is None else int(value)


def engine_request(
    generate_request: Mapping[str, Any], *, request_id: str, max_tokens: int | None = None
) -> dict[str, Any]:
    """Return the GenerateRequest to send to an engine: render's, untouched but for ``max_tokens``
    (``max_tokens`` when given, the attempt's clamp; else render's, the omitted 16 resolved) and
    the per-attempt ``request_id``.

    Everything else (token ids, sampling params, parse context, stream options) travels as
    render wrote it: render's ids are the single truth (architecture invariant 1).
    """
    req = copy.copy(dict(generate_request))
    params = dict(req.get("sampling_params") or {})
    params["max_tokens"] = resolved_max_tokens(generate_request) if max_tokens is None else max_tokens
    req["sampling_params"] = params
    req["request_id"] = request_id
    return req


def relay_request(
    base_request: Mapping[str, Any], *, token_ids: list[int], committed: int, max_tokens: int, request_id: str,
    one_choice: bool,
) -> dict[str, Any]:
    """A relay's GenerateRequest: ``base_request`` (render's) continued from ``token_ids`` (the
    prompt and the ``committed`` output ids the client saw), with ``max_tokens`` left; a
    ``min_tokens`` counts what was committed; ``one_choice``: one choice of an n > 1 request,
    continued alone (the engine calls it choice 0)."""
    req = copy.copy(dict(base_request))
    params = dict(req.get("sampling_params") or {})
    params["max_tokens"] = max_tokens
    if params.get("min_tokens"):
        params["min_tokens"] = max(0, int(params["min_tokens"]) - committed)
    if one_choice:
        params["n"] = 1
    req["sampling_params"] = params
    req["token_ids"] = token_ids
    req["request_id"] = request_id
    return req


def prefill_request(
    engine_request: Mapping[str, Any], *, request_id: str, kv_transfer_params: dict[str, Any]
) -> dict[str, Any]:
    """The prefill leg of ``engine_request``: same prompt ids, one token, non-streaming.

    Stream events carry no ``kv_transfer_params``, so no stream and no stream options; vLLM's
    ``SamplingParams`` rejects ``min_tokens > max_tokens``, so both are 1.
    """
    req = copy.copy(dict(engine_request))
    params = dict(req.get("sampling_params") or {})
    params["max_tokens"] = 1
    params["min_tokens"] = 1
    req["sampling_params"] = params
    req["stream"] = False
    req.pop("stream_options", None)
    req["request_id"] = request_id
    req["kv_transfer_params"] = kv_transfer_params
    return req


def decode_request(
    engine_request: Mapping[str, Any], *, request_id: str, kv_transfer_params: dict[str, Any]
) -> dict[str, Any]:
    """The decode leg: ``engine_request`` as the client's budget made it, with the given params
    (in Handoff P's, the very object P returned: never rebuilt, trimmed or extended)."""
    req = copy.copy(dict(engine_request))
    req["request_id"] = request_id
    req["kv_transfer_params"] = kv_transfer_params
    return req


def leg_ids(request_id: str) -> tuple[str, str]:
    """Engine request ids of the prefill and decode legs: distinct, so aborting one never hits the other."""
    return f"{request_id}-prefill", f"{request_id}-decode"


def sorted_choices(generate_response: dict[str, Any]) -> dict[str, Any]:
    """Order choices by index: batch derender numbers choices in list order (protocol 5.2)."""
    out = dict(generate_response)
    out["choices"] = sorted(generate_response.get("choices", []), key=lambda c: c.get("index", 0))
    return out


def attempt_request_id(base: str, attempt: int) -> str:
    """Every attempt has its own engine id, so aborting one can never hit its successor."""
    return base if attempt == 0 else f"{base}-a{attempt}"


def validate_generate_response(response: Any, *, n: int) -> str | None:
    """What is wrong with a GenerateResponse (None when usable): n choices, each with token ids."""
    try:
        choices = msgspec.convert(response, GenerateResponse).choices
    except msgspec.ValidationError as exc:
        return f"not a GenerateResponse ({exc})"
    if len(choices) != n:
        return f"{len(choices)} choices for n={n}"
    return None


def validate_generate_event(event: Any) -> str | None:
    """What is wrong with one streaming generate event (None when usable)."""
    try:
        msgspec.convert(event, GenerateEvent)
    except msgspec.ValidationError as exc:
        return f"not a generate event ({exc})"
    return None
