"""Celery beat's probe rounds, simulated tick by tick: each engine's /v1/models is read once a
round, and that one answer serves the LoRA adapter record (every round) and the version probe
(once a minute); each engine's /version is read once in the rounds that run the version probe,
and that one answer serves the version and the capability probes."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import httpx
import pytest
from django.db.models import F

from catalog.models import RenderConfig, ServedModel
from fleet import probes, tasks
from fleet.models import EngineInstance, ProbeResult
from fleet.services import instance_create
from motorsite.celery import app

pytestmark = pytest.mark.django_db


def fleet_of_two(monkeypatch: pytest.MonkeyPatch, holding: dict[str, list[str]]) -> Counter[tuple[str, str]]:
    """Engines e1 and e2 and a sidecar answering every probe's client; (engine, path) -> GETs."""
    model = ServedModel.objects.create(name="tiny", model_path="/m/tiny", max_model_len=2048)
    ServedModel.objects.create(name="tiny-lora", model_path="/adapters/tiny-lora", base=model)
    RenderConfig.objects.create(name="default", host="render.test", port=8100)
    for name in ("e1", "e2"):
        instance_create(actor="test", name=name, url=f"http://{name}.test:8201", served_model_id=model.id)
    reads: Counter[tuple[str, str]] = Counter()

    def answer(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host.split(".")[0], request.url.path
        if host in holding and request.method == "GET":  # an engine's (the sidecar's are its own probe's)
            reads[host, path] += 1
        if path == "/v1/models":
            cards = [{"id": "tiny", "object": "model", "root": "/m/tiny", "max_model_len": 2048, "parent": None}]
            cards += [{"id": a, "object": "model", "root": f"/adapters/{a}", "parent": "tiny"} for a in holding.get(host, [])]
            return httpx.Response(200, json={"object": "list", "data": cards})
        if path == "/version":
            return httpx.Response(200, json={"version": "0.33.0" if host == "render" else "0.32.0"})
        if path in ("/inference/v1/generate", "/v1/chat/completions/render"):
            return httpx.Response(200, json={"choices": [{"index": 0, "token_ids": [5]}]})
        return httpx.Response(404, json={"detail": "Not Found"})

    # Every probe of every task makes its client here: only the tiers' answers are canned.
    monkeypatch.setattr(probes, "http_client", lambda: httpx.Client(transport=httpx.MockTransport(answer)))
    return reads


def test_each_beat_tick_reads_each_engines_models_once_for_both_records(
    eager: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    holding: dict[str, list[str]] = {"e1": [], "e2": []}
    reads = fleet_of_two(monkeypatch, holding)
    step = int(tasks.PROBE_INTERVAL_S)
    assert step and 60 % step == 0, "the simulated beat ticks at the default probe interval"
    every = {name: int(entry["schedule"].total_seconds()) for name, entry in tasks.BEAT_SCHEDULE.items()}
    version_ticks = []
    for tick in range(step, 60 + 2 * step, step):  # beat's first run of an entry is one period after start
        if tick == 2 * step:
            holding["e1"] = ["tiny-lora"]  # loaded at runtime
        reads.clear()
        versions = ProbeResult.objects.filter(kind="version", instance__isnull=False).count()
        for name, period in every.items():
            if tick % period == 0:
                app.tasks[tasks.BEAT_SCHEDULE[name]["task"]]()
        models_reads = {host: n for (host, path), n in reads.items() if path == "/v1/models"}
        assert models_reads == {"e1": 1, "e2": 1}, f"/v1/models reads per engine at {tick} s"
        assert EngineInstance.objects.get(name="e1").lora_adapters == holding["e1"]
        if ProbeResult.objects.filter(kind="version", instance__isnull=False).count() > versions:
            version_ticks.append(tick)
        # Time passes: the whole history is one tick older.
        ProbeResult.objects.update(created=F("created") - timedelta(seconds=step))
    # The version probe rode on the first round and on the first a minute later, no other.
    assert version_ticks == [step, step + 60]
    e1 = EngineInstance.objects.get(name="e1")
    assert (e1.reported_version, e1.reported_name, e1.version_drift) == ("0.32.0", "tiny", False)
    assert e1.capabilities["version"] == "0.32.0"



def test_a_version_round_reads_each_engines_version_once_for_both_probes(
    eager: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = fleet_of_two(monkeypatch, {"e1": [], "e2": []})
    step = int(tasks.PROBE_INTERVAL_S)
    for tick in (step, 2 * step):  # the first round runs the version probe, the next does not
        reads.clear()
        tasks.probe_engines()
        version_reads = {host: n for (host, path), n in reads.items() if path == "/version"}
        assert version_reads == ({"e1": 1, "e2": 1} if tick == step else {}), f"/version reads per engine at {tick} s"
    # Both probes recorded from that one answer.
    for name in ("e1", "e2"):
        engine = EngineInstance.objects.get(name=name)
        assert (engine.reported_version, engine.capabilities["version"]) == ("0.32.0", "0.32.0")
    assert ProbeResult.objects.filter(kind="version", instance__isnull=False, ok=True).count() == 2
