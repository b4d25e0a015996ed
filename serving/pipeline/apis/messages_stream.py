"""Anthropic's event protocol over the chat token path's stream.

``MessagesStream`` wraps the chat ``EventStream`` (``apis/converted_stream.py``) (derender per chunk, committed ``stream_state``,
relay after an engine failure, cancellation on disconnect: all the chat stream's) and turns its
chat chunks into Anthropic events as vLLM's server does (``message_stream_converter``):
``message_start``; per block ``content_block_start``, its deltas (``thinking_delta`` then a
``signature_delta`` at its end, ``text_delta``, ``input_json_delta``), ``content_block_stop``;
``message_delta`` with the stop reason and usage from the usage chunk; ``message_stop``. Text
that arrives while a tool call's block is open is held and sent as a text block of its own once
that block closes. An error after the first event closes the open block and ends the stream
with an ``error`` event, without ``message_stop``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from serving.pipeline.apis.converted_stream import ConvertedStream
from serving.pipeline.apis.messages import error_type, stop_reason, usage
from serving.pipeline.json_codec import dumps


def event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + dumps(data) + b"\n\n"


@dataclass
class MessagesEvents:
    """Chat chunks in, Anthropic events out, for one message."""

    public_id: str
    model: str
    prompt_tokens: int
    index: int = 0  # the next block's index
    block: str | None = None  # the open block's type
    signature: str | None = None  # the open thinking block's, sent when it closes
    tool_id: str | None = None
    held_text: list[str] = field(default_factory=list)
    started: bool = False
    finish: str | None = None
    stop: int | str | None = None
    tool_used: bool = False
    tool_args: list[str] = field(default_factory=list)  # the latest tool call's
    tool_ids: dict[int, str] = field(default_factory=dict)

    def start(self) -> list[bytes]:
        self.started = True
        return [event("message_start", {"type": "message_start", "message": {
            "id": self.public_id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }})]

    def _start_block(self, block: dict[str, Any]) -> bytes:
        self.block = block["type"]
        self.signature = uuid.uuid4().hex if block["type"] == "thinking" else None
        self.tool_id = block.get("id") if block["type"] == "tool_use" else None
        return event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def _stop_block(self) -> list[bytes]:
        if self.block is None:
            return []
        out = []
        if self.signature is not None:
            out.append(self._delta({"type": "signature_delta", "signature": self.signature}))
        out.append(event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.block = self.signature = self.tool_id = None
        self.index += 1
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _close_and_flush(self) -> list[bytes]:
        held, self.held_text = "".join(self.held_text), []
        out = self._stop_block()
        if held:
            out += [self._start_block({"type": "text", "text": ""}), self._delta({"type": "text_delta", "text": held})]
            out += self._stop_block()
        return out

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events of one chat chunk (the first chunk's come after ``message_start``)."""
        if "error" in chunk:
            return self.error(chunk["error"])
        out = [] if self.started else self.start()
        choices = chunk.get("choices") or []
        if not choices:
            if chunk.get("usage") is None:
                return out
            out += self._close_and_flush()
            complete = self.tool_used and _is_json("".join(self.tool_args))
            reason, sequence = stop_reason(self.finish or "stop", self.stop, tool_used=self.tool_used,
                                           tool_complete=complete)
            out.append(event("message_delta", {"type": "message_delta",
                                               "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                               "usage": usage(chunk["usage"])}))
            return out
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish, self.stop = choice["finish_reason"], choice.get("stop_reason")
        delta = choice.get("delta") or {}
        if delta.get("reasoning"):
            if self.block != "thinking":
                out += self._close_and_flush()
                out.append(self._start_block({"type": "thinking", "thinking": ""}))
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
        if delta.get("content"):
            if self.block == "tool_use":
                self.held_text.append(delta["content"])
            else:
                if self.block != "text":
                    out += self._close_and_flush()
                    out.append(self._start_block({"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            out += self._tool_call(call)
        return out

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        out = []
        function = call.get("function") or {}
        call_id = call.get("id")
        if call_id is not None:
            self.tool_ids[call.get("index", 0)] = call_id
            if self.tool_id != call_id and function.get("name") is not None:
                out += self._close_and_flush()
                self.tool_used = True
                self.tool_args = []
                out.append(self._start_block({"type": "tool_use", "id": call_id, "name": function["name"], "input": {}}))
        else:
            call_id = self.tool_ids.get(call.get("index", 0))
        if call_id is not None and function.get("arguments") and self.tool_id == call_id:
            self.tool_args.append(function["arguments"])
            out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return out

    def end(self) -> list[bytes]:
        out = ([] if self.started else self.start()) + self._close_and_flush()
        return out + [event("message_stop", {"type": "message_stop"})]

    def error(self, err: Any) -> list[bytes]:
        status = err.get("code") if isinstance(err, dict) else None
        message = err.get("message") if isinstance(err, dict) else err
        out = self._stop_block()
        out.append(event("error", {"type": "error", "error": {
            "type": error_type(status if isinstance(status, int) else 500), "message": str(message or "")}}))
        return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class MessagesStream(ConvertedStream):
    """A chat ``EventStream`` sent as Anthropic events; the stream itself stays the chat one's."""

    events: MessagesEvents
