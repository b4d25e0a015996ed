"""The LoRA probe records which adapters each engine loaded (its own /v1/models), the snapshot
carries it, and an adapter's served model is rendered as its base and placed only on holders."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from django.core.management import call_command

from catalog.models import RenderConfig, ServedModel
from fleet import services
from fleet.engine_probes import probe_engine_capabilities
from fleet.lora_probes import loaded_adapters, probe_lora_adapters
from fleet.models import EngineInstance
from motorsite.core import read_control_version
from serving.snapshots import build_snapshot

pytestmark = pytest.mark.django_db


def card(name: str, parent: str | None) -> dict[str, Any]:
    return {"id": name, "object": "model", "root": f"/m/{name}", "parent": parent, "max_model_len": None}


def engines(answers: dict[str, Any]) -> httpx.Client:
    """Engines answering /v1/models by host: a list of cards, or an exception to raise."""

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        found = answers[request.url.host.split(".")[0]]
        if isinstance(found, Exception):
            raise found
        return httpx.Response(200, json={"object": "list", "data": found})

    return httpx.Client(transport=httpx.MockTransport(handler))


@pytest.fixture
def fleet(db: None) -> tuple[ServedModel, ServedModel]:
    RenderConfig.objects.create(name="default", port=8100)
    tiny = ServedModel.objects.create(name="tiny", model_path="/m/tiny", vocab_size=4096)
    lora = ServedModel.objects.create(name="tiny-lora", model_path="/adapters/tiny-lora", base=tiny)
    for name in ("e1", "e2"):
        services.instance_create(actor="t", name=name, url=f"http://{name}.test:1", served_model_id=tiny.id)
    return tiny, lora


def test_loaded_adapters_are_the_cards_whose_parent_is_the_served_model() -> None:
    models = {"data": [card("tiny", None), card("b-lora", "tiny"), card("a-lora", "tiny"), card("x", "other")]}
    assert loaded_adapters(models, "tiny") == ["a-lora", "b-lora"]
    with pytest.raises(ValueError):
        loaded_adapters({"detail": "Not Found"}, "tiny")


def test_the_probe_records_each_engines_adapters_and_bumps_the_version_only_on_change(
    fleet: tuple[ServedModel, ServedModel],
) -> None:
    answers: dict[str, Any] = {"e1": [card("tiny", None), card("tiny-lora", "tiny")], "e2": [card("tiny", None)]}
    before = read_control_version()
    summary = probe_lora_adapters(client=engines(answers))
    assert summary.changed == ["e1"] and summary.probed == 2 and not summary.errors
    assert dict(EngineInstance.objects.values_list("name", "lora_adapters")) == {"e1": ["tiny-lora"], "e2": []}
    after = read_control_version()
    assert after > before
    assert probe_lora_adapters(client=engines(answers)).changed == []
    assert read_control_version() == after
    # An engine that does not answer keeps its record (health is the health probe's verdict).
    answers["e1"] = httpx.ConnectError("refused")
    summary = probe_lora_adapters(client=engines(answers))
    assert "e1" in summary.errors and summary.changed == []
    assert EngineInstance.objects.get(name="e1").lora_adapters == ["tiny-lora"]
    # Unloaded at runtime: the engine no longer holds it.
    answers["e1"] = [card("tiny", None)]
    assert probe_lora_adapters(client=engines(answers)).changed == ["e1"]
    assert EngineInstance.objects.get(name="e1").lora_adapters == []


def test_the_snapshot_serves_an_adapter_as_its_base_on_the_engines_that_hold_it(
    fleet: tuple[ServedModel, ServedModel],
) -> None:
    probe_lora_adapters(client=engines({"e1": [card("tiny", None), card("tiny-lora", "tiny")], "e2": []}))
    snapshot = build_snapshot()
    adapter = snapshot.models["tiny-lora"]
    # Rendered as its base: the base's tokenizer files, vocabulary and render config.
    assert (adapter.base, adapter.model_path, adapter.vocab_size) == ("tiny", "/m/tiny", 4096)
    assert snapshot.render_of("tiny-lora") is snapshot.render_of("tiny")
    assert [i.name for i in snapshot.for_model("tiny-lora").instances] == ["e1"]
    assert [i.name for i in snapshot.for_model("tiny").instances] == ["e1", "e2"]


def test_placement_the_admin_and_the_api_read_one_list_of_adapters(
    fleet: tuple[ServedModel, ServedModel], client: Any,
) -> None:
    """Both probes run against the same engines; what placement, the admin and the API say an
    engine holds is one list, and follows an adapter unloaded at runtime after the LoRA probe alone."""
    holding: dict[str, list[str]] = {"e1": ["tiny-lora"], "e2": []}

    def handler(request: httpx.Request) -> httpx.Response:
        name = request.url.host.split(".")[0]
        if request.url.path == "/v1/models":
            cards = [card("tiny", None), *(card(a, "tiny") for a in holding[name])]
            return httpx.Response(200, json={"object": "list", "data": cards})
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if request.url.path == "/metrics":
            return httpx.Response(200, text="vllm:lora_requests_info 1.0\n")
        return httpx.Response(404, json={"detail": "Not Found"})

    http = httpx.Client(transport=httpx.MockTransport(handler))
    _, key = services.api_key_create(name="ops", scope="admin")

    def said() -> dict[str, Any]:
        api = {i["name"]: i for i in client.get("/api/instances", HTTP_AUTHORIZATION=f"Bearer {key}").json()}
        placed = {i.name: sorted(i.lora_adapters) for i in build_snapshot().instances}
        rows = dict(EngineInstance.objects.values_list("name", "lora_adapters"))
        for name in ("e1", "e2"):
            # The capability record keeps no list of its own to drift from the LoRA probe's.
            assert set(api[name]["capabilities"]["lora"]) == {"enabled"}
            assert api[name]["lora_adapters"] == placed[name] == rows[name]
            assert ("LoRA tiny-lora" in api[name]["traffic"]) == ("tiny-lora" in rows[name])
        return rows

    probe_lora_adapters(client=http)
    probe_engine_capabilities(client=http)
    assert said() == {"e1": ["tiny-lora"], "e2": []}
    holding["e1"] = []  # unloaded at runtime; the capability probe (once a minute) has not run since
    probe_lora_adapters(client=http)
    assert said() == {"e1": [], "e2": []}
    assert [i.name for i in build_snapshot().for_model("tiny-lora").instances] == []


def test_demo_fleet_registers_the_adapters_of_this_run_and_retires_an_earlier_runs(db: None, tmp_path: Any) -> None:
    args = ["--model-dir", "/m/tiny", "--engine", "http://127.0.0.1:1", "--engine-kind", "sim"]
    call_command("demo_fleet", *args, "--lora", "tiny-lora=/adapters/a")
    adapter = ServedModel.objects.get(name="tiny-lora")
    assert (adapter.base.name if adapter.base else None, adapter.model_path, adapter.state) == (
        "tiny", "/adapters/a", "active")
    call_command("demo_fleet", *args)
    assert ServedModel.objects.get(name="tiny-lora").state == "retired"
