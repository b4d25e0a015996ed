"""/v1/responses and /v1/messages through the edge: routed to an engine's own API, relayed as is;
admission refusals carry ``Retry-After``."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

from catalog.models import RenderConfig, ServedModel
from fleet.models import EngineInstance
from serving import runtime, snapshots
from serving.pipeline.errors import QueueFull
from tests.serving.fakes import ENGINE_URLS, MODEL, FakeUpstreams
from tests.serving.loopback import LoopbackClient
from tests.serving.router_fakes import NATIVE_PATHS, NativeEngines

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def fresh_snapshot(settings: Any) -> Iterator[None]:
    settings.MOTOR_API_KEYS = []
    settings.MOTOR_OPEN_ACCESS = True  # open unless a test closes it
    snapshots.invalidate()
    yield
    snapshots.invalidate()
    assert runtime.load.snapshot() == {} and runtime.inflight_tokens() == {}


@pytest.fixture
def native(transactional_db: None, upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch, mock_client: LoopbackClient) -> NativeEngines:
    model = ServedModel.objects.create(name=MODEL, model_path="/models/tiny", max_model_len=2048, vocab_size=151936)
    RenderConfig.objects.create(host="render.test", port=8100, timeout_ms=5000)
    for name, url in ENGINE_URLS.items():
        EngineInstance.objects.create(name=name, url=url, served_model=model, cap_native_openai=True)
    engines = NativeEngines()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path in NATIVE_PATHS:
            return engines.answer(request.url.host.split(".")[0], request.url.path, json.loads(request.content))
        return await upstreams.handler(request)

    mock_client.loopback.handler = handler  # the production client; these engines on 127.0.0.1
    monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: mock_client)
    return engines


def native_only(path: str) -> dict[str, Any]:
    """A body for ``path`` (``/v1/responses`` or ``/v1/messages``) that only an engine's own API can serve."""
    body: dict[str, Any] = {"model": MODEL, "input": "hi", "max_tokens": 5}
    if path == "/v1/messages":  # a stop sequence: these tokens-only engines cannot take it token-only
        body["stop_sequences"] = ["\n"]
    else:  # state only the engine keeps: the Responses API's native path
        body["previous_response_id"] = "resp_native"
    return body


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_it_passes_responses_and_messages_to_an_engines_own_api(
    v1: httpx.AsyncClient, native: NativeEngines, path: str
) -> None:
    body = native_only(path)
    response = await v1.post(path, json=body)
    assert response.status_code == 200
    assert response.json()["path"] == path
    assert [(p, b) for _, p, b in native.calls] == [(path, body)]


async def test_a_streamed_native_answer_is_relayed(
    v1: httpx.AsyncClient, native: NativeEngines, mock_client: LoopbackClient
) -> None:
    body = {"model": MODEL, "input": "hi", "stream": True, "previous_response_id": "resp_native"}  # native
    response = await v1.post("/v1/responses", json=body)
    assert response.status_code == 200 and response.headers["Content-Type"] == "text/event-stream"
    raw = response.content
    assert raw.endswith(b"data: [DONE]\n\n")
    await mock_client.loopback.settle()  # the relay's close reaches the fake engine over its socket
    assert native.open_streams == set()


async def test_engine_controls_in_a_relayed_native_stream_are_nulled(
    v1: httpx.AsyncClient, native: NativeEngines, mock_client: LoopbackClient
) -> None:
    # The engine's bytes, cut mid-frame and mid-key, as a real connection may deliver them.
    leaky = (
        b'data: {"id":"n","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
        b'data: {"id":"n","choices":[],"kv_transfer_params":{"remote_host":"10.0.0.7","remote_port":5600}}\n\n'
        b"data: [DONE]\n\n"
    )
    cut = leaky.index(b"transfer_params")
    native.stream_chunks = [leaky[:cut], leaky[cut:cut + 9], leaky[cut + 9:]]
    body = {"model": MODEL, "input": "hi", "stream": True, "previous_response_id": "resp_native"}  # native
    response = await v1.post("/v1/responses", json=body)
    assert response.status_code == 200 and [p for _, p, _ in native.calls] == ["/v1/responses"]
    assert b"10.0.0.7" not in response.content and b"5600" not in response.content
    events = [json.loads(line[5:]) for line in response.content.split(b"\n\n") if line.startswith(b"data: {")]
    assert events[0]["choices"][0]["delta"]["content"] == "hi"
    assert events[1] == {"id": "n", "choices": [], "kv_transfer_params": None}
    assert response.content.endswith(b"data: [DONE]\n\n")
    await mock_client.loopback.settle()  # the relay's close reaches the fake engine over its socket
    assert native.open_streams == set()


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_on_a_tokens_only_fleet_responses_and_messages_are_a_400_saying_why(
    v1: httpx.AsyncClient, db_upstreams: FakeUpstreams, path: str
) -> None:
    # The database fleet of the fakes: every engine token-only, none with its own OpenAI API.
    body = native_only(path)
    response = await v1.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    # /v1/messages answers in Anthropic's shape (its type by status).
    assert error["type"] == ("invalid_request_error" if path == "/v1/messages" else "BadRequestError")
    assert "its own OpenAI API" in error["message"]
    assert db_upstreams.calls == []


async def test_a_full_admission_queue_is_429_with_retry_after(
    v1: httpx.AsyncClient, native: NativeEngines, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def full(*_: Any) -> Any:
        raise QueueFull("queue full", retry_after_s=2)

    monkeypatch.setattr(runtime.admission, "acquire", full)
    response = await v1.post("/v1/responses", json={"model": MODEL, "input": "x"})
    assert response.status_code == 429 and response.headers["Retry-After"] == "2"
    assert response.json()["error"]["type"] == "RateLimitError"


async def test_admission_with_redis_away_is_503_with_retry_after(
    v1: httpx.AsyncClient, native: NativeEngines, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis.asyncio

    from serving.pipeline.flow_control.admission import AdmissionSettings
    from serving.pipeline.flow_control.redis_admission import RedisTokenAdmission

    gone = redis.asyncio.Redis.from_url("redis://127.0.0.1:1/14", socket_connect_timeout=0.5, socket_timeout=0.5)
    shared = RedisTokenAdmission(gone, AdmissionSettings(retry_after_s=3), prefix="motor:test:gone")
    monkeypatch.setattr(runtime.admission, "acquire", shared.acquire)
    response = await v1.post("/v1/responses", json={"model": MODEL, "input": "x"})
    assert response.status_code == 503 and response.headers["Retry-After"] == "3"
    assert response.json()["error"]["type"] == "ServiceUnavailableError"
    assert native.calls == [] and runtime.admission.inflight_tokens() == {}
    await shared.aclose()
    await gone.aclose()
