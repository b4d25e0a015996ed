"""vLLM's own OpenAI API on the simulator, as a tokenizer-loaded engine serves it (``vllm serve``
without ``--tokens-only``): ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` and
``/v1/messages``, JSON or SSE.

Each body becomes one GenerateRequest and runs through the generate route's own code
(``GenerateHandlers.serve``): the same deterministic output, faults, prefix cache and P/D KV
transfer. So the vllm-ascend guide's proxy flow works here as on a real engine: a body with
``kv_transfer_params: {"do_remote_decode": true}`` and one output token on a prefill instance
answers with the params D needs (top-level ``kv_transfer_params`` of the JSON answer, as vLLM's
four response schemas carry it), and D, given them verbatim, pulls the KV and decodes.

Text goes through a toy byte tokenizer (one id per UTF-8 byte, ``encode``; generated ids print
as `` t<id>``, ``decode``) with a toy chat template, so the same body always makes the same
prompt ids on every instance, and a P/D answer can be compared with a union one. A completion
of several prompts runs them one after another and answers as vLLM's server does (``_several``):
choice ``index`` prompt-major (``prompt * n + choice``), one usage summed over the prompts, one
``[DONE]``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from enginesim.bodies import json_body
from enginesim.errors import bad_request, from_validation_error
from enginesim.generate import GenerateHandlers
from enginesim.protocol import GenerateRequest
from enginesim.streaming import DONE_EVENT, SSEResponse, sse_event

# Ids below this are special in the tests' configurations; bytes map above them.
BYTE_BASE = 4
# What vLLM's renderer raises (a 400) when text needs the tokenizer a --tokens-only engine lacks.
NO_TOKENIZER = "Tokenizer not available when `skip_tokenizer_init=True`"


def encode(text: str) -> list[int]:
    return [BYTE_BASE + b for b in text.encode("utf-8")]


def decode(token_ids: Iterable[int], eos: Iterable[int]) -> str:
    stop = set(eos)
    return "".join(f" t{t}" for t in token_ids if t not in stop)


def _text(content: Any) -> str:
    """A message's content: a string, or a list of parts whose ``text`` counts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _turns(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    return "".join(f"<|{m.get('role')}|>{_text(m.get('content'))}\n" for m in messages if isinstance(m, dict))


def prompt_ids(kind: str, body: dict[str, Any]) -> list[int]:
    """The prompt ids of ``body`` under the toy tokenizer and chat template."""
    if kind == "chat":
        return encode(_turns(body.get("messages")) + "<|assistant|>")
    if kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("the simulator's completions API takes one non-empty prompt", "prompt")
        return encode(prompt)
    if kind == "responses":
        given = body.get("input")
        text = given if isinstance(given, str) else _turns(given)
        return encode(f"<|system|>{body.get('instructions') or ''}\n<|user|>{text}\n<|assistant|>")
    system = body.get("system")
    return encode(f"<|system|>{_text(system) if system else ''}\n" + _turns(body.get("messages")) + "<|assistant|>")


def output_bound(kind: str, body: dict[str, Any]) -> int | None:
    """The field each API reads its output bound from (vLLM's schemas); None: up to the context."""
    if kind == "chat":
        value = body.get("max_completion_tokens")
        return value if value is not None else body.get("max_tokens")
    if kind == "completions":
        value = body.get("max_tokens")
        return 16 if value is None else value
    if kind == "responses":
        return body.get("max_output_tokens")
    return body.get("max_tokens")


_SAMPLING = ("temperature", "top_p", "top_k", "seed", "min_tokens", "ignore_eos", "stop_token_ids")


def generate_request(kind: str, body: dict[str, Any], request_id: str) -> GenerateRequest:
    sampling: dict[str, Any] = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    sampling["max_tokens"] = output_bound(kind, body)
    if kind in ("chat", "completions") and body.get("n") is not None:
        sampling["n"] = body["n"]
    stream = body.get("stream") is True
    try:
        return GenerateRequest.model_validate({
            "request_id": request_id, "model": body.get("model"), "token_ids": prompt_ids(kind, body),
            "sampling_params": sampling, "stream": stream,
            # Always counted: the Responses and Messages streams end with their usage.
            "stream_options": {"include_usage": True} if stream else None,
            "kv_transfer_params": body.get("kv_transfer_params"),
        })
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _usage(kind: str, usage: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    if kind in ("chat", "completions"):
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if kind == "responses":
        return {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion}
    return {"input_tokens": prompt, "output_tokens": completion}


def _stop_reason(finish: str | None) -> str:
    return "max_tokens" if finish == "length" else "end_turn"


class OpenAIHandlers:
    """The four OpenAI-level routes bound to one engine's generate handlers."""

    def __init__(self, generate: GenerateHandlers) -> None:
        self.g = generate
        self.eos = generate.engine.config.eos_token_ids

    async def chat(self, request: Request) -> Response:
        return await self._serve("chat", request)

    async def completions(self, request: Request) -> Response:
        return await self._serve("completions", request)

    async def responses(self, request: Request) -> Response:
        return await self._serve("responses", request)

    async def messages(self, request: Request) -> Response:
        return await self._serve("messages", request)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``POST /tokenize`` for a ``prompt`` or chat ``messages``: ids of text need the
        tokenizer (a --tokens-only engine answers 400); a prompt of ids passes as it is."""
        body = await json_body(request)
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        prompt = body.get("prompt")
        ids_only = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        if self.g.engine.config.tokens_only and not ids_only:
            raise bad_request(NO_TOKENIZER)
        ids = prompt_ids("completions" if "messages" not in body else "chat", body)
        max_len = self.g.engine.config.max_model_len
        return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": None})

    async def _serve(self, kind: str, request: Request) -> Response:
        body = await json_body(request)
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        self.g.engine.stats.native_requests[kind] += 1
        if self.g.engine.config.tokens_only:
            raise bad_request(NO_TOKENIZER)  # every body of these APIs is text to a template
        rid = request.headers.get("x-request-id") or body.get("request_id") or f"{time.time_ns():x}"

        prompt = body.get("prompt") if kind == "completions" else None
        if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt):
            return await self._several(request, body, rid, prompt)

        async def read() -> GenerateRequest:
            return generate_request(kind, body, rid)

        answer = await self.g.serve(request, read)
        if isinstance(answer, SSEResponse):
            return SSEResponse(self._stream(kind, body, rid, answer.body_iterator))
        if answer.status_code != 200 or not isinstance(answer, JSONResponse):
            return answer
        return JSONResponse(self._whole(kind, body, rid, json.loads(bytes(answer.body))))

    async def _several(self, request: Request, body: dict[str, Any], rid: str, prompts: list[Any]) -> Response:
        """A completion of several prompts, each its own generate, merged as vLLM's server merges
        them. The prompts run in turn (a reference answer, not a benchmark): one engine request id
        at a time under the client's ``X-Request-Id``."""
        n = int(body.get("n") or 1)
        subs = [{**body, "prompt": p} for p in prompts]
        if body.get("stream") is True:
            wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            for sub in subs:
                sub["stream_options"] = {"include_usage": True}  # summed below, shown once if asked
            return SSEResponse(self._several_stream(request, subs, rid, n, wants_usage))
        merged: dict[str, Any] | None = None
        for i, sub in enumerate(subs):
            answer = await self._one(request, sub, rid)
            if answer.status_code != 200 or not isinstance(answer, JSONResponse):
                return answer
            whole = self._whole("completions", sub, rid, json.loads(bytes(answer.body)))
            for choice in whole["choices"]:
                choice["index"] += i * n
            if merged is None:
                merged = whole
            else:
                merged["choices"] += whole["choices"]
                merged["usage"] = {k: merged["usage"][k] + whole["usage"][k] for k in merged["usage"]}
        assert merged is not None
        return JSONResponse(merged)

    async def _one(self, request: Request, sub: dict[str, Any], rid: str) -> Response:
        async def read() -> GenerateRequest:
            return generate_request("completions", sub, rid)

        return await self.g.serve(request, read)

    async def _several_stream(
        self, request: Request, subs: list[dict[str, Any]], rid: str, n: int, wants_usage: bool
    ) -> AsyncIterator[str]:
        usage: dict[str, int] = {}
        first: dict[str, Any] = {}
        for i, sub in enumerate(subs):
            answer = await self._one(request, sub, rid)
            if not isinstance(answer, SSEResponse):
                yield sse_event(json.dumps({"error": {"message": f"prompt {i} failed ({answer.status_code})",
                                                      "type": "InternalServerError", "code": answer.status_code}}))
                yield DONE_EVENT
                return
            async with aclosing(self._stream("completions", sub, rid, answer.body_iterator)) as events:
                async for raw in events:
                    if raw == DONE_EVENT:
                        break
                    event = json.loads(raw[len("data: "):])
                    if "error" in event:
                        yield raw
                        yield DONE_EVENT
                        return
                    first = first or event
                    if not event["choices"]:
                        usage = {k: usage.get(k, 0) + v for k, v in event["usage"].items()}
                        continue
                    for choice in event["choices"]:
                        choice["index"] += i * n
                    yield sse_event(json.dumps(event))
        if wants_usage:
            yield sse_event(json.dumps({"id": first.get("id"), "object": "text_completion",
                                        "created": first.get("created"), "model": first.get("model"),
                                        "choices": [], "usage": usage}))
        yield DONE_EVENT

    def _whole(self, kind: str, body: dict[str, Any], rid: str, gen: dict[str, Any]) -> dict[str, Any]:
        model, created, kv = gen["model"], gen["created"], gen.get("kv_transfer_params")
        usage = _usage(kind, gen["usage"])
        texts = [(c["index"], decode(c["token_ids"], self.eos), c["finish_reason"]) for c in gen["choices"]]
        if kind == "chat":
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": f}
                       for i, t, f in texts]
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": model,
                    "choices": choices, "usage": usage, "kv_transfer_params": kv}
        if kind == "completions":
            choices = [{"index": i, "text": t, "finish_reason": f} for i, t, f in texts]
            return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
                    "choices": choices, "usage": usage, "kv_transfer_params": kv}
        _, text, finish = texts[0]
        if kind == "responses":
            return self._response(rid, model, created, text, usage, kv)
        return {"id": f"msg_{rid}", "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": text}], "stop_reason": _stop_reason(finish),
                "stop_sequence": None, "usage": usage, "kv_transfer_params": kv}

    @staticmethod
    def _response(
        rid: str, model: str, created: int, text: str, usage: dict[str, Any] | None, kv: Any, status: str = "completed"
    ) -> dict[str, Any]:
        output = [{"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": status,
                   "content": [{"type": "output_text", "text": text, "annotations": []}]}]
        return {"id": f"resp_{rid}", "object": "response", "created_at": created, "model": model, "status": status,
                "output": output if status == "completed" else [], "usage": usage, "kv_transfer_params": kv}

    async def _stream(self, kind: str, body: dict[str, Any], rid: str, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """The generate stream's events in the API's own stream format."""
        eos = self.eos
        model = str(body.get("model") or "")
        created = int(time.time())
        texts: dict[int, str] = {}
        finish: str | None = None
        usage: dict[str, Any] | None = None
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if kind == "responses":
            start = self._response(rid, model, created, "", None, None, status="in_progress")
            yield _named("response.created", {"type": "response.created", "response": start})
        elif kind == "messages":
            message = {"id": f"msg_{rid}", "type": "message", "role": "assistant", "model": model, "content": [],
                       "stop_reason": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
            yield _named("message_start", {"type": "message_start", "message": message})
            yield _named("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}})
        async with aclosing(events) as stream:
            async for raw in stream:
                if raw == DONE_EVENT:
                    break
                event = json.loads(raw[len("data: "):])
                if "error" in event:
                    if kind in ("chat", "completions"):
                        yield raw
                        yield DONE_EVENT
                    else:
                        yield _named("error", {"type": "error", "error": event["error"]})
                    return
                if not event.get("choices"):
                    usage = event.get("usage")
                    continue
                c = event["choices"][0]
                index, text = c["index"], decode(c["token_ids"], eos)
                first = index not in texts
                texts[index] = texts.get(index, "") + text
                finish = c.get("finish_reason") or finish
                if kind == "chat":
                    delta = {"role": "assistant", "content": text} if first else {"content": text}
                    choice = {"index": index, "delta": delta, "finish_reason": c.get("finish_reason")}
                    yield sse_event(json.dumps({"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk",
                                                "created": created, "model": model, "choices": [choice]}))
                elif kind == "completions":
                    choice = {"index": index, "text": text, "finish_reason": c.get("finish_reason")}
                    yield sse_event(json.dumps({"id": f"cmpl-{rid}", "object": "text_completion",
                                                "created": created, "model": model, "choices": [choice]}))
                elif kind == "responses":
                    yield _named("response.output_text.delta", {"type": "response.output_text.delta",
                                                                 "output_index": 0, "content_index": 0, "delta": text})
                else:
                    yield _named("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                         "delta": {"type": "text_delta", "text": text}})
        shown = _usage(kind, usage) if usage else None
        if kind in ("chat", "completions"):
            if wants_usage and shown is not None:
                name = "chat.completion.chunk" if kind == "chat" else "text_completion"
                prefix = "chatcmpl" if kind == "chat" else "cmpl"
                yield sse_event(json.dumps({"id": f"{prefix}-{rid}", "object": name, "created": created,
                                            "model": model, "choices": [], "usage": shown}))
            yield DONE_EVENT
        elif kind == "responses":
            done = self._response(rid, model, created, texts.get(0, ""), shown, None)
            yield _named("response.completed", {"type": "response.completed", "response": done})
        else:
            yield _named("content_block_stop", {"type": "content_block_stop", "index": 0})
            yield _named("message_delta", {"type": "message_delta", "delta": {"stop_reason": _stop_reason(finish)},
                                           "usage": {"output_tokens": (shown or {}).get("output_tokens", 0)}})
            yield _named("message_stop", {"type": "message_stop"})


def _named(event: str, payload: dict[str, Any]) -> str:
    """An SSE event with its type line, as vLLM's Responses and Anthropic streams send them."""
    return f"event: {event}\ndata: {json.dumps(payload)}\n\n"
