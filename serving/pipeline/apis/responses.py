"""The Responses API on the chat token path: what goes in, what comes out.

Render's ``/v1/responses/render`` makes the prompt ids (vLLM's own Responses-to-chat
conversion: instructions, input items, function calls and their outputs, tools in the chat
template), so the ids equal what vLLM's ``/v1/responses`` would run. No derender exists for the
Responses API and render returns no ``parse_context``: the chat derender reads a chat request
built here (``chat_view``) with the body's function tools and tool choice in the chat shape
(vLLM's ``construct_tool_dicts`` does the same conversion before its parser runs), the reasoning
switches, and the decoding options render resolved. ``to_response`` gives the chat answer the
shape vLLM's server gives (``responses/serving.py``, ``build_response_output_items`` and
``ResponsesResponse.from_request``): items ``reasoning``, ``message`` (one ``output_text``),
``function_call`` in that order; status ``incomplete`` with reason ``max_output_tokens`` when the
output bound cut it; usage from the coordinator's count.

What render refuses or only a stateful server can do keeps the native path
(``native_responses_reason``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from serving.pipeline.apis.chat_view import base_chat_view


def native_responses_reason(body: Mapping[str, Any]) -> str | None:
    """Why a Responses ``body`` needs an engine's own ``/v1/responses``, or None.

    ``previous_response_id`` and ``background`` need the response store of the server that
    answered before (render refuses the first: "not supported by the stateless render
    endpoint"); a tool other than a function needs vLLM's built-in tool servers; a tool choice
    other than a mode or a named function has no chat equivalent for the derender's parsers.
    """
    if body.get("previous_response_id") is not None:
        return "api:responses:previous_response_id"
    if body.get("background"):
        return "api:responses:background"
    if body.get("conversation") is not None or body.get("prompt") is not None:
        return "api:responses:stored_state"
    for tool in body.get("tools") or ():
        if not isinstance(tool, dict) or tool.get("type") != "function":
            return "api:responses:builtin_tools"
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") != "function":
        return "api:responses:tool_choice"
    return None


def responses_tokenizer_feature(body: Mapping[str, Any]) -> str | None:
    """What a ``--tokens-only`` engine cannot run, in the Responses body's own fields."""
    stop = body.get("stop")
    if stop and (isinstance(stop, str) or any(isinstance(s, str) and s for s in stop)):
        return "stop_strings"
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict) and text["format"].get("type") != "text":
        return "structured_output"
    if body.get("structured_outputs"):
        return "structured_output"
    choice = body.get("tool_choice")
    if body.get("tools") and (choice == "required" or isinstance(choice, dict)):
        return "forced_tool_choice"
    return None


def chat_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool (nested under ``function``)."""
    function = {"name": tool.get("name"), "parameters": tool.get("parameters")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_view(body: Mapping[str, Any], generate_request: Mapping[str, Any]) -> dict[str, Any]:
    """The chat request the chat token path and the chat derender read for a Responses ``body``
    that render turned into ``generate_request``."""
    params = generate_request.get("sampling_params") or {}
    view = base_chat_view(body, params, params.get("max_tokens", body.get("max_output_tokens")))
    choice = body.get("tool_choice", "auto")
    tools = body.get("tools") or []
    if tools and choice != "none":  # vLLM leaves the tools out with tool_choice none
        view["tools"] = [chat_tool(t) for t in tools]
        view["tool_choice"] = chat_tool_choice(choice)
    if body.get("parallel_tool_calls") is not None:
        view["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("include_reasoning") is not None:
        view["include_reasoning"] = body["include_reasoning"]
    kwargs = (generate_request.get("reasoning_parser_kwargs") or {}).get("chat_template_kwargs")
    if kwargs or body.get("chat_template_kwargs"):
        view["chat_template_kwargs"] = kwargs or body.get("chat_template_kwargs")
    if body.get("stream"):
        view["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    return view


def tool_choice(body: Mapping[str, Any]) -> Any:
    """The tool choice vLLM's request validator leaves: ``auto`` without tools is ``none``."""
    choice = body.get("tool_choice", "auto")
    return "none" if not body.get("tools") and choice == "auto" else choice


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(message: Mapping[str, Any], finish_reason: str | None) -> list[dict[str, Any]]:
    """vLLM's ``build_response_output_items`` over a chat message: only the last item can have
    been cut short."""
    calls = message.get("tool_calls") or []
    last = _item_status(finish_reason)
    items: list[dict[str, Any]] = []
    if message.get("reasoning"):
        items.append(reasoning_item(f"rs_{uuid.uuid4().hex}", message["reasoning"]))
    if message.get("content"):
        items.append(message_item(f"msg_{uuid.uuid4().hex}", message["content"], "completed" if calls else last))
    for n, call in enumerate(calls):
        function = call.get("function") or {}
        items.append(function_call_item(f"fc_{uuid.uuid4().hex}", call.get("id"), function.get("name"),
                                        function.get("arguments") or "", last if n == len(calls) - 1 else "completed"))
    return items


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "summary": [], "type": "reasoning",
            "content": [{"text": text, "type": "reasoning_text"}], "encrypted_content": None, "status": None}


def output_text(text: str) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"id": item_id, "content": [output_text(text)] if text is not None else [], "role": "assistant",
            "status": status, "type": "message"}


def function_call_item(item_id: str, call_id: str | None, name: str | None, arguments: str, status: str
                       ) -> dict[str, Any]:
    return {"arguments": arguments, "call_id": call_id, "name": name, "type": "function_call", "id": item_id,
            "namespace": None, "status": status}


def usage(chat_usage: Mapping[str, Any] | None, reasoning_tokens: int = 0) -> dict[str, Any]:
    """Responses usage from the coordinator's chat usage. vLLM counts reasoning tokens with its
    response parser over the output ids; no derender returns that count, so it is the
    coordinator's (0 unless the caller counted)."""
    chat_usage = chat_usage or {}
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0, "input_tokens_per_turn": [],
                                     "cached_tokens_per_turn": []},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens, "tool_output_tokens": 0,
                                      "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
            "total_tokens": prompt + completion}


def envelope(body: Mapping[str, Any], generate_request: Mapping[str, Any], public_id: str, model: Any,
             created: int) -> dict[str, Any]:
    """The response object's fields that come from the request (``ResponsesResponse.from_request``),
    with status, output and usage still to set."""
    params = generate_request.get("sampling_params") or {}
    return {
        "id": public_id, "created_at": created, "incomplete_details": None,
        "instructions": body.get("instructions"), "metadata": body.get("metadata"), "model": model,
        "object": "response", "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": params.get("temperature", 1.0), "tool_choice": tool_choice(body),
        "tools": body.get("tools") or [], "top_p": params.get("top_p", 1.0),
        "background": bool(body.get("background", False)),
        # sampling_params leaves out a value equal to vLLM's default (16 for max_tokens).
        "max_output_tokens": params.get("max_tokens", 16),
        "max_tool_calls": body.get("max_tool_calls"), "previous_response_id": None, "prompt": None,
        "reasoning": body.get("reasoning"), "service_tier": body.get("service_tier", "auto"),
        "status": "in_progress", "text": body.get("text"), "top_logprobs": params.get("logprobs"),
        "truncation": body.get("truncation", "disabled"), "usage": None, "user": body.get("user"),
        "presence_penalty": params.get("presence_penalty", 0.0),
        "frequency_penalty": params.get("frequency_penalty", 0.0),
        "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None, "output_messages": None,
    }


def finished(out: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    if finish_reason == "length":
        out["status"] = "incomplete"
        out["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        out["status"] = "completed"
    return out


def to_response(chat: Mapping[str, Any], body: Mapping[str, Any], generate_request: Mapping[str, Any],
                public_id: str) -> dict[str, Any]:
    """A chat completion (the chat derender's) as a Responses answer."""
    choice = (chat.get("choices") or [{}])[0]
    finish = choice.get("finish_reason")
    message = dict(choice.get("message") or {})
    if body.get("include_reasoning") is False:
        message["reasoning"] = None
    out = envelope(body, generate_request, public_id, chat.get("model"), int(chat.get("created") or time.time()))
    out["output"] = output_items(message, finish)
    out["usage"] = usage(chat.get("usage"), reasoning_tokens(out["output"], chat.get("usage")))
    return finished(out, finish)


def reasoning_tokens(items: list[dict[str, Any]], chat_usage: Mapping[str, Any] | None) -> int:
    """vLLM's parser counts the output ids inside the reasoning span; no derender returns that
    count. An output that is reasoning alone is all reasoning tokens; one that mixes reasoning
    with text or calls has no exact count here, and reports 0 (docs/messages-responses.md)."""
    kinds = {item["type"] for item in items}
    if kinds == {"reasoning"}:
        return int((chat_usage or {}).get("completion_tokens") or 0)
    return 0
