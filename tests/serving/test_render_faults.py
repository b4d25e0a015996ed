"""Render and derender faults through a real server (Daphne and uvicorn on a 127.0.0.1 socket).

The RFC's fault table, row by row: an unusable render (unreachable, timed out, a 5xx, a missing
route, an answer of the wrong shape) falls back to the local tokenizer, which answers what
render would have (the model's generation defaults; a chat the sidecar's reasoning parser would
split is refused with 503 and ``Retry-After`` rather than answered differently); render's
verdicts on the request (4xx, 413 and 429 included) reach the client; a derender failure ends
the response without a retry unless the operator opted in to a same-chunk retry.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from catalog.models import ModelRevision, RenderConfig, ServedModel
from fleet.models import EngineInstance
from serving import runtime, snapshots
from serving.pipeline.flow_control import rate_limit
from serving.pipeline.flow_control.rate_limit import TokenRateLimiter
from tests.model_variants import GENERATION_DEFAULTS, with_generation_config
from tests.serving.fakes import ENGINE_URLS, MODEL, FakeUpstreams, SSEBody, error_json
from tests.serving.live_edge import error_of
from tests.serving.loopback import LoopbackClient
from tests.serving.router_fakes import model_dir, respond
from tests.serving.test_tokenization import connect_error

pytestmark = pytest.mark.django_db(transaction=True)

CONTEXT = 2048


def make_fleet(upstreams: FakeUpstreams, client: LoopbackClient, monkeypatch: pytest.MonkeyPatch, settings: Any, *,
               model_path: str, reasoning_parser: str = "", tool_parser: str = "") -> None:
    """The fakes' two engines and render sidecar, and a served model whose files are ``model_path``
    (the local fallback reads them) and whose revision records the sidecar's reasoning parser;
    ``client`` (``mock_client``) is the upstream client the server's pipeline uses."""
    settings.MOTOR_API_KEYS = []
    settings.MOTOR_OPEN_ACCESS = True
    model = ServedModel.objects.create(name=MODEL, model_path=model_path, max_model_len=CONTEXT, vocab_size=151936)
    if reasoning_parser or tool_parser:
        model.active_revision = ModelRevision.objects.create(
            served_model=model, reasoning_parser=reasoning_parser, tool_parser=tool_parser,
        )
        model.save()
    RenderConfig.objects.create(host="render.test", port=8100, timeout_ms=5000)
    for name, url in ENGINE_URLS.items():
        EngineInstance.objects.create(name=name, url=url, served_model=model)
    # The production client (``Http11Client``), the fakes on 127.0.0.1 (``loopback.py``): a
    # derender the client failed on is a request the fake sidecar really received.
    monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: client)
    monkeypatch.setattr(rate_limit, "LIMITER", TokenRateLimiter())
    snapshots.invalidate()


@pytest.fixture
def fleet(transactional_db: None, upstreams: FakeUpstreams, mock_client: LoopbackClient, monkeypatch: pytest.MonkeyPatch,
          settings: Any) -> Iterator[FakeUpstreams]:
    make_fleet(upstreams, mock_client, monkeypatch, settings, model_path=model_dir())
    yield upstreams
    snapshots.invalidate()


@pytest.fixture
def variant_fleet(transactional_db: None, upstreams: FakeUpstreams, mock_client: LoopbackClient,
                  monkeypatch: pytest.MonkeyPatch, settings: Any, tmp_path: Path) -> Iterator[FakeUpstreams]:
    """The fleet serving the tiny model with a generation_config.json that sets sampling defaults."""
    make_fleet(upstreams, mock_client, monkeypatch, settings, model_path=str(with_generation_config(model_dir(), tmp_path / "tiny-gen")))
    yield upstreams
    snapshots.invalidate()


@pytest.fixture(params=[("qwen3", ""), ("", "hermes")], ids=["reasoning-parser", "tool-parser"])
def parser_fleet(request: pytest.FixtureRequest, transactional_db: None, upstreams: FakeUpstreams,
                 mock_client: LoopbackClient, monkeypatch: pytest.MonkeyPatch, settings: Any) -> Iterator[FakeUpstreams]:
    """The fleet with a sidecar that runs a parser (recorded in the model's revision)."""
    reasoning, tool = request.param
    make_fleet(upstreams, mock_client, monkeypatch, settings, model_path=model_dir(), reasoning_parser=reasoning, tool_parser=tool)
    yield upstreams
    snapshots.invalidate()


async def post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=30) as client:
        return await client.post(path, json=body)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], **extra}


def assert_nothing_held() -> None:
    assert runtime.inflight_tokens() == {}
    assert runtime.load.snapshot() == {}


def bare(status: int) -> Callable[..., httpx.Response]:
    """An answer without an OpenAI error body (a proxy's, say): only the status says anything."""
    return lambda request, _body: httpx.Response(status)


# -- render: what falls back, what is kept --------------------------------------------------------


@pytest.mark.parametrize(("status", "answer"), [
    (413, respond(413, error_json(413, "Request body too large", "RequestEntityTooLarge"))),
    (413, bare(413)),  # from a proxy in front of the sidecar
    (429, respond(429, error_json(429, "Too many requests", "TooManyRequests"))),
    (400, bare(400)),  # a 400 without an OpenAI body still keeps its status, in the right shape
], ids=["413", "413-bare", "429", "400-bare"])
async def test_render_413_and_429_keep_their_error(
    served: str, fleet: FakeUpstreams, status: int, answer: Callable[..., httpx.Response]
) -> None:
    fleet.override("render", "render", answer)
    error = error_of(await post(served, "/v1/chat/completions", chat(max_tokens=4)), status)
    assert error["message"]
    assert len(fleet.calls_of("render")) == 1 and fleet.calls_of("generate") == []  # no local fallback
    assert_nothing_held()


@pytest.mark.parametrize("status", [500, 502, 503])
async def test_a_render_5xx_falls_back(served: str, fleet: FakeUpstreams, status: int) -> None:
    fleet.override("render", "render", respond(status, error_json(status, "boom", "InternalServerError")))
    response = await post(served, "/v1/chat/completions", chat(max_tokens=4))
    assert response.status_code == 200, response.text
    assert len(fleet.calls_of("generate")) == 1 and fleet.calls_of("derender") == []  # tokenized and derendered locally
    assert_nothing_held()


@pytest.mark.parametrize("broken", [
    lambda r: {k: v for k, v in r.items() if k != "request_id"},
    lambda r: {**r, "request_id": None},
    lambda r: {k: v for k, v in r.items() if k != "sampling_params"},
], ids=["no-request-id", "null-request-id", "no-sampling-params"])
async def test_a_render_answer_of_the_wrong_shape_falls_back(
    served: str, fleet: FakeUpstreams, broken: Callable[[dict[str, Any]], dict[str, Any]]
) -> None:
    def answer(request: httpx.Request, body: Any) -> httpx.Response:
        good = json.loads(fleet._render(request, body).content)
        return httpx.Response(200, json=broken(good))

    fleet.override("render", "render", answer)
    response = await post(served, "/v1/chat/completions", chat(max_tokens=4))
    assert response.status_code == 200, response.text
    (generate,) = fleet.calls_of("generate")
    assert generate.body["request_id"].startswith("chatcmpl-")  # the local fallback's request
    assert_nothing_held()


# -- the local fallback answers what render would have --------------------------------------------


async def test_the_fallback_applies_the_models_generation_defaults(served: str, variant_fleet: FakeUpstreams) -> None:
    upstreams = variant_fleet
    upstreams.override("render", "render", connect_error)

    async def params(path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await post(served, path, body)
        assert response.status_code == 200, response.text
        return dict(upstreams.calls_of("generate")[-1].body["sampling_params"])

    silent = await params("/v1/chat/completions", chat())
    expected = {k: GENERATION_DEFAULTS[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty")}
    assert {k: silent[k] for k in expected} == expected
    assert silent["max_tokens"] == GENERATION_DEFAULTS["max_new_tokens"]  # vLLM: the default bounds an omitted max_tokens
    assert (await params("/v1/chat/completions", chat(max_tokens=None)))["max_tokens"] == GENERATION_DEFAULTS["max_new_tokens"]
    # The request's own values win, zero included.
    explicit = await params("/v1/chat/completions", chat(temperature=0.8, top_k=-1, min_p=0, max_tokens=3))
    assert (explicit["temperature"], explicit["top_k"], explicit["min_p"], explicit["max_tokens"]) == (0.8, -1, 0.0, 3)
    assert explicit["top_p"] == GENERATION_DEFAULTS["top_p"]
    # Greedy turns the other knobs off, as vLLM's SamplingParams does, the model's defaults included.
    greedy = await params("/v1/chat/completions", chat(temperature=0))
    assert (greedy["temperature"], greedy["top_p"], greedy["top_k"], greedy["min_p"]) == (0.0, 1.0, 0, 0.0)
    # Completions: a missing or null max_tokens is the schema's 16 (vLLM's normalize_null_max_tokens).
    assert (await params("/v1/completions", {"model": MODEL, "prompt": "def f"}))["max_tokens"] == 16
    nulled = await params("/v1/completions", {"model": MODEL, "prompt": "def f", "max_tokens": None})
    assert nulled["max_tokens"] == 16 and nulled["temperature"] == GENERATION_DEFAULTS["temperature"]
    assert_nothing_held()


async def test_a_chat_the_sidecar_would_parse_is_refused_not_answered_differently(
    served: str, parser_fleet: FakeUpstreams
) -> None:
    upstreams = parser_fleet
    # Render up: served as always (the parser runs in render's derender).
    assert (await post(served, "/v1/chat/completions", chat(max_tokens=4))).status_code == 200
    generated = len(upstreams.calls_of("generate"))

    upstreams.override("render", "render", connect_error)
    response = await post(served, "/v1/chat/completions", chat(max_tokens=4))
    error = error_of(response, 503)
    assert response.headers["retry-after"] == "5"
    assert error["type"] == "ServiceUnavailableError" and "reasoning or tool parser" in error["message"]
    assert len(upstreams.calls_of("generate")) == generated  # nothing ran on an engine
    # Completions are never parsed: the fallback serves them.
    answered = await post(served, "/v1/completions", {"model": MODEL, "prompt": "def f", "max_tokens": 3})
    assert answered.status_code == 200, answered.text
    assert_nothing_held()


# -- derender: no automatic retry unless the operator opts in --------------------------------------


def failing_call(upstreams: FakeUpstreams, number: int, fault: Callable[..., httpx.Response]) -> Callable[..., httpx.Response]:
    """Derender as the fakes do, except call ``number`` (1-based), which meets ``fault``; the
    engine's stream holds after its first event until the first derender call arrives
    (``first_event_alone``), so call 2 is the rest of the answer however the reads fall."""
    seen = [0]
    first = asyncio.Event()
    for engine in ENGINE_URLS:
        upstreams.override(engine, "generate", first_event_alone(upstreams, first))

    def answer(request: httpx.Request, body: Any) -> httpx.Response:
        seen[0] += 1
        first.set()
        if seen[0] == number:
            return fault(request, body)
        return upstreams._derender(request, body)

    return answer


def first_event_alone(upstreams: FakeUpstreams, resume: asyncio.Event) -> Callable[..., httpx.Response]:
    """The fake engine's stream, paused after its first event until ``resume``: over a socket the
    pipeline may find every event queued and derender them in one call."""
    def generate(request: httpx.Request, body: Any) -> httpx.Response:
        response = upstreams._generate(request, body)
        inner = response.stream
        assert isinstance(inner, SSEBody)

        async def pieces() -> AsyncIterator[bytes]:
            events = 0
            try:
                async for piece in inner:
                    yield piece
                    events += piece.count(b"\n\n")
                    if events == 1:
                        await resume.wait()
            finally:
                await inner.aclose()

        return httpx.Response(200, headers=response.headers, stream=SSEBody(pieces(), lambda: None))

    return generate


async def read_stream(base: str, body: dict[str, Any]) -> tuple[int, str]:
    async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=30) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            return response.status_code, (await response.aread()).decode()


FAULTS = [connect_error, respond(500, error_json(500, "boom", "InternalServerError"))]


@pytest.mark.parametrize("fault", FAULTS, ids=["connect", "500"])
async def test_a_failed_chunk_derender_ends_the_stream_without_a_retry(
    served: str, fleet: FakeUpstreams, fault: Callable[..., httpx.Response]
) -> None:
    fleet.override("render", "derender", failing_call(fleet, 2, fault))
    status, text = await read_stream(served, chat(max_tokens=8, stream=True))
    assert status == 200 and text.endswith("data: [DONE]\n\n")
    frames = [json.loads(f[6:]) for f in text.split("\n\n") if f.startswith("data: {")]
    assert "error" in frames[-1] and frames[-1]["error"]["code"] == 502
    assert len(fleet.calls_of("derender")) == 2  # the failed chunk was not sent again
    assert len(fleet.calls_of("generate")) == 1  # and inference was not re-run
    assert_nothing_held()


@pytest.mark.parametrize("fault", FAULTS, ids=["connect", "500"])
async def test_an_opted_in_retry_derenders_the_same_chunk_with_the_same_state(
    served: str, fleet: FakeUpstreams, fault: Callable[..., httpx.Response], settings: Any
) -> None:
    settings.MOTOR_DERENDER_CHUNK_RETRIES = 1
    snapshots.invalidate()
    fleet.override("render", "derender", failing_call(fleet, 2, fault))
    status, text = await read_stream(served, chat(max_tokens=8, stream=True))
    assert status == 200 and '"error"' not in text and text.endswith("data: [DONE]\n\n")
    ders = fleet.calls_of("derender")
    assert ders[1].body == ders[2].body  # the same chunk, the same previous state
    assert len(fleet.calls_of("generate")) == 1
    assert_nothing_held()
