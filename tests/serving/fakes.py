"""Fake upstreams for the serving tests (fixtures in conftest.py): one handler (``httpx.Request`` in,
``httpx.Response`` out) that emulates the vLLM render sidecar, two token-only engines and
derender with the 0.33.0 wire shapes (vllm-protocol.md sections 3, 5 and 8). ``loopback.py``
serves it on 127.0.0.1 to the production client; ``in_process.py`` calls it in-process for the
one bound that a socket's buffers would hide.

Every request is recorded in ``FakeUpstreams.calls``. Tests change behaviour per host and
endpoint with ``FakeUpstreams.override``; an override may return a response, raise an httpx
error, or await (to hold an engine busy until the test releases it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx

from serving.pipeline.snapshot import FleetSnapshot, InstanceView, ModelView, RenderView

MODEL = "tiny"
# The fakes render Qwen2 ids (CHAT_PROMPT): its vocabulary is the snapshots' out-of-vocabulary bound.
VOCAB_SIZE = 151936
RENDER_URL = "http://render.test:8100"
ENGINE_URLS = {"e1": "http://e1.test:8201", "e2": "http://e2.test:8202"}
EOS = 151645
CHAT_PROMPT = [151644, 872, 198, 45764, 15588, 151645, 198, 151644, 77091, 198]
CREATED = 1767225600

Override = Callable[[httpx.Request, Any], Awaitable[httpx.Response] | httpx.Response]


def completion_prompt_ids(i: int) -> list[int]:
    """Prompt ``i`` renders to ``i + 2`` copies of ``1000 + i``: distinct lengths and contents."""
    return [1000 + i] * (i + 2)


def output_ids(prompt: list[int], index: int, tokens: int = 3) -> list[int]:
    """What the fake engine generates: identifies the prompt and the choice, then EOS."""
    return [prompt[0]] + [500 + index] * (tokens - 2) + [EOS]


def text_of(token_ids: list[int]) -> str:
    return "".join(f"<{t}>" for t in token_ids if t != EOS)


def error_json(status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


@dataclass
class Call:
    host: str  # render | e1 | e2
    kind: str  # render | generate | derender | abort
    path: str
    body: Any
    headers: httpx.Headers
    response: Any = None  # the JSON answered (non-streaming answers only)


class SSEBody(httpx.AsyncByteStream):
    """A streaming response body over an async generator; records when httpx closes it."""

    def __init__(self, agen: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self._agen = agen
        self._on_close = on_close

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._agen

    async def aclose(self) -> None:
        self._on_close()
        await self._agen.aclose()  # type: ignore[attr-defined]


@dataclass
class StreamPlan:
    """How a fake engine stream ends: after ``after`` events, ``end`` happens.

    end: "done" (clean, ``data: [DONE]``), "eof" (closes without [DONE]), "raise" (connection
    drops: httpx.ReadError), "hang" (waits on ``release`` forever unless set), or "error"
    (an in-band ``{"error": ...}`` event with ``error_code``, then [DONE]).
    """

    end: str = "done"
    after: int | None = None
    tokens: int = 3  # generated per choice, the last one EOS
    error_code: int = 500
    release: asyncio.Event = field(default_factory=asyncio.Event)
    # Every event in one network chunk: what a reader finds queued when an engine ran ahead of it.
    burst: bool = False


class FakeUpstreams:
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._overrides: dict[tuple[str, str], list[tuple[Override, int | None]]] = {}
        self.stream_plans: dict[str, StreamPlan] = {}  # by engine request_id
        self.default_plan = StreamPlan()
        self.open_streams: set[str] = set()  # engine request ids whose SSE body is not closed yet
        self.closed_streams: list[str] = []
        self.stream_derenders: list[dict[str, Any]] = []  # (prompt, index, state_in, state_out)
        self._state_counter = itertools.count()
        self._prompt_of_state: dict[str, tuple[int, ...]] = {}

    # -- configuration -------------------------------------------------------------------------
    def override(self, host: str, kind: str, fn: Override, *, times: int | None = None) -> None:
        """Answer ``kind`` calls on ``host`` with ``fn`` (``times`` calls, or all if None)."""
        self._overrides.setdefault((host, kind), []).append((fn, times))

    def calls_of(self, kind: str, host: str | None = None) -> list[Call]:
        return [c for c in self.calls if c.kind == kind and (host is None or c.host == host)]

    def aborted_ids(self) -> list[tuple[str, str]]:
        return [(c.host, rid) for c in self.calls_of("abort") for rid in c.body["request_ids"]]

    # -- transport -----------------------------------------------------------------------------
    async def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host.split(".")[0]
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        if path.endswith("/render"):
            kind = "render"
        elif path.endswith("/derender"):
            kind = "derender"
        elif path == "/inference/v1/generate":
            kind = "generate"
        elif path == "/inference/v1/abort_requests":
            kind = "abort"
        else:
            return httpx.Response(404, json={"detail": "Not Found"})
        call = Call(host, kind, path, body, request.headers)
        self.calls.append(call)
        queue = self._overrides.get((host, kind))
        if queue:
            fn, times = queue[0]
            if times is not None:
                if times <= 1:
                    queue.pop(0)
                else:
                    queue[0] = (fn, times - 1)
            out = fn(request, body)
            if asyncio.iscoroutine(out):
                out = await out
        else:
            out = getattr(self, f"_{kind}")(request, body)
        if not isinstance(out.stream, SSEBody) and out.content:
            call.response = json.loads(out.content)
        return out  # type: ignore[return-value]

    # -- render --------------------------------------------------------------------------------
    @staticmethod
    def _sampling_params(body: dict[str, Any], stream: bool) -> dict[str, Any]:
        params: dict[str, Any] = {
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
            "temperature": float(body.get("temperature", 1.0)), "top_p": 1.0, "min_p": 0.0,
            "stop": [], "stop_token_ids": [], "output_kind": 1 if stream else 2, "skip_clone": True,
            "bad_words": [], "skip_reading_prefix_cache": False,
        }
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens") or 16
        if max_tokens != 16:  # msgspec omit_defaults drops a resolved 16 (protocol 3.2)
            params["max_tokens"] = max_tokens
        n = int(body.get("n") or 1)
        if n != 1:
            params["n"] = n
        return params

    @staticmethod
    def _generate_request(request_id: str, token_ids: list[int], body: dict[str, Any], chat: bool) -> dict:
        stream = bool(body.get("stream"))
        opts = body.get("stream_options") if stream else None
        return {
            "request_id": request_id,
            "token_ids": token_ids,
            "token_offsets": None, "features": None, "content_parts": None,
            "sampling_params": FakeUpstreams._sampling_params(body, stream),
            "model": body.get("model"),
            "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": None,
            "output_mode": "tokens",
            "parse_context": (
                {"tools": None, "tool_choice": "none", "parallel_tool_calls": True, "include_reasoning": True,
                 "chat_template_kwargs": {"cohere_format": "cmd4", "add_generation_prompt": True,
                                          "continue_final_message": False},
                 "history_tool_call_cnt": 0}
                if chat else None
            ),
            "stream": stream,
            "stream_options": (
                {"include_usage": bool(opts.get("include_usage")), "continuous_usage_stats": False} if opts else None
            ),
            "cache_salt": None, "priority": 0, "kv_transfer_params": None, "ec_transfer_params": None,
        }

    def _render(self, request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        base = request.headers.get("X-Request-Id") or body.get("request_id") or "anon"
        if request.url.path == "/v1/chat/completions/render":
            return httpx.Response(200, json=self._generate_request(f"chatcmpl-{base}", CHAT_PROMPT, body, True))
        if request.url.path in ("/v1/responses/render", "/v1/messages/render"):
            # vLLM 0.33's sidecar renders these APIs too, one GenerateRequest (the native path counts it).
            if request.url.path == "/v1/messages/render" and body.get("stream"):
                body = {**body, "stream_options": {"include_usage": True}}  # as vLLM's Messages conversion asks
            return httpx.Response(200, json=self._generate_request(f"resp-{base}", CHAT_PROMPT, body, True))
        prompt = body["prompt"]
        prompts = prompt if isinstance(prompt, list) else [prompt]
        if len(prompts) == 1:
            ids = [f"cmpl-{base}"]
        else:
            ids = [f"cmpl-{base}-{i}" for i in range(len(prompts))]
        return httpx.Response(
            200, json=[self._generate_request(rid, completion_prompt_ids(i), body, False) for i, rid in enumerate(ids)]
        )

    # -- engines -------------------------------------------------------------------------------
    def _generate(self, request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if body.get("stream"):
            return self.sse_response(body)
        return httpx.Response(200, json=self.generate_response(body))

    @staticmethod
    def generate_response(body: dict[str, Any], *, reverse_choices: bool = True) -> dict[str, Any]:
        """A tokens-mode GenerateResponse; choices listed in reverse index order (engines may)."""
        n = int(body["sampling_params"].get("n", 1))
        choices = [
            {"index": j, "finish_reason": "stop", "stop_reason": None,
             "token_ids": output_ids(body["token_ids"], j), "routed_experts": None,
             "sampling_mask": None, "weight_versions": None, "logprobs": None}
            for j in range(n)
        ]
        if reverse_choices:
            choices.reverse()
        completion = sum(len(c["token_ids"]) for c in choices)
        prompt = len(body["token_ids"])
        return {
            "request_id": "generate-tokens-" + body["request_id"],
            "model": body.get("model"),
            "created": CREATED,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
                      "prompt_tokens_details": None, "completion_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": choices,
        }

    @staticmethod
    def stream_events(body: dict[str, Any], tokens: int = 3) -> list[dict[str, Any]]:
        """Token events (one choice each, indices interleaved, one token per event), then usage."""
        n = int(body["sampling_params"].get("n", 1))
        rid = "generate-tokens-" + body["request_id"]
        outs = [output_ids(body["token_ids"], j, tokens) for j in range(n)]
        events = []
        for pos in range(len(outs[0])):
            for j in range(n):
                last = pos == len(outs[j]) - 1
                events.append({
                    "request_id": rid, "usage": None, "output_mode": "tokens",
                    "choices": [{"index": j, "finish_reason": "stop" if last else None, "stop_reason": None,
                                 "token_ids": [outs[j][pos]], "routed_experts": None, "sampling_mask": None,
                                 "weight_versions": None, "logprobs": None}],
                })
        opts = body.get("stream_options") or {}
        if opts.get("include_usage"):
            prompt = len(body["token_ids"])
            completion = sum(len(o) for o in outs)
            events.append({"request_id": rid, "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                                        "completion_tokens": completion},
                           "output_mode": "tokens", "choices": []})
        return events

    def sse_response(self, body: dict[str, Any], plan: StreamPlan | None = None) -> httpx.Response:
        rid = body["request_id"]
        plan = plan or self.stream_plans.get(rid) or self.default_plan
        events = self.stream_events(body, plan.tokens)
        after = len(events) if plan.after is None else plan.after

        async def agen() -> AsyncIterator[bytes]:
            frames = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events[:after]]
            if plan.burst:
                yield b"".join(frames)
            else:
                for line in frames:
                    # Split each event across two network chunks, as TCP may.
                    yield line[:7]
                    yield line[7:]
            if plan.end == "done":
                yield b"data: [DONE]\n\n"
            elif plan.end == "raise":
                raise httpx.ReadError("peer closed connection")
            elif plan.end == "hang":
                await plan.release.wait()
                yield b"data: [DONE]\n\n"
            elif plan.end == "error":
                err = error_json(plan.error_code, "engine failed mid-stream",
                                 "InternalServerError" if plan.error_code >= 500 else "BadRequestError")
                yield ("data: " + json.dumps(err) + "\n\n").encode()
                yield b"data: [DONE]\n\n"
            # "eof": end without [DONE]

        self.open_streams.add(rid)

        def on_close() -> None:
            self.open_streams.discard(rid)
            self.closed_streams.append(rid)

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=SSEBody(agen(), on_close))

    def _abort(self, request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200)

    # -- derender ------------------------------------------------------------------------------
    def _derender(self, request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        chat = request.url.path == "/v1/chat/completions/derender"
        if body.get("stream"):
            return httpx.Response(200, json=self._derender_chunk(body, chat))
        if chat:
            gen = body["generate_response"]
            prompt_tokens = body.get("prompt_tokens") or 0
            choices = [
                {"index": c["index"],
                 "message": {"role": "assistant", "content": text_of(c["token_ids"]), "refusal": None,
                             "annotations": None, "audio": None, "function_call": None, "reasoning": None},
                 "logprobs": None, "finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"],
                 "token_ids": None, "routed_experts": None, "weight_versions": None}
                for c in gen["choices"]
            ]
            completion = sum(len(c["token_ids"]) for c in gen["choices"])
            return httpx.Response(200, json={
                "id": gen["request_id"], "object": "chat.completion", "created": CREATED + 1,
                "model": body.get("model") or MODEL, "choices": choices,
                "service_tier": None, "system_fingerprint": None,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion,
                          "completion_tokens": completion, "prompt_tokens_details": None,
                          "completion_tokens_details": None},
                "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
            })
        gens = body["generate_responses"]
        prompt_tokens = body.get("prompt_tokens") or [0] * len(gens)
        if len(prompt_tokens) != len(gens):
            return httpx.Response(400, json=error_json(400, "prompt_tokens length mismatch", "Bad Request"))
        choices = []
        # Real derender numbers choices with a running counter in list order (protocol 5.2).
        for gen in gens:
            for c in gen["choices"]:
                choices.append({"index": len(choices), "text": text_of(c["token_ids"]), "logprobs": None,
                                "finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"],
                                "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                                "routed_experts": None, "weight_versions": None})
        completion = sum(len(c["token_ids"]) for g in gens for c in g["choices"])
        return httpx.Response(200, json={
            "id": gens[0]["request_id"], "object": "text_completion", "created": CREATED + 1,
            "model": body.get("model") or MODEL, "choices": choices,
            "usage": {"prompt_tokens": sum(prompt_tokens), "total_tokens": sum(prompt_tokens) + completion,
                      "completion_tokens": completion, "prompt_tokens_details": None,
                      "completion_tokens_details": None},
            "kv_transfer_params": None, "metrics": None,
        })

    def _derender_chunk(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        gen = body["generate_chunk"]
        assert "error" not in gen, "an in-band error event must never reach derender"
        state_in = body.get("stream_state")
        base = {"id": gen["request_id"], "object": "chat.completion.chunk" if chat else "text_completion",
                "created": CREATED, "model": body.get("model") or MODEL}
        if not gen["choices"]:
            u = gen["usage"]
            prompt = body.get("prompt_tokens") or u["prompt_tokens"]
            usage = {"prompt_tokens": prompt, "total_tokens": prompt + u["completion_tokens"],
                     "completion_tokens": u["completion_tokens"], "prompt_tokens_details": None,
                     "completion_tokens_details": None}
            return {"chunk": {**base, "choices": [], "usage": usage}, "stream_state": state_in}
        assert len(gen["choices"]) == 1, "at most one choice per derender chunk"
        c = gen["choices"][0]
        text = text_of(c["token_ids"]) or None
        if chat:
            role = None if state_in and state_in["role_sent"] else "assistant"
            choice = {"index": c["index"], "delta": {"role": role, "content": text, "reasoning": None},
                      "logprobs": None, "finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"],
                      "token_ids": None, "weight_versions": None}
        else:
            choice = {"index": c["index"], "text": text or "", "logprobs": None,
                      "finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"], "token_ids": None}
        state_out = {
            "prev_tokens": [f"s{next(self._state_counter)}"],  # unique per call: proves verbatim round-trips
            "prefix_offset": 0, "read_offset": 1, "role_sent": True,
            "logprob_context_token_ids": ((state_in or {}).get("logprob_context_token_ids", []) + c["token_ids"])[-4:],
            "logprob_text_offset": 0, "output_token_ids": [], "output_chunk_lens": [],
            "tools_streamed": False, "last_tool_call_ids": [],
        }
        # Like the real plain path, only a choice's first call needs the prompt; later calls are
        # tied to it through the state they carry.
        if "prompt_token_ids" in body:
            prompt = tuple(body["prompt_token_ids"])
        else:
            assert state_in is not None, "a choice's first derender call must carry the prompt ids"
            prompt = self._prompt_of_state[state_in["prev_tokens"][0]]
        self._prompt_of_state[state_out["prev_tokens"][0]] = prompt
        self.stream_derenders.append({
            "prompt": prompt, "index": c["index"], "carried_prompt": "prompt_token_ids" in body,
            "request": body.get("chat_request" if chat else "completion_request"),
            "state_in": state_in, "state_out": state_out,
        })
        return {"chunk": {**base, "choices": [choice], "usage": None, "system_fingerprint": None,
                          "prompt_token_ids": None, "prompt_text": None, "metrics": None,
                          "kv_transfer_params": None},
                "stream_state": state_out}


def instance(name: str, *, state: str = "active", model: str = MODEL) -> InstanceView:
    return InstanceView(
        id=int(name[1:]), name=name, url=ENGINE_URLS[name], role="union", model=model, weight=1,
        token_capacity=65536, max_model_len=2048, token_generate=True, native_openai=False, tokenizer=False,
        state=state,
    )


def fleet_snapshot(*instances: InstanceView, **render: Any) -> FleetSnapshot:
    """The fake fleet: ``instances`` (e1 and e2 by default); ``render`` overrides RenderView fields."""
    return FleetSnapshot(
        version=1,
        models={MODEL: ModelView(MODEL, "/models/tiny", 2048, VOCAB_SIZE)},
        render=RenderView(**{"enable": True, "base_url": RENDER_URL, "timeout_s": 5.0, **render}),
        instances=instances or (instance("e1"), instance("e2")),
    )


def parse_frames(raw: bytes) -> list[dict[str, Any] | str]:
    """Split an SSE body into events: dicts for JSON, the string "[DONE]" for the end marker."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    out: list[dict[str, Any] | str] = []
    for block in raw.decode().split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return out
