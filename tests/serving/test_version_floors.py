"""Issue 33, finding 6: the RFC's version floors act on what the version probe recorded.

Token-in render needs vLLM 0.23, derender 0.24, streaming derender 0.27. Below a floor the
requests it would break take the engines' own OpenAI API (the native path) instead of failing
with a 502 after inference; the admin shows why. Through the real servers (Daphne and uvicorn on
a 127.0.0.1 socket), with the fake sidecar and engines behind them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from django.test import Client

from catalog.models import RenderConfig, ServedModel
from catalog.render_versions import render_traffic
from fleet import probes
from fleet.models import EngineInstance
from serving import runtime, snapshots
from serving.snapshots import build_snapshot
from tests.fleet.test_probes import tiers_answering
from tests.serving.fakes import ENGINE_URLS, MODEL, FakeUpstreams
from tests.serving.loopback import LoopbackClient
from tests.serving.router_fakes import NATIVE_PATHS, NativeEngines, model_dir

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fleet(
    transactional_db: None, upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch, settings: Any,
    mock_client: LoopbackClient,
) -> Iterator[NativeEngines]:
    """Two union engines serving token-only generate and their own OpenAI API, the fake sidecar."""
    settings.MOTOR_API_KEYS = []
    settings.MOTOR_OPEN_ACCESS = True
    model = ServedModel.objects.create(name=MODEL, model_path=model_dir(), max_model_len=2048, vocab_size=151936)
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
    snapshots.invalidate()
    yield engines
    snapshots.invalidate()
    assert runtime.inflight_tokens() == {} and runtime.load.snapshot() == {}


def probed(version: str) -> None:
    """The version probe ran against a sidecar reporting ``version`` (the snapshot follows)."""
    probes.probe_versions(client=tiers_answering(render_version=version))
    # The probe reads the tiny model's vocabulary; the fake sidecar renders Qwen2 ids.
    ServedModel.objects.update(vocab_size=151936)
    snapshots.invalidate()


async def chat(base: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, **extra}
    async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=30) as client:
        return await client.post("/v1/chat/completions", json=body)


def test_the_snapshot_carries_each_floor_the_probe_found(fleet: NativeEngines) -> None:
    assert build_snapshot().render.token_in is True  # nothing probed yet: the deployment's word stands
    cases = {
        "0.22.3": (False, False, False),
        "0.23.1": (True, False, False),
        "0.24.0": (True, True, False),
        "0.27.1": (True, True, True),
    }
    for version, floors in cases.items():
        probed(version)
        render = build_snapshot().render
        assert (render.token_in, render.derender, render.streaming_derender) == floors, version


@pytest.mark.parametrize(("version", "reason"), [("0.22.3", "0.23"), ("0.23.1", "0.24")])
async def test_below_the_token_in_or_derender_floor_a_request_takes_the_native_path(
    served: str, fleet: NativeEngines, upstreams: FakeUpstreams, version: str, reason: str
) -> None:
    from asgiref.sync import sync_to_async

    await sync_to_async(probed)(version)
    response = await chat(served)
    assert response.status_code == 200, response.text
    # The engine's own API answered; no token-only generate, no derender (it would 502 after inference).
    assert [p for _, p, _ in fleet.calls] == ["/v1/chat/completions"]
    assert not [c for c in upstreams.calls if c.kind in ("generate", "derender")]
    if reason == "0.23":
        assert upstreams.calls == []  # no render route to count with either


async def test_a_current_sidecar_keeps_token_only(served: str, fleet: NativeEngines, upstreams: FakeUpstreams) -> None:
    from asgiref.sync import sync_to_async

    await sync_to_async(probed)("0.33.0")
    response = await chat(served)
    assert response.status_code == 200, response.text
    assert fleet.calls == [] and [c.kind for c in upstreams.calls] == ["render", "generate", "derender"]


def test_the_admin_shows_where_the_floors_send_traffic(fleet: NativeEngines, admin_client: Client) -> None:
    assert render_traffic("") == "token-only (version not probed yet)"
    probed("0.23.1")
    cfg = RenderConfig.objects.get()
    page = admin_client.get(f"/admin/serving/renderconfig/{cfg.id}/change/").content.decode()
    assert "native: sidecar vLLM 0.23.1 is older than 0.24 (no derender)" in page
    listing = admin_client.get("/admin/serving/renderconfig/").content.decode()
    assert "older than 0.24" in listing
    dashboard = admin_client.get("/admin/fleet/dashboard/").content.decode()
    assert "older than 0.24 (no derender)" in dashboard
