"""/v1/responses and /v1/messages through the views: routed to an engine's own API, relayed as is;
admission refusals carry ``Retry-After``."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest
from django.test import AsyncClient

from catalog.models import RenderConfig, ServedModel
from fleet.models import EngineInstance
from serving import runtime, snapshots
from serving.pipeline.errors import QueueFull
from tests.serving.fakes import ENGINE_URLS, MODEL, FakeUpstreams
from tests.serving.router_fakes import NATIVE_PATHS, NativeEngines

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def fresh_snapshot(settings: Any) -> Iterator[None]:
    settings.MOTOR_API_KEYS = []
    snapshots.invalidate()
    yield
    snapshots.invalidate()
    assert runtime.load.snapshot() == {} and runtime.inflight_tokens() == {}


@pytest.fixture
def native(transactional_db: None, upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch) -> NativeEngines:
    model = ServedModel.objects.create(name=MODEL, model_path="/models/tiny", max_model_len=2048, vocab_size=151936)
    RenderConfig.objects.create(host="render.test", port=8100, timeout_ms=5000)
    for name, url in ENGINE_URLS.items():
        EngineInstance.objects.create(name=name, url=url, served_model=model, cap_native_openai=True)
    engines = NativeEngines()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path in NATIVE_PATHS:
            return engines.answer(request.url.host.split(".")[0], request.url.path, json.loads(request.content))
        return await upstreams.handler(request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: client)
    return engines


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_it_passes_responses_and_messages_to_an_engines_own_api(
    async_client: AsyncClient, native: NativeEngines, path: str
) -> None:
    body = {"model": MODEL, "input": "hi", "max_tokens": 5}
    response = await async_client.post(path, data=body, content_type="application/json")
    assert response.status_code == 200
    assert response.json()["path"] == path
    assert [(p, b) for _, p, b in native.calls] == [(path, body)]


async def test_a_streamed_native_answer_is_relayed(async_client: AsyncClient, native: NativeEngines) -> None:
    body = {"model": MODEL, "input": "hi", "stream": True}
    response = await async_client.post("/v1/responses", data=body, content_type="application/json")
    assert response.status_code == 200 and response["Content-Type"] == "text/event-stream"
    raw = b"".join([chunk async for chunk in response.streaming_content])
    assert raw.endswith(b"data: [DONE]\n\n")
    assert native.open_streams == set()


async def test_a_full_admission_queue_is_429_with_retry_after(
    async_client: AsyncClient, native: NativeEngines, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def full(*_: Any) -> Any:
        raise QueueFull("queue full", retry_after_s=2)

    monkeypatch.setattr(runtime.admission, "acquire", full)
    response = await async_client.post("/v1/responses", data={"model": MODEL, "input": "x"},
                                       content_type="application/json")
    assert response.status_code == 429 and response["Retry-After"] == "2"
    assert response.json()["error"]["type"] == "RateLimitError"
