"""Fixtures shared by the router tests: the fake upstreams of ``fakes.py`` plus each engine's own
OpenAI API (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/messages``),
a pipeline factory with its own scheduler, breakers and admission, and the leak check.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable

import httpx
import pytest

from catalog.fingerprints import config_vocab_size
from serving.pipeline.engine.client import EngineClient
from serving.pipeline.flow_control.admission import AdmissionSettings, TokenAdmission
from serving.pipeline.metrics import RouterCounters
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Scheduler
from serving.pipeline.render.client import RenderClient
from serving.pipeline.resilience.breaker import BreakerBoard
from serving.pipeline.service import ServingPipeline
from serving.pipeline.snapshot import FleetSnapshot, InstanceView, ModelView
from tests.serving.fakes import MODEL, RENDER_URL, VOCAB_SIZE, FakeUpstreams, SSEBody, fleet_snapshot, instance
from tests.serving.leaks import assert_nothing_held
from tests.serving.loopback import LoopbackClient

NATIVE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def model_dir() -> str:
    path = os.environ.get("MOTOR_MODEL_DIR")
    if not path:
        pytest.fail("MOTOR_MODEL_DIR is not set; run with `python3 -m toolchain exec`", pytrace=False)
    return path


@dataclass
class NativeEngines:
    """The engines' own OpenAI API: records calls, answers a canned body or a relayed stream."""

    calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)  # (host, path, body)
    status: dict[str, int] = field(default_factory=dict)  # by host: answer this status instead
    open_streams: set[str] = field(default_factory=set)
    # The raw chunks a stream sends, cut wherever a test likes; None: one content frame and [DONE].
    stream_chunks: list[bytes] | None = None

    def answer(self, host: str, path: str, body: dict[str, Any]) -> httpx.Response:
        self.calls.append((host, path, body))
        status = self.status.get(host)
        if status is not None:
            return httpx.Response(status, json={"error": {"message": "x", "type": "E", "param": None, "code": status}})
        if body.get("stream"):
            key = f"{host}{path}"
            self.open_streams.add(key)

            chunks = self.stream_chunks or [
                b'data: {"id":"native","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n', b"data: [DONE]\n\n",
            ]

            async def agen() -> AsyncIterator[bytes]:
                for chunk in chunks:
                    yield chunk

            return httpx.Response(
                200, headers={"content-type": "text/event-stream"},
                stream=SSEBody(agen(), lambda: self.open_streams.discard(key)),
            )
        return httpx.Response(200, json={"id": "native", "object": "native", "served_by": host, "path": path})


@dataclass
class Rig:
    upstreams: FakeUpstreams
    native: NativeEngines
    client: LoopbackClient
    scheduler: Scheduler
    counters: RouterCounters

    def pipeline(
        self, snapshot: FleetSnapshot | None = None, *, render_timeout_s: float = 5.0, **kwargs: Any
    ) -> ServingPipeline:
        return ServingPipeline(
            snapshot or fleet_snapshot(), RenderClient(self.client, RENDER_URL, render_timeout_s), EngineClient(self.client),
            self.scheduler, counters=self.counters, **kwargs,
        )


def make_rig(upstreams: FakeUpstreams, *, admission: TokenAdmission | None = None, breakers: BreakerBoard | None = None) -> Rig:
    native = NativeEngines()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path in NATIVE_PATHS and not request.url.path.endswith(("render", "derender")):
            return native.answer(request.url.host.split(".")[0], request.url.path, json.loads(request.content))
        return await upstreams.handler(request)

    client = LoopbackClient(handler)
    scheduler = Scheduler(
        LoadTracker(), breakers=breakers or BreakerBoard(), admission=admission or TokenAdmission(AdmissionSettings())
    )
    return Rig(upstreams, native, client, scheduler, RouterCounters())


async def assert_no_leaks(rig: Rig, before: set[asyncio.Task[Any]]) -> None:
    """Nothing held: load, admission tokens and waiters, open upstream and native streams, stray tasks.

    Closes the rig's client first (``LoopbackClient.aclose`` settles: a stream the pipeline closed
    is closed at the fake once the loopback has seen its connection go), so it ends a test."""
    await rig.client.aclose()
    await assert_nothing_held(rig.scheduler, before, rig.upstreams.open_streams, rig.native.open_streams)


def snapshot_with(*instances: InstanceView, model_path: str | None = None, **render: Any) -> FleetSnapshot:
    snap = fleet_snapshot(*instances)
    if model_path is not None:
        snap = replace(snap, models={MODEL: ModelView(MODEL, model_path, 2048, config_vocab_size(model_path) or VOCAB_SIZE)})
    if render:
        snap = replace(snap, render=replace(snap.render, **render))
    return snap


def engine(name: str, **fields: Any) -> InstanceView:
    return replace(instance(name), **fields)


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], **extra}


def respond(status: int, body: Any) -> Callable[..., httpx.Response]:
    return lambda request, _body: httpx.Response(status, json=body)
