"""``/healthz`` checks the render pool of every served model that takes requests, not the first
model's alone: a second model whose sidecars are all down makes ``render`` "down" and is named."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from asgiref.sync import sync_to_async

from catalog.models import RenderConfig, ServedModel
from enginesim.config import SimConfig
from enginesim.testing import LiveServer
from motorsite.supervisor import free_port
from serving import snapshots

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def answering() -> Iterator[LiveServer]:
    """Something on 127.0.0.1 that answers GET /health 200, as a live sidecar does."""
    with LiveServer(SimConfig()) as server:
        yield server


def _fleet(up: int, down: int) -> None:
    a = ServedModel.objects.create(name="model-a", model_path="/m/a")
    b = ServedModel.objects.create(name="model-b", model_path="/m/b")
    c = ServedModel.objects.create(name="model-c", model_path="/m/c", state=ServedModel.State.DRAINING)
    RenderConfig.objects.create(name="a", served_model=a, host="127.0.0.1", port=up)
    RenderConfig.objects.create(name="b", served_model=b, host="127.0.0.1", port=down)
    # A model that takes no requests is not checked: its pool may well be gone.
    RenderConfig.objects.create(name="c", served_model=c, host="127.0.0.1", port=down)


async def test_it_checks_every_served_models_render_pool(v1: httpx.AsyncClient, answering: LiveServer) -> None:
    await sync_to_async(_fleet)(answering.port, free_port())
    snapshots.invalidate()
    try:
        response = await v1.get("/healthz")
    finally:
        snapshots.invalidate()
    assert response.status_code == 200
    body = response.json()
    assert body["render"] == "down"
    assert body["models"] == {"model-a": "up", "model-b": "down"}


async def test_it_says_up_when_every_pool_answers(v1: httpx.AsyncClient, answering: LiveServer) -> None:
    await sync_to_async(_fleet)(answering.port, answering.port)
    snapshots.invalidate()
    try:
        body = (await v1.get("/healthz")).json()
    finally:
        snapshots.invalidate()
    assert body["render"] == "up" and body["models"] == {"model-a": "up", "model-b": "up"}
