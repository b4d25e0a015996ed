"""Issue 31, finding 7 and two of finding 9, through the real servers (Daphne and uvicorn on a
127.0.0.1 socket, ``live_edge``): every native-path request is validated like the token-only
path, charged (admission and tokens per minute alike) its prompt tokens plus the output bound its
engine will really resolve, and its JSON reply's deadline scales with that bound; mistyped
sampling fields are vLLM's schema 400 on every path, the local-tokenizer fallback included, and
``"stream": "false"`` is false, as vLLM 0.33 reads it. After every request, refused or served,
nothing is held: admission tokens, load, and for a refusal the key's window too.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from asgiref.sync import sync_to_async

from catalog.models import RenderConfig, ServedModel
from fleet.models import EngineInstance
from fleet.services import api_key_create
from serving import runtime, snapshots
from serving.pipeline.flow_control import rate_limit
from serving.pipeline.flow_control.rate_limit import TokenRateLimiter
from tests.serving.fakes import CHAT_PROMPT, ENGINE_URLS, MODEL, FakeUpstreams
from tests.serving.live_edge import error_of
from tests.serving.loopback import LoopbackClient
from tests.serving.router_fakes import NATIVE_PATHS, NativeEngines, model_dir
from tests.serving.test_tokenization import connect_error

pytestmark = pytest.mark.django_db(transaction=True)

CONTEXT = 2048  # the served model's max_model_len
PROMPT = len(CHAT_PROMPT)  # what the fake render sidecar renders a chat, a response or a message to


class Observed(NativeEngines):
    """The engines' own API, also noting what the coordinator held while each call ran."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[dict[str, int]] = []  # admission tokens per instance while the engine ran

    def observe(self) -> None:
        self.held.append(runtime.inflight_tokens())


class DeadlineSpy(LoopbackClient):
    """The production client (the fakes on 127.0.0.1), noting the deadline it reads each native
    reply under: the client's ``deadline`` is the write's loop time plus the reply's timeout."""

    def __init__(self, handler: Any) -> None:
        super().__init__(handler)
        # The reply timeout of each native call, bracketed: (deadline - after, deadline - before).
        self.reply_timeouts: list[tuple[float, float]] = []

    async def _exchange(self, method: str, url: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        before = loop.time()
        origin, conn, deadline = await super()._exchange(method, url, *args)
        if urlsplit(url).path in NATIVE_PATHS:
            self.reply_timeouts.append((deadline - loop.time(), deadline - before))
        return origin, conn, deadline


@pytest.fixture
async def spy(upstreams: FakeUpstreams) -> AsyncIterator[DeadlineSpy]:
    client = DeadlineSpy(upstreams.handler)
    yield client
    await client.aclose()


@pytest.fixture
def fleet(transactional_db: None, upstreams: FakeUpstreams, spy: DeadlineSpy, monkeypatch: pytest.MonkeyPatch,
          settings: Any) -> Iterator[Observed]:
    """Two union engines serving their own OpenAI API and token-only generate, no tokenizer (stop
    strings go native), the fake render sidecar, and the model's files for the local fallback;
    the server's pipeline reaches them with the production client (``spy``) over 127.0.0.1."""
    settings.MOTOR_API_KEYS = []
    settings.MOTOR_OPEN_ACCESS = True
    model = ServedModel.objects.create(name=MODEL, model_path=model_dir(), max_model_len=CONTEXT, vocab_size=151936)
    RenderConfig.objects.create(host="render.test", port=8100, timeout_ms=5000)
    for name, url in ENGINE_URLS.items():
        EngineInstance.objects.create(name=name, url=url, served_model=model, cap_native_openai=True)
    engines = Observed()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path in NATIVE_PATHS:
            engines.observe()
            return engines.answer(request.url.host.split(".")[0], request.url.path, json.loads(request.content))
        return await upstreams.handler(request)

    spy.loopback.handler = handler
    monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: spy)
    monkeypatch.setattr(rate_limit, "LIMITER", TokenRateLimiter())
    snapshots.invalidate()
    yield engines
    snapshots.invalidate()


def assert_nothing_held() -> None:
    assert runtime.inflight_tokens() == {}
    assert runtime.load.snapshot() == {}


async def limited_key(tokens_per_minute: int) -> tuple[str, str]:
    """A client key with a tokens-per-minute limit: (the key, its window's id: per served model)."""
    _, key = await sync_to_async(api_key_create)(name=f"tpm-{tokens_per_minute}", scope="client",
                                                 tokens_per_minute=tokens_per_minute)
    snapshots.invalidate()
    return key, f"{hashlib.sha256(key.encode()).hexdigest()}:{MODEL}"


async def post(base: str, path: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=30) as client:
        return await client.post(path, json=body, headers=headers)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], **extra}


def response_body(**extra: Any) -> dict[str, Any]:
    # previous_response_id needs state only the engine keeps: the Responses API's native path.
    return {"model": MODEL, "input": "hi", "previous_response_id": "resp_native", **extra}


def message(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}


# -- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/responses", response_body(n="abc")),
    ("/v1/messages", message(n="abc")),
    ("/v1/chat/completions", chat(n="abc", stop=["\n"])),  # native too (stop strings, no tokenizer)
])
async def test_n_of_the_wrong_type_is_vllms_schema_400_on_every_api(
    served: str, fleet: Observed, path: str, body: dict[str, Any]
) -> None:
    error = error_of(await post(served, path, body), 400)
    if path == "/v1/messages":  # Anthropic's shape: the type by status, no param
        assert error["type"] == "invalid_request_error" and "body.n" in error["message"]
    else:
        assert error["type"] == "Bad Request" and error["param"] == "body.n"
    assert error["message"].startswith("1 validation error:") and "int_parsing" in error["message"]
    assert fleet.calls == []
    assert_nothing_held()


@pytest.mark.parametrize(("path", "body", "field", "kind"), [
    ("/v1/responses", response_body(temperature="hot"), "temperature", "float_parsing"),
    ("/v1/messages", message(stream="maybe"), "stream", "bool_parsing"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": "loud"}, "echo", "bool_parsing"),
])
async def test_mistyped_fields_on_the_native_apis_are_vllms_schema_400(
    served: str, fleet: Observed, path: str, body: dict[str, Any], field: str, kind: str
) -> None:
    error = error_of(await post(served, path, body), 400)
    assert kind in error["message"]
    if path == "/v1/messages":  # Anthropic's shape: the type by status, no param
        assert error["type"] == "invalid_request_error"
    else:
        assert error["type"] == "Bad Request" and error["param"] == f"body.{field}"
    assert fleet.calls == []
    assert_nothing_held()


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_a_huge_n_cannot_reserve_an_instance(served: str, fleet: Observed, settings: Any, path: str) -> None:
    key, window = await limited_key(10**9)
    body = (response_body if path == "/v1/responses" else message)(n=16384, max_completion_tokens=2048)
    error = error_of(await post(served, path, body, key), 400)
    assert error["param"] == ("n" if path == "/v1/responses" else None) and f"limit of {settings.MOTOR_MAX_CHOICES} choices" in error["message"]
    assert fleet.calls == [] and fleet.held == []
    assert rate_limit.LIMITER.used(window) == 0
    assert_nothing_held()


@pytest.mark.parametrize(("field", "value", "kind"), [
    ("temperature", "hot", "float_parsing"),
    ("top_p", "most", "float_parsing"),
    ("presence_penalty", [1], "float_type"),
    ("top_k", "x", "int_parsing"),
    ("seed", "x", "int_parsing"),
    ("min_tokens", "1.5", "int_parsing"),
    ("ignore_eos", "maybe", "bool_parsing"),
    ("stream", "hot", "bool_parsing"),
])
async def test_mistyped_sampling_fields_through_the_local_fallback_are_vllms_400(
    served: str, fleet: Observed, upstreams: FakeUpstreams, field: str, value: Any, kind: str
) -> None:
    upstreams.override("render", "render", connect_error)  # render unreachable: the local tokenizer serves
    error = error_of(await post(served, "/v1/chat/completions", chat(max_tokens=4, **{field: value})), 400)
    assert error["type"] == "Bad Request" and error["param"] == f"body.{field}"
    assert error["message"].startswith("1 validation error:") and kind in error["message"]
    assert upstreams.calls_of("generate") == [] and fleet.calls == []
    assert_nothing_held()


async def test_sampling_fields_in_another_spelling_are_read_as_vllm_reads_them_by_the_local_fallback(
    served: str, fleet: Observed, upstreams: FakeUpstreams
) -> None:
    upstreams.override("render", "render", connect_error)
    body = chat(max_tokens=4, temperature="0.5", top_k="3", ignore_eos="false")
    response = await post(served, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    (generate,) = upstreams.calls_of("generate")
    params = generate.body["sampling_params"]
    assert (params["temperature"], params["top_k"], params["ignore_eos"]) == (0.5, 3, False)
    assert_nothing_held()


@pytest.mark.parametrize("spelling", ["false", "0", "off"])
async def test_stream_false_as_a_string_is_false_as_vllm_reads_it(
    served: str, fleet: Observed, upstreams: FakeUpstreams, spelling: str
) -> None:
    response = await post(served, "/v1/chat/completions", chat(max_tokens=4, stream=spelling))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json()["object"] == "chat.completion"
    (generate,) = upstreams.calls_of("generate")
    assert generate.body["stream"] is False  # not a stream the client never asked for
    # The native path passes the body on as vLLM reads it.
    answer = await post(served, "/v1/responses", response_body(stream=spelling))
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    assert fleet.calls[-1][2]["stream"] is False
    assert_nothing_held()


# -- accounting ------------------------------------------------------------------------------------

# (path, body, tokens held = prompt + n x the output bound vLLM resolves, output bound per choice)
ESTIMATES = [
    # The Responses schema has no max_tokens: the engine generates up to the context.
    pytest.param("/v1/responses", response_body(max_tokens=1), CONTEXT, CONTEXT - PROMPT, id="responses-max_tokens"),
    pytest.param("/v1/responses", response_body(max_output_tokens=50), PROMPT + 50, 50, id="responses"),
    # Nor an n: one sequence, whatever n says.
    pytest.param("/v1/responses", response_body(n=100, max_completion_tokens=2048), CONTEXT, CONTEXT - PROMPT,
                 id="responses-n"),
    # (A stop sequence keeps it native here: the engines are tokens-only.)
    pytest.param("/v1/messages", message(max_tokens=50, stop_sequences=["\n"]), PROMPT + 50, 50, id="messages"),
    pytest.param("/v1/chat/completions", chat(stop=["\n"], max_tokens=7, n=3), PROMPT + 21, 7, id="chat"),
    pytest.param("/v1/chat/completions", chat(stop=["\n"], n=2), PROMPT + 2 * (CONTEXT - PROMPT), CONTEXT - PROMPT,
                 id="chat-to-the-context"),
]


@pytest.mark.parametrize(("path", "body", "tokens", "output"), ESTIMATES)
async def test_a_native_request_is_charged_its_prompt_and_the_output_bound_its_engine_resolves(
    served: str, fleet: Observed, spy: DeadlineSpy, settings: Any, path: str, body: dict[str, Any], tokens: int,
    output: int,
) -> None:
    key, window = await limited_key(10**7)
    response = await post(served, path, body, key)
    assert response.status_code == 200, response.text
    assert fleet.held == [{"e1": tokens}]  # admission, while the engine ran
    assert rate_limit.LIMITER.used(window) == tokens  # the key's window, the same estimate
    # The JSON reply may take as long as the token-only path gives the same bound (ReplyDeadline):
    # the deadline the production client read the engine's reply under.
    expected = settings.MOTOR_ENGINE_READ_TIMEOUT_S + settings.MOTOR_ENGINE_REPLY_S_PER_TOKEN * output
    ((low, high),) = spy.reply_timeouts
    assert low - 1e-6 <= expected <= high + 1e-6, (low, expected, high)
    assert_nothing_held()


def faithful_render(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    """The sidecar's completions render for token-id prompts: the ids as given."""
    prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
    return httpx.Response(200, json=[
        {"request_id": f"cmpl-{i}", "token_ids": p, "sampling_params": {"max_tokens": body.get("max_tokens")}}
        for i, p in enumerate(prompts)
    ])


async def test_echo_counts_its_prompt_against_admission_and_the_key(
    served: str, fleet: Observed, upstreams: FakeUpstreams
) -> None:
    upstreams.override("render", "render", faithful_render)
    body = {"model": MODEL, "prompt": [1000] * 1500, "echo": True, "max_tokens": 0}
    small, small_window = await limited_key(1000)
    error = error_of(await post(served, "/v1/completions", body, small), 429)
    assert error["type"] == "RateLimitError"
    assert fleet.calls == [] and rate_limit.LIMITER.used(small_window) == 0
    assert_nothing_held()
    big, big_window = await limited_key(10**6)
    response = await post(served, "/v1/completions", body, big)
    assert response.status_code == 200, response.text
    assert fleet.held == [{"e1": 1500 + 1}]  # echo without generation: vLLM still runs one step
    assert rate_limit.LIMITER.used(big_window) == 1500 + 1
    assert_nothing_held()


async def test_without_render_the_prompt_is_bounded_by_the_bodys_size(
    served: str, fleet: Observed, upstreams: FakeUpstreams
) -> None:
    await sync_to_async(RenderConfig.objects.update)(enable=False)
    snapshots.invalidate()
    body = chat(max_tokens=5)  # render disabled: the native path serves every chat
    response = await post(served, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert upstreams.calls == []  # no render was asked
    (seen,) = fleet.calls
    size = len(json.dumps(seen[2], ensure_ascii=False).encode())  # the body's bytes: errs high
    assert fleet.held == [{"e1": size + 5}]
    assert_nothing_held()
