"""The Anthropic Messages API on the chat token path: what goes in, what comes out.

Render's ``/v1/messages/render`` makes the prompt ids (vLLM's own Messages-to-chat conversion,
so the ids equal what vLLM's ``/v1/messages`` would run). No derender exists for Messages: the
chat derender turns the engine's ids back into a chat answer, given the chat request it reads
(``chat_view``: the parse context render returned, so the sidecar's tool and reasoning parsers
run, and the decoding options render resolved), and ``to_message`` gives that answer the
Messages shape vLLM's server gives (``vllm/entrypoints/anthropic/serving.py``,
``messages_full_converter``): blocks ``thinking``, ``text``, ``tool_use`` in that order, one
empty text block for an empty answer, ``stop_reason`` and ``stop_sequence``, and usage as
input and output tokens. None-valued fields are left out, as vLLM serializes the answer.

Every error on ``/v1/messages`` leaves in Anthropic's shape (``anthropic_error``), with the
status kept and the ``error.type`` vLLM's ``translate_error_type`` gives that status.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from serving.pipeline.apis.chat_view import base_chat_view
from serving.pipeline.errors import DerenderError

# Parse-context fields the chat request carries to the sidecar's parsers.
_PARSING = ("parallel_tool_calls", "include_reasoning", "chat_template_kwargs")

# vLLM's ``_ANTHROPIC_ERROR_TYPE_BY_STATUS`` (its Messages router translates every error by status).
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(status: int, body: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI error body in Anthropic's shape; one already in it (an engine's own
    ``/v1/messages`` answer on the native path) passes as it is."""
    if body.get("type") == "error" and isinstance(body.get("error"), dict):
        return dict(body)
    err = body.get("error")
    message = err.get("message") if isinstance(err, dict) else err
    return {"type": "error", "error": {"type": error_type(status), "message": str(message or "")}}


def chat_view(body: Mapping[str, Any], generate_request: Mapping[str, Any]) -> dict[str, Any]:
    """The chat request the chat token path and the chat derender read for a Messages ``body``
    that render turned into ``generate_request``."""
    context = generate_request.get("parse_context") or {}
    params = generate_request.get("sampling_params") or {}
    view = base_chat_view(body, params, body.get("max_tokens"))
    tools = context.get("tools")
    if tools:  # vLLM's converter may set ``tools: []``, which the chat schema refuses
        view["tools"] = tools
        view["tool_choice"] = context.get("tool_choice")
    for name in _PARSING:
        if context.get(name) is not None:
            view[name] = context[name]
    if body.get("stream"):
        view["stream_options"] = {"include_usage": True}  # message_delta carries the usage
    return view


def stop_reason(
    finish_reason: str | None, stop: int | str | None, *, tool_used: bool, tool_complete: bool
) -> tuple[str | None, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for a chat finish, as vLLM maps it:
    ``max_tokens`` first; a complete tool call over a matched stop string; a matched stop string
    (a str ``stop_reason``; an int is a stop token) over an unfinished tool call."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def usage(chat_usage: Mapping[str, Any] | None) -> dict[str, int]:
    """Anthropic usage from the coordinator's chat usage: input excludes cached tokens when
    the details say how many (never here today: derender reports none)."""
    if not chat_usage:
        return {"input_tokens": 0, "output_tokens": 0}
    out: dict[str, int] = {"output_tokens": int(chat_usage.get("completion_tokens") or 0)}
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    details = chat_usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    if cached is not None:
        prompt -= int(cached)
        out["cache_read_input_tokens"] = int(cached)
    return {"input_tokens": max(0, prompt), **out}


def _tool_input(arguments: str | None) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        # vLLM's server fails the request here too (its converter decodes every call).
        raise DerenderError(f"a parsed tool call's arguments are not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise DerenderError("a parsed tool call's arguments are not a JSON object")
    return value


def to_message(chat: Mapping[str, Any], public_id: str) -> dict[str, Any]:
    """A chat completion (the chat derender's) as an Anthropic Messages answer."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": uuid.uuid4().hex})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in calls:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                        "input": _tool_input(function.get("arguments"))})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"),
                                   tool_used=bool(calls), tool_complete=bool(calls))
    out: dict[str, Any] = {
        "id": public_id, "type": "message", "role": "assistant",
        "content": content or [{"type": "text", "text": ""}], "model": chat.get("model"),
    }
    if reason is not None:
        out["stop_reason"] = reason
    if sequence is not None:
        out["stop_sequence"] = sequence
    out["usage"] = usage(chat.get("usage"))
    return out
