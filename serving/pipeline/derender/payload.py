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

On the plain path most calls read nothing of the request at all: it only decides how special
tokens are decoded, whether token ids are returned, the ``top_logprobs`` cut (when the event has
logprobs) and which stop token to drop (when the event finishes its choice). With those options
at derender's own defaults (what it assumes when no request is sent), a call whose event neither
finishes nor carries logprobs goes without one (``request_unread``, ``reads_request``): the
sidecar then skips validating a ``ChatCompletionRequest`` per token, 13-22 % of its CPU per
spaced call (``bench/derender_cost.py``).

Between two calls the sidecar's ``stream_state`` is kept as the JSON it goes back as
(``packed_state``: ``bytes``), not as the parsed dict: a detokenizer window of a few dozen ids and
offsets weighs about 1.7 KiB parsed and a third of that as JSON, kept per choice for the whole
stream (``bench/slow_reader.py``). It is serialized once either way: on arrival instead of in the
next call's body, which ``json_codec.dumps`` writes it into as it is.
"""

from __future__ import annotations

from typing import Any

from serving.pipeline.json_codec import dumps, loads
from serving.pipeline.protocol import TokenKind

# What a streaming derender call is given back of the previous one's: the sidecar's state as its
# JSON (``packed_state``), the coordinator's own derender's as the dict it made, None at first.
StreamState = dict[str, Any] | bytes | None

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


def request_unread(kind: TokenKind, body: dict[str, Any]) -> bool:
    """Whether ``body``'s options that a plain-path call reads are all at derender's defaults.

    Those are ``skip_special_tokens`` and ``spaces_between_special_tokens`` (both true unless the
    request says otherwise) and ``return_token_ids``. A request for logprobs (a completion's
    ``logprobs: 0`` included) or an echoed completion keeps its request on every call.
    """
    if kind == "completions" and body.get("echo"):
        return False
    logprobs = body.get("logprobs")
    return (
        body.get("skip_special_tokens", True) is True
        and body.get("spaces_between_special_tokens", True) is True
        and not body.get("return_token_ids")
        and (logprobs is None or logprobs is False)  # not `in (None, False)`: 0 == False, and 0 asks
    )


def reads_request(event: dict[str, Any]) -> bool:
    """Whether the plain path reads the request to derender ``event``: its choice finishes (the
    stop token to drop: ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``) or has
    logprobs (the request's ``top_logprobs`` cut), or it is not a one-choice token event."""
    choices = event.get("choices") or []
    if len(choices) != 1:
        return True
    choice = choices[0]
    return choice.get("finish_reason") is not None or choice.get("logprobs") is not None


def packed_state(state: StreamState) -> StreamState:
    """``state`` as the JSON the next call's body carries, ready to go in whole."""
    if not isinstance(state, dict):
        return state
    # Copied out: the bytes orjson returns keep its whole output buffer (8 KiB for a few hundred
    # bytes of JSON, in the heap and in RSS alike), fine for a body written at once, not for
    # what a stream keeps.
    return bytes(memoryview(dumps(state)))


def unpacked_state(state: StreamState) -> dict[str, Any] | None:
    """``state`` parsed (for a derender that reads it, or a caller that packed it earlier)."""
    if isinstance(state, bytes):
        parsed: dict[str, Any] = loads(state)
        return parsed
    return state


def proves_plain_path(token_ids: tuple[int, ...], next_state: StreamState) -> bool:
    """Whether a call that derendered ``token_ids`` and returned ``next_state`` ran the plain path."""
    return bool(token_ids) and isinstance(next_state, dict) and not next_state.get(REPLAY_BUFFER)
