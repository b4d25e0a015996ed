"""Builds every engine request from render's output, the one place that knows the wire quirks."""

from __future__ import annotations

import copy
from typing import Any

# msgspec's omit_defaults drops a resolved max_tokens of 16 from render's JSON (identity with the
# cached small int), and generate then re-defaults it to the remaining context. After render
# max_tokens is always an int, so a missing key means 16 (vllm-protocol.md section 3.2).
RENDER_OMITTED_MAX_TOKENS = 16
# The prefix an engine puts before the request id in its generate answers and events.
GENERATE_PREFIX = "generate-tokens-"


def resolved_max_tokens(generate_request: dict[str, Any]) -> int:
    value = generate_request.get("sampling_params", {}).get("max_tokens")
    return RENDER_OMITTED_MAX_TOKENS if value is None else int(value)


def engine_request(generate_request: dict[str, Any], *, request_id: str) -> dict[str, Any]:
    """Return the GenerateRequest to send to an engine: render's, untouched but for
    the omitted ``max_tokens`` and the per-attempt ``request_id``.

    Everything else (token ids, sampling params, parse context, stream options) travels as
    render wrote it: render's ids are the single truth (architecture invariant 1).
    """
    req = copy.copy(generate_request)
    params = dict(req.get("sampling_params") or {})
    params["max_tokens"] = resolved_max_tokens(generate_request)
    req["sampling_params"] = params
    req["request_id"] = request_id
    return req


def sorted_choices(generate_response: dict[str, Any]) -> dict[str, Any]:
    """Order choices by index: batch derender numbers choices in list order (protocol 5.2)."""
    out = dict(generate_response)
    out["choices"] = sorted(generate_response.get("choices", []), key=lambda c: c.get("index", 0))
    return out


def attempt_request_id(base: str, attempt: int) -> str:
    """Every attempt has its own engine id, so aborting one can never hit its successor."""
    return base if attempt == 0 else f"{base}-a{attempt}"


def with_max_tokens(generate_request: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """``generate_request`` with ``sampling_params.max_tokens`` set (the context-budget clamp)."""
    req = dict(generate_request)
    req["sampling_params"] = {**(req.get("sampling_params") or {}), "max_tokens": max_tokens}
    return req


def validate_generate_response(response: Any, *, n: int) -> str | None:
    """What is wrong with a GenerateResponse (None when usable): every choice has token ids."""
    if not isinstance(response, dict) or not isinstance(response.get("choices"), list):
        return "not a GenerateResponse"
    choices = response["choices"]
    if len(choices) != n:
        return f"{len(choices)} choices for n={n}"
    for c in choices:
        ids = c.get("token_ids") if isinstance(c, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            return "a choice without token ids"
    return None
