"""The composition root hands every pipeline the process's shared objects, so what one request
learns (a render sidecar found down) holds for the next one's fresh pipeline."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace
from typing import Any

import pytest

from serving import runtime
from serving.pipeline import http
from serving.pipeline.errors import NoCapacity
from tests.serving.router_fakes import chat_body, model_dir, snapshot_with

WATCHDOG_S = 10.0


def closed_url() -> str:
    """A 127.0.0.1 address nothing listens on: a connection to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def local_fallbacks(reason: str) -> int:
    return runtime.counters.get("motor_render_outcomes_total", source="local", result="ok", fallback_reason=reason)


async def ask(base_url: str, request_id: str) -> None:
    """One chat through a fresh ``pipeline_for``: tokenized (render or locally), then no engine."""
    # No instances: the request ends with NoCapacity after tokenization, before any engine call.
    snapshot = replace(snapshot_with(model_path=model_dir(), base_url=base_url), instances=())
    with pytest.raises(NoCapacity):
        await runtime.pipeline_for(snapshot).chat(chat_body(max_tokens=3), request_id)


async def test_it_skips_a_render_found_down_in_every_pipeline_of_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # The live-stream reporter (a thread writing each sidecar's count to the database) is not
    # what this test is about: the counts are read from ``sidecar_holds`` directly.
    monkeypatch.setattr(runtime.sidecar_holds, "on_change", lambda: None)
    down, other = closed_url(), closed_url()
    before = {reason: local_fallbacks(reason) for reason in ("unreachable", "render_down")}
    tasks = asyncio.all_tasks()
    try:
        async with asyncio.timeout(WATCHDOG_S):
            await ask(down, "rt1")  # refused: marked down for the process
            await ask(down, "rt2")  # a new pipeline: skipped, straight to the local tokenizer
            await ask(other, "rt3")  # another sidecar's mark is its own: tried, refused
        assert local_fallbacks("unreachable") - before["unreachable"] == 2
        assert local_fallbacks("render_down") - before["render_down"] == 1
        assert runtime.RUNTIME.render_pool.health_of(down).skip() and runtime.RUNTIME.render_pool.health_of(down + "/").skip()
        # Nothing held once the requests are over.
        assert not any(runtime.sidecar_holds.counts().values())
        assert not any(runtime.admission.inflight_tokens().values())
        assert runtime.load.snapshot() == {}
        assert asyncio.all_tasks() == tasks
    finally:
        runtime.RUNTIME.render_health.pop(down, None)
        runtime.RUNTIME.render_health.pop(other, None)
        await http.shared_client().aclose()


async def test_it_builds_one_pipeline_per_snapshot_view_and_settings(settings: Any) -> None:
    snapshot = snapshot_with(model_path=model_dir())
    model = next(iter(snapshot.models))
    first = runtime.pipeline_for(snapshot, model)
    assert runtime.pipeline_for(snapshot, model) is first
    settings.MOTOR_STREAM_CHUNK_TIMEOUT_S = 7.5  # what a test overrides is part of the key
    changed = runtime.pipeline_for(snapshot, model)
    assert changed is not first and changed.stream_settings.chunk_timeout_s == 7.5
    moved = replace(snapshot, version=snapshot.version + 1)  # a new snapshot: a new pipeline
    assert runtime.pipeline_for(moved, model).snapshot is not changed.snapshot
