"""The chat request another API's answers are derendered as: what Messages and Responses share.

Render turns a Messages or Responses body into one GenerateRequest; the chat token path and the
sidecar's chat derender then read a chat request. Its common part comes from render's resolved
sampling parameters; each API adds its own tools and parse options.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The chat derender validates the chat request it is sent (one message at least); the prompt
# reaches it as ids, never as messages.
STUB_MESSAGES = [{"role": "user", "content": ""}]
# Decoding options render resolved that the chat derender reads (sampling_params omits defaults).
DECODING = ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output")


def base_chat_view(body: Mapping[str, Any], params: Mapping[str, Any], max_tokens: Any) -> dict[str, Any]:
    """The chat request for ``body`` with render's ``params``: model, a stub message, the output
    bound, streaming, stops and the decoding options render resolved."""
    view: dict[str, Any] = {
        "model": body.get("model"),
        "messages": STUB_MESSAGES,
        "max_tokens": max_tokens,
        "stream": bool(body.get("stream")),
    }
    if params.get("stop"):
        view["stop"] = list(params["stop"])
    if params.get("stop_token_ids"):
        view["stop_token_ids"] = list(params["stop_token_ids"])
    for name in DECODING:
        if name in params:
            view[name] = params[name]
    return view
