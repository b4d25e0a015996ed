"""The engines' capability probe (``fleet.engine_probes``) against simulated engines over 127.0.0.1,
and what the snapshot makes of its record (``fleet.engine_capabilities.engine_flags``)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from catalog.models import ServedModel
from enginesim.config import SimConfig
from enginesim.testing import LiveServer
from fleet.engine_capabilities import engine_flags, engine_traffic
from fleet.engine_probes import engine_capabilities, probe_engine_capabilities
from fleet.models import EngineInstance, InstanceEvent
from motorsite.core import read_control_version
from serving.snapshots import build_snapshot

ALL_NATIVE = ["chat", "completions", "messages", "responses"]


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, LiveServer]]:
    configs = {
        "ok": SimConfig(),
        "old": SimConfig(version="0.22.1"),
        "nogen": SimConfig(omitted_routes=frozenset({"/inference/v1/generate"})),
        "tokens-only": SimConfig(tokens_only=True),
        "no-messages": SimConfig(omitted_routes=frozenset({"/v1/messages", "/v1/responses"})),
    }
    servers = {name: LiveServer(c) for name, c in configs.items()}
    for s in servers.values():
        s.start()
    yield servers
    for s in servers.values():
        s.stop()


def test_it_reads_version_routes_tokenizer_and_lora_from_the_engine(sims: dict[str, LiveServer]) -> None:
    with httpx.Client(trust_env=False, timeout=5) as c:
        ok = engine_capabilities(c, sims["ok"].url, "tiny")
        assert ok == {"version": "0.32.0", "token_in": True,
                      "routes": {"generate": True, "native": ALL_NATIVE},
                      "tokenizer_loaded": True, "lora": {"enabled": False}}
        assert engine_capabilities(c, sims["old"].url, "tiny")["token_in"] is False
        nogen = engine_capabilities(c, sims["nogen"].url, "tiny")
        assert nogen["token_in"] is False and nogen["routes"]["generate"] is False
        assert engine_capabilities(c, sims["tokens-only"].url, "tiny")["tokenizer_loaded"] is False
        assert engine_capabilities(c, sims["no-messages"].url, "tiny")["routes"]["native"] == ["chat", "completions"]


def test_it_finds_lora_enabled_in_metrics_and_leaves_the_adapters_to_the_lora_probe() -> None:
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.33.0"})
        if request.url.path == "/metrics":
            return httpx.Response(200, text='vllm:lora_requests_info{max_lora="1",running_lora_adapters=""} 1.0\n')
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "tiny", "root": "/m", "parent": None}, {"id": "sql-lora", "root": "/a", "parent": "tiny"}]})
        return httpx.Response(404, json={"detail": "Not Found"})

    with httpx.Client(transport=httpx.MockTransport(answer)) as c:
        caps = engine_capabilities(c, "http://e.test", "tiny")
    # No OpenAPI document and no /tokenize verdict: unknown, not "absent".
    assert caps["routes"] is None and caps["tokenizer_loaded"] is None
    # The adapters are EngineInstance.lora_adapters' alone (fleet.lora_probes reads /v1/models):
    # a second list here would drift from placement's between the two probes' cadences.
    assert caps["lora"] == {"enabled": True}
    assert "/v1/models" not in asked


@pytest.mark.django_db
def test_it_records_each_engine_once_and_the_snapshot_takes_away_what_is_missing(
    sims: dict[str, LiveServer],
) -> None:
    model = ServedModel.objects.create(name="tiny", model_path="/models/tiny")
    for name, sim in sims.items():
        # The operator's record grants everything; the probe may only take away.
        EngineInstance.objects.create(name=name, url=sim.url, served_model=model, cap_token_generate=True,
                                      cap_native_openai=True, cap_tokenizer=True)
    before = build_snapshot()
    assert all(i.token_generate and i.native_openai and i.native_routes is None for i in before.instances)
    version = read_control_version()

    found = probe_engine_capabilities()
    assert set(found) == set(sims) and all(found.values())
    assert read_control_version() > version
    assert InstanceEvent.objects.filter(kind="capabilities").count() == len(sims)
    assert probe_engine_capabilities() == found  # unchanged: no second history row, no bump
    assert InstanceEvent.objects.filter(kind="capabilities").count() == len(sims)

    views = {i.name: i for i in build_snapshot().instances}
    assert views["ok"].token_generate and views["ok"].serves_native("messages") and views["ok"].tokenizer
    assert not views["old"].token_generate and views["old"].serves_native("chat")
    assert not views["nogen"].token_generate
    tokens_only = views["tokens-only"]
    assert tokens_only.token_generate and not tokens_only.tokenizer and not tokens_only.native_openai
    assert views["no-messages"].serves_native("chat") and not views["no-messages"].serves_native("messages")
    assert not views["no-messages"].serves_native("responses")


def test_it_never_grants_what_the_record_withholds() -> None:
    caps = {"version": "0.33.0", "token_in": True, "routes": {"generate": True, "native": ALL_NATIVE},
            "tokenizer_loaded": True}
    flags = engine_flags(caps, token_generate=True, native_openai=False, tokenizer=False)
    assert not flags.native_openai and not flags.tokenizer
    assert engine_flags({}, token_generate=True, native_openai=True, tokenizer=True).native_routes is None
    assert "older than 0.23" in engine_traffic({**caps, "version": "0.22.0", "token_in": False},
                                               token_generate=True, native_openai=False, tokenizer=False)
    assert "tokens-only" in engine_traffic({**caps, "tokenizer_loaded": False},
                                           token_generate=True, native_openai=True, tokenizer=True)


@pytest.mark.django_db
def test_it_runs_in_the_celery_version_probe(sims: dict[str, LiveServer]) -> None:
    from fleet import tasks

    model = ServedModel.objects.create(name="tiny", model_path="/models/tiny")
    EngineInstance.objects.create(name="tokens-only", url=sims["tokens-only"].url, served_model=model)
    out = tasks.probe_versions()
    assert out["capabilities"]["tokens-only"]["tokenizer_loaded"] is False
    assert EngineInstance.objects.get(name="tokens-only").capabilities["version"] == "0.32.0"
