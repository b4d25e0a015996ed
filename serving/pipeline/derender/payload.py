"""What one streaming derender call carries: the whole request until the sidecar shows its path.

vLLM's streaming derender (``OnlineDerenderer.derender_chat_stream``) has two paths. The plain
path (no tool or reasoning parser on the sidecar; every completions stream) seeds its
detokenizer window from the prompt's tail on a choice's first call and carries it in
``stream_state`` from then on: later calls read neither ``prompt_token_ids`` nor the messages,
only the request's decoding options (stop ids, special tokens, logprobs, ``return_token_ids``).
The parser path replays every output token through a fresh parser on each call and needs the
full prompt and the whole ``chat_request`` every time; its state carries that replay buffer
(``output_token_ids``).

So a session sends the whole request until a call that derendered tokens returns a state
without a replay buffer, which proves the plain path; after that it sends ``slim_request`` and
no prompt ids. That makes each call O(chunk) instead of O(prompt + conversation).
"""

from __future__ import annotations

from typing import Any

from serving.pipeline.protocol import TokenKind

# The parser path's replay buffer in ``DerenderStreamState``; empty on the plain path.
REPLAY_BUFFER = "output_token_ids"

# What stands in for the prompt: derender validates the request it is sent (a chat request
# needs a message, a completion request a non-empty prompt) but the plain path reads neither.
_STUB_MESSAGES = [{"role": "user", "content": ""}]
_STUB_PROMPT = "-"


def slim_request(kind: TokenKind, body: dict[str, Any]) -> dict[str, Any] | None:
    """``body`` without its prompt, for plain-path calls; None when it must go whole.

    ``echo`` (completions) puts the prompt's text into the output, so that body is never slimmed.
    """
    if kind == "chat":
        return {**body, "messages": _STUB_MESSAGES}
    if body.get("echo"):
        return None
    return {**body, "prompt": _STUB_PROMPT}


def proves_plain_path(token_ids: tuple[int, ...], next_state: dict[str, Any] | None) -> bool:
    """Whether a call that derendered ``token_ids`` and returned ``next_state`` ran the plain path."""
    return bool(token_ids) and isinstance(next_state, dict) and not next_state.get(REPLAY_BUFFER)
