"""The Responses API's event protocol over the chat token path's stream.

``ResponsesStream`` wraps the chat ``EventStream`` (``apis/converted_stream.py``) (derender per chunk, committed
``stream_state``, relay after an engine failure, cancellation on disconnect: all the chat
stream's) and turns its chat chunks into the events vLLM's server sends for a simple (not
Harmony) model (``responses/serving.py``, ``responses_stream_generator``, and
``streaming_events.py``): ``response.created``, ``response.in_progress``; per item
``response.output_item.added``, for text and reasoning a ``content_part.added``, the deltas
(``output_text``, ``reasoning_text``, ``function_call_arguments``), their ``.done``,
``content_part.done``, ``output_item.done``; ``response.completed`` (also when the output bound cut it:
its status says so) with the whole response and usage. ``sequence_number`` counts every
event from 0. An error after the first event ends the stream with an ``error`` event.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from serving.pipeline.apis.converted_stream import ConvertedStream
from serving.pipeline.apis.responses import (
    envelope,
    finished,
    function_call_item,
    message_item,
    output_text,
    reasoning_item,
    reasoning_tokens,
    usage,
)
from serving.pipeline.json_codec import dumps


@dataclass
class ResponsesEvents:
    """Chat chunks in, Responses events out, for one response."""

    body: Mapping[str, Any]
    generate_request: Mapping[str, Any]
    public_id: str
    seq: int = 0
    response: dict[str, Any] = field(default_factory=dict)
    kind: str | None = None  # the open item's: "message", "reasoning", "function_call"
    item_id: str = ""
    text: list[str] = field(default_factory=list)
    call: dict[str, Any] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)
    finish: str | None = None
    started: bool = False
    done: bool = False

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        payload = {"type": kind, **data, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + dumps(payload) + b"\n\n"

    def start(self, model: Any) -> list[bytes]:
        self.started = True
        self.response = envelope(self.body, self.generate_request, self.public_id, model, int(time.time()))
        snapshot = dict(self.response)
        return [self._event("response.created", {"response": snapshot}),
                self._event("response.in_progress", {"response": snapshot})]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.items)}

    def _add_item(self, kind: str, call: Mapping[str, Any] | None = None) -> list[bytes]:
        self.kind, self.text = kind, []
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        self.item_id = f"{prefix}_{uuid.uuid4().hex}"
        index = len(self.items)
        if kind == "function_call":
            function = (call or {}).get("function") or {}
            self.call = {"call_id": (call or {}).get("id"), "name": function.get("name")}
            item = function_call_item(self.item_id, self.call["call_id"], self.call["name"], "", "in_progress")
            return [self._event("response.output_item.added", {"output_index": index, "item": item})]
        if kind == "message":
            item, part = message_item(self.item_id, None, "in_progress"), {**output_text(""), "logprobs": []}
        else:
            item = {"id": self.item_id, "summary": [], "type": "reasoning", "content": None,
                    "encrypted_content": None, "status": "in_progress"}
            part = {"text": "", "type": "reasoning_text"}
        return [self._event("response.output_item.added", {"output_index": index, "item": item}),
                self._event("response.content_part.added", {**self._where(), "content_index": 0, "part": part})]

    def _finish_item(self) -> list[bytes]:
        if self.kind is None:
            return []
        text, kind = "".join(self.text), self.kind
        status = "incomplete" if self.finish == "length" else "completed"  # only the last item is cut
        out: list[bytes] = []
        if kind == "function_call":
            out.append(self._event("response.function_call_arguments.done",
                                   {**self._where(), "arguments": text, "name": self.call["name"]}))
            item = function_call_item(self.item_id, self.call["call_id"], self.call["name"], text, status)
        elif kind == "message":
            part = output_text(text)
            out.append(self._event("response.output_text.done",
                                   {**self._where(), "content_index": 0, "text": text, "logprobs": []}))
            out.append(self._event("response.content_part.done", {**self._where(), "content_index": 0, "part": part}))
            item = message_item(self.item_id, text, status)
        else:
            part = {"text": text, "type": "reasoning_text"}
            out.append(self._event("response.reasoning_text.done",
                                   {**self._where(), "content_index": 0, "text": text}))
            out.append(self._event("response.content_part.done", {**self._where(), "content_index": 0, "part": part}))
            item = {**reasoning_item(self.item_id, text), "status": status}
        out.append(self._event("response.output_item.done", {"output_index": len(self.items), "item": item}))
        self.items.append(item)
        self.kind = None
        return out

    def _delta(self, kind: str, text: str) -> list[bytes]:
        out = [] if self.kind == kind else self._finish_item() + self._add_item(kind)
        self.text.append(text)
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        return out + [self._event(name, {**self._where(), "content_index": 0, "delta": text, **extra})]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        if "error" in chunk:
            return self.error(chunk["error"])
        out = [] if self.started else self.start(chunk.get("model"))
        choices = chunk.get("choices") or []
        if not choices:
            if chunk.get("usage") is not None:
                out += self._finish(chunk["usage"])
            return out
        choice = choices[0]
        delta = choice.get("delta") or {}
        if delta.get("reasoning") and self.body.get("include_reasoning") is not False:
            out += self._delta("reasoning", delta["reasoning"])
        if delta.get("content"):
            out += self._delta("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id") is not None and function.get("name") is not None:
                out += self._finish_item() + self._add_item("function_call", call)
            if function.get("arguments") and self.kind == "function_call":
                self.text.append(function["arguments"])
                out.append(self._event("response.function_call_arguments.delta",
                                       {**self._where(), "delta": function["arguments"]}))
        if choice.get("finish_reason") is not None:  # after this chunk's deltas: it decides the last item
            self.finish = choice["finish_reason"]
        return out

    def _finish(self, chat_usage: Mapping[str, Any]) -> list[bytes]:
        out = self._finish_item()
        # The items as streamed are the answer's output, as in vLLM (``streamed_output_items``).
        response = finished({**self.response, "output": self.items,
                             "usage": usage(chat_usage, reasoning_tokens(self.items, chat_usage))}, self.finish)
        self.done = True
        # An answer the output bound cut ends with ``response.completed`` too (its status says
        # ``incomplete``), as the vLLM engines here send it: the openai SDK's stream helper
        # fails without that event (vLLM 0.33 sends ``response.incomplete``).
        return out + [self._event("response.completed", {"response": response})]

    def end(self) -> list[bytes]:
        if self.done:
            return []
        return ([] if self.started else self.start(self.body.get("model"))) + self._finish({})

    def error(self, err: Any) -> list[bytes]:
        status = err.get("code") if isinstance(err, dict) else None
        message = err.get("message") if isinstance(err, dict) else err
        self.done = True
        return [self._event("error", {"code": str(status or 500), "message": str(message or ""), "param": None})]


class ResponsesStream(ConvertedStream):
    """A chat ``EventStream`` sent as Responses events; the stream itself stays the chat one's."""

    events: ResponsesEvents
