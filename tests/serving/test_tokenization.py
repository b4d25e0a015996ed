"""The tokenization service: render first, the model's own tokenizer when render is unusable.

Fallback reasons each end in a locally tokenized request served token-only with a local
derender; render's verdicts on the request never fall back; what the fallback cannot build
exactly takes the native path. Uses the real tiny model's files (MOTOR_MODEL_DIR).
"""

from __future__ import annotations

import functools
import logging
from array import array
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, Callable

import httpx
import pytest

from serving.pipeline.engine.native import native_reason
from serving.pipeline.errors import RenderUnavailable, RequestError, UpstreamRequestError
from serving.pipeline.json_codec import dumps
from serving.pipeline.render import local_tokenizer as lt
from serving.pipeline.render.tokenization import TokenizationService, local_render, local_unsupported
from serving.pipeline.tracing import NO_TRACE
from tests.serving.fakes import CHAT_PROMPT, MODEL, error_json
from tests.serving.loopback import HANG_DEADLINE_S, hang
from tests.serving.router_fakes import (
    Rig,
    chat_body,
    engine,
    model_dir,
    respond,
    snapshot_with,
)


def connect_error(request: httpx.Request, _body: Any) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


read_timeout = hang  # a sidecar that never answers, against the render deadline below


FALLBACKS = [
    (connect_error, "unreachable"),
    (read_timeout, "timeout"),
    (respond(404, {"detail": "Not Found"}), "capability"),
    (respond(501, error_json(501, "not implemented", "NotImplementedError")), "capability"),
    (respond(403, error_json(403, "scale-out disabled", "Forbidden")), "capability"),
    (respond(500, error_json(500, "boom", "InternalServerError")), "status"),
    (respond(200, {"request_id": "x", "token_ids": []}), "no_token_ids"),
]


@functools.cache
def hf_tokenizer() -> Any:
    """transformers' own tokenizer for the tiny model: what render (vLLM) builds, not our code."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir(), local_files_only=True)


def hf_prompt(messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The prompt transformers' ``apply_chat_template`` renders for ``messages`` (generation prompt on)."""
    text = hf_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert isinstance(text, str)
    return text


def hf_ids(text: str, *, add_special_tokens: bool) -> list[int]:
    return list(hf_tokenizer()(text, add_special_tokens=add_special_tokens)["input_ids"])


def expected_chat_ids() -> list[int]:
    """The ids for chat_body()'s messages as transformers renders and tokenizes them."""
    return hf_ids(hf_prompt([{"role": "user", "content": "Say hi"}]), add_special_tokens=False)


@pytest.mark.parametrize(("fault", "reason"), FALLBACKS, ids=[r for _, r in FALLBACKS[:-3]] + ["403", "500", "no-ids"])
async def test_it_falls_back_to_the_local_tokenizer(
    rig: Rig, fault: Callable[..., httpx.Response], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    rig.upstreams.override("render", "render", fault)
    pipeline = rig.pipeline(snapshot_with(model_path=model_dir()), render_timeout_s=HANG_DEADLINE_S)

    with caplog.at_level(logging.INFO, logger="serving.pipeline.service"):
        out = await pipeline.chat(chat_body(max_tokens=5, return_token_ids=True), "t1")

    (gen,) = rig.upstreams.calls_of("generate")
    assert gen.body["token_ids"] == expected_chat_ids()
    assert gen.body["sampling_params"]["max_tokens"] == 5
    assert gen.body["request_id"] == "chatcmpl-t1"
    assert rig.upstreams.calls_of("derender") == []  # derendered locally: render is unusable
    assert out["id"] == "chatcmpl-t1" and out["prompt_token_ids"] == expected_chat_ids()
    choice = out["choices"][0]
    assert choice["token_ids"] == gen.response["choices"][0]["token_ids"]
    assert choice["message"]["content"] == hf_tokenizer().decode(choice["token_ids"], skip_special_tokens=True)
    assert out["usage"]["prompt_tokens"] == len(expected_chat_ids())
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("render "))
    assert "request_id=t1" in line and "tokenizer_source=local" in line and f"fallback_reason={reason}" in line
    assert f"prompt_tokens={len(expected_chat_ids())}" in line and "model=tiny" in line
    assert rig.counters.get("motor_render_outcomes_total", source="local", result="ok", fallback_reason=reason) == 1


async def test_completions_fall_back_per_prompt_in_order(rig: Rig) -> None:
    rig.upstreams.override("render", "render", connect_error)
    pipeline = rig.pipeline(snapshot_with(model_path=model_dir()))

    out = await pipeline.completions({"model": MODEL, "prompt": ["def f", [5, 6, 7]], "max_tokens": 3}, "t2")

    gens = sorted(rig.upstreams.calls_of("generate"), key=lambda c: c.body["request_id"])
    assert [g.body["token_ids"] for g in gens] == [hf_ids("def f", add_special_tokens=True), [5, 6, 7]]
    assert [g.body["request_id"] for g in gens] == ["cmpl-t2-0", "cmpl-t2-1"]
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["prompt_tokens"] == len(gens[0].body["token_ids"]) + 3


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (400, error_json(400, "max_completion_tokens=9999 cannot be greater than max_model_len=2048.")),
        (422, error_json(422, "could not fetch image", "Unprocessable")),
        (404, error_json(404, "The model `x` does not exist.", "NotFoundError", "model")),
        (400, error_json(400, "This model's maximum context length is 2048 tokens.")),
    ],
    ids=["400", "422", "404-not-found-error", "context-overflow"],
)
async def test_render_verdicts_on_the_request_never_fall_back(rig: Rig, status: int, body: dict[str, Any]) -> None:
    rig.upstreams.override("render", "render", respond(status, body))
    pipeline = rig.pipeline(snapshot_with(model_path=model_dir()))

    with pytest.raises(UpstreamRequestError) as info:
        await pipeline.chat(chat_body(), "t3")

    assert (info.value.status, info.value.body()) == (status, body)
    assert [c.kind for c in rig.upstreams.calls] == ["render"]


async def test_without_usable_model_files_render_stays_unavailable(rig: Rig) -> None:
    rig.upstreams.override("render", "render", connect_error)
    with pytest.raises(RenderUnavailable) as info:
        await rig.pipeline(snapshot_with(model_path="/nonexistent/model")).chat(chat_body(), "t4")
    assert info.value.status == 503 and info.value.reason == "unreachable"
    assert rig.upstreams.calls_of("generate") == []


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"tool_choice": "auto"},
        {"response_format": {"type": "json_object"}},
        {"logprobs": True, "top_logprobs": 2},
        {"stream": True},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    ],
    ids=["tools", "tool_choice", "response_format", "logprobs", "stream", "template-kwargs", "image"],
)
async def test_what_the_fallback_cannot_build_takes_the_native_path(rig: Rig, extra: dict[str, Any]) -> None:
    rig.upstreams.override("render", "render", connect_error)
    snap = snapshot_with(engine("e1", native_openai=True), engine("e2"), model_path=model_dir())

    out = await rig.pipeline(snap).chat(chat_body(**extra), "t5")
    if not isinstance(out, dict):
        async for _ in out.frames():
            pass
    else:
        assert out["served_by"] == "e1"

    assert [(h, p) for h, p, _ in rig.native.calls] == [("e1", "/v1/chat/completions")]
    assert rig.native.calls[0][2] == chat_body(**extra)  # the client's body, untouched
    assert rig.upstreams.calls_of("generate") == []
    # Structured output is known to need the native path before render is even asked.
    # The local fallback's reasons are categories: the key the client sent is not a label value.
    local = (local_unsupported("chat", chat_body(**extra)) or "").partition(":")[0]
    reason = native_reason("chat", chat_body(**extra), snap, MODEL) or f"local:{local}"
    assert rig.counters.get("motor_route_decisions_total", path="native", reason=reason) == 1


async def test_fallback_needing_native_with_obfuscation_on_is_503_not_native(rig: Rig) -> None:
    rig.upstreams.override("render", "render", connect_error)
    snap = snapshot_with(engine("e1", native_openai=True), model_path=model_dir(), obfuscation=True)
    with pytest.raises(RenderUnavailable):
        await rig.pipeline(snap).chat(chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), "t6")
    assert rig.native.calls == []


async def test_the_local_tokenizer_is_built_lazily_on_the_first_fallback(rig: Rig, tmp_path: Any) -> None:
    # A private copy of the model directory: nothing else in the session has loaded it.
    import shutil

    private = tmp_path / "model"
    shutil.copytree(model_dir(), private, ignore=shutil.ignore_patterns("*.safetensors"))
    pipeline = rig.pipeline(snapshot_with(model_path=str(private)))

    await pipeline.completions({"model": MODEL, "prompt": "x"}, "t7")  # render answers: nothing loaded
    assert not lt.loaded(str(private))

    rig.upstreams.override("render", "render", connect_error)
    await pipeline.chat(chat_body(), "t8")
    assert lt.loaded(str(private))


def test_local_unsupported_accepts_plain_requests_and_names_the_rest() -> None:
    assert local_unsupported("chat", chat_body(temperature=0, max_tokens=3, seed=1, stop=["x"], n=2)) is None
    assert local_unsupported("chat", chat_body(tools=None, tool_choice="none", logprobs=False)) is None
    assert local_unsupported("completions", {"model": MODEL, "prompt": "x", "echo": True}) == "param:echo"
    assert local_unsupported("completions", {"model": MODEL, "prompt": "x", "suffix": "y"}) == "param:suffix"
    assert local_unsupported("chat", chat_body(messages=[{"role": "tool", "content": "1", "tool_call_id": "a"}])) == "messages"


def test_local_render_resolves_max_tokens_like_vllm() -> None:
    from serving.pipeline.snapshot import ModelView

    tok = lt.local_tokenizer(model_dir())
    model = ModelView(MODEL, model_dir(), 64)
    chat = local_render(tok, "chat", chat_body(), "r", model)[0]
    assert chat["sampling_params"]["max_tokens"] == 64 - len(chat["token_ids"])  # chat: the room left
    comp = local_render(tok, "completions", {"model": MODEL, "prompt": "x"}, "r", model)[0]
    assert comp["sampling_params"]["max_tokens"] == 16  # completions: vLLM's default
    with pytest.raises(RequestError):
        local_render(tok, "chat", chat_body(max_tokens=65), "r", model)
    with pytest.raises(RequestError):
        local_render(tok, "completions", {"model": MODEL, "prompt": list(range(64))}, "r", model)


async def test_render_success_is_logged_with_its_source(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="serving.pipeline.service"):
        await rig.pipeline().chat(chat_body(), "t9")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("render "))
    assert "tokenizer_source=render" in line and "fallback_reason=-" in line
    assert f"prompt_tokens={len(CHAT_PROMPT)}" in line and "latency_ms=" in line


async def test_a_render_found_down_is_skipped_for_a_cooldown(rig: Rig) -> None:
    from serving.pipeline.render.tokenization import RenderHealth

    now = [100.0]
    health = RenderHealth(cooldown_s=5.0, clock=lambda: now[0])
    pipeline = rig.pipeline(snapshot_with(model_path=model_dir()), render_health=health)
    rig.upstreams.override("render", "render", connect_error, times=1)

    await pipeline.chat(chat_body(max_tokens=3), "t10")  # refused: nothing listens, marked down
    await pipeline.chat(chat_body(max_tokens=3), "t11")  # skipped: straight to the local tokenizer
    assert len(rig.upstreams.calls_of("render")) == 1
    assert rig.counters.get("motor_render_outcomes_total", source="local", result="ok", fallback_reason="render_down") == 1
    now[0] += 5.0
    await pipeline.completions({"model": MODEL, "prompt": "x"}, "t12")  # tried again, answered
    assert len(rig.upstreams.calls_of("render")) == 2 and not health.skip()


PLAIN = {"model": MODEL, "prompt": "x", "max_tokens": 3}


async def test_one_render_timeout_does_not_send_the_process_to_the_local_tokenizer(rig: Rig) -> None:
    """A timeout may be one slow request: the next request asks render again. Only
    ``timeouts_to_down`` timeouts in a row (a hung sidecar) start the cooldown."""
    from serving.pipeline.render.tokenization import RenderHealth

    health = RenderHealth(cooldown_s=5.0, clock=lambda: 100.0)
    pipeline = rig.pipeline(snapshot_with(model_path=model_dir()), render_health=health, render_timeout_s=HANG_DEADLINE_S)
    rig.upstreams.override("render", "render", read_timeout, times=1)

    await pipeline.completions(PLAIN, "t13")  # timed out: this request falls back
    out = await pipeline.completions(PLAIN, "t14")  # render asked again, and it answers
    assert len(rig.upstreams.calls_of("render")) == 2 and not health.skip()
    assert len(rig.upstreams.calls_of("derender")) == 1 and out["id"] == "cmpl-t14"
    assert rig.counters.get("motor_render_outcomes_total", source="render", result="ok", fallback_reason="") == 1

    rig.upstreams.override("render", "render", read_timeout, times=health.timeouts_to_down)
    for n in range(health.timeouts_to_down):
        await pipeline.completions(PLAIN, f"t15-{n}")
    assert health.skip()  # a sidecar that keeps timing out is skipped for the cooldown
    calls = len(rig.upstreams.calls_of("render"))
    await pipeline.completions(PLAIN, "t16")
    assert len(rig.upstreams.calls_of("render")) == calls


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TURNS: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris? 12 words, año 2026"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    {"role": "assistant", "content": "It is 18C."},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.mark.parametrize(("messages", "tools"), [
    ([m for m in TURNS if m["role"] in ("system", "user")] + [{"role": "assistant", "content": "Sunny."},
                                                              {"role": "user", "content": "Sure?"}], None),
    (TURNS, TOOLS),
], ids=["multi-turn", "tools-and-tool-turns"])
def test_the_local_template_renders_what_transformers_renders(messages: list[dict[str, Any]], tools: Any) -> None:
    # The fallback serves only the first kind (tools and tool turns take the native path, see
    # local_unsupported); the template must still agree on both, or that boundary is all that
    # keeps wrong ids from an engine.
    tok = lt.local_tokenizer(model_dir())
    ours = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    assert ours == hf_prompt(messages, tools=tools)
    assert tok.encode(ours, add_special_tokens=False) == hf_ids(ours, add_special_tokens=False)


class _RenderReply:
    """A render sidecar answering one completions prompt with ``ids``."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    async def render_completions(
        self, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> list[dict[str, Any]]:
        return [{"request_id": f"cmpl-{request_id}", "token_ids": list(self.ids), "sampling_params": {"max_tokens": 4}}]


async def test_a_prompts_ids_are_held_once_as_four_byte_integers_and_sent_as_a_list() -> None:
    # A stream holds its prompt all its life (a relay continues from it): one copy, 4 bytes an id.
    ids = [151644, 872, 5, 0]
    service = TokenizationService(_RenderReply(ids), SimpleNamespace(name=MODEL, model_path=""))  # type: ignore[arg-type]
    prompt = (await service.tokenize("completions", {"prompt": "x"}, "r")).prompts[0]
    assert prompt.token_ids is prompt.generate_request["token_ids"]
    assert isinstance(prompt.token_ids, array) and prompt.token_ids.itemsize == 4 and list(prompt.token_ids) == ids
    sent = {"request_id": "cmpl-r", "token_ids": ids, "sampling_params": {"max_tokens": 4}}
    assert dumps(prompt.generate_request) == dumps(sent)


async def test_ids_no_four_byte_integer_holds_stay_a_list_for_the_checks_to_refuse() -> None:
    service = TokenizationService(_RenderReply([1, 2**40]), SimpleNamespace(name=MODEL, model_path=""))  # type: ignore[arg-type]
    prompt = (await service.tokenize("completions", {"prompt": "x"}, "r")).prompts[0]
    assert prompt.token_ids == [1, 2**40] and prompt.token_ids is prompt.generate_request["token_ids"]
