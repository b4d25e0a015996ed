"""Several served models in the control plane: each with its own render config, added, drained,
retired and activated through the REST API, and the snapshot the data plane reads from them."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import IntegrityError
from django.test import Client

from catalog.models import RenderConfig, ServedModel
from fleet import services
from motorsite.core import read_control_version
from serving.pipeline.snapshot import ScorerWeights
from serving.snapshots import build_snapshot

pytestmark = pytest.mark.django_db


@pytest.fixture
def api(client: Client) -> Client:
    client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {services.api_key_create(name='ops', scope='admin')[1]}"
    return client


def post(api: Client, path: str, data: Any = None) -> Any:
    return api.post(path, data=data, content_type="application/json")


def test_a_model_added_with_its_own_render_config_gets_its_own_sidecar_in_the_snapshot(api: Client) -> None:
    RenderConfig.objects.create(name="default", port=8100)  # the first model's (linked to none)
    ServedModel.objects.create(name="tiny", model_path="/models/tiny")
    before = read_control_version()
    response = post(api, "/api/models", {
        "name": "tiny-b", "model_path": "/models/tiny-b", "max_model_len": 1024,
        "render_config": {"endpoint": {"host": "127.0.0.1", "port": 8105}, "timeout_ms": 700},
    })
    assert response.status_code == 201, response.content
    assert response.json()["render_config"] == "tiny-b" and response.json()["state"] == "active"
    assert read_control_version() > before
    snapshot = build_snapshot()
    assert snapshot.render_of("tiny").base_url == "http://127.0.0.1:8100"
    assert snapshot.render_of("tiny-b").base_url == "http://127.0.0.1:8105"
    assert snapshot.render_of("tiny-b").timeout_s == 0.7
    # A request's view holds its model's render config and nothing of the other model.
    view = snapshot.for_model("tiny-b")
    assert view.render.base_url == "http://127.0.0.1:8105" and list(view.models) == ["tiny-b"]


def test_a_model_whose_only_render_configs_belong_to_others_never_gets_theirs(db: None) -> None:
    a = ServedModel.objects.create(name="a", model_path="/m/a")
    ServedModel.objects.create(name="b", model_path="/m/b")
    RenderConfig.objects.create(name="a", port=8100, served_model=a)
    snapshot = build_snapshot()
    assert snapshot.render_of("a").enable and snapshot.render_of("a").base_url == "http://127.0.0.1:8100"
    assert not snapshot.render_of("b").enable  # native path on b's own engines, never a's sidecar
    assert snapshot.render_of("b").base_url == ""


def test_the_view_of_a_model_holds_only_its_instances(db: None) -> None:
    a = ServedModel.objects.create(name="a", model_path="/m/a")
    b = ServedModel.objects.create(name="b", model_path="/m/b")
    services.instance_create(actor="t", name="a1", url="http://a1.test:1", served_model_id=a.id)
    services.instance_create(actor="t", name="b1", url="http://b1.test:1", served_model_id=b.id)
    snapshot = build_snapshot()
    assert [i.name for i in snapshot.for_model("a").instances] == ["a1"]
    assert [i.name for i in snapshot.for_model("b").instances] == ["b1"]


def test_drain_retire_and_activate_move_the_state_and_bump_the_version(api: Client) -> None:
    ServedModel.objects.create(name="tiny", model_path="/models/tiny")
    for action, state in (("drain", "draining"), ("retire", "retired"), ("activate", "active")):
        before = read_control_version()
        response = post(api, f"/api/models/tiny/{action}")
        assert response.status_code == 200 and response.json()["state"] == state
        assert read_control_version() > before
        assert build_snapshot().models["tiny"].state == state
    assert api.get("/api/models").json()[0]["name"] == "tiny"


def test_unknown_and_duplicate_models_are_404_and_409(api: Client) -> None:
    assert post(api, "/api/models/nope/drain").status_code == 404
    assert api.get("/api/models/nope").status_code == 404
    body = {"name": "tiny", "model_path": "/m/tiny"}
    assert post(api, "/api/models", body).status_code == 201
    assert post(api, "/api/models", body).status_code == 409


def test_a_render_config_of_a_new_model_breaking_a_rule_is_422(api: Client) -> None:
    response = post(api, "/api/models", {"name": "x", "model_path": "/m/x", "render_config": {"obfuscation": True}})
    assert response.status_code == 422
    assert not ServedModel.objects.filter(name="x").exists()


def test_the_pool_probe_renders_each_models_sidecar_with_its_own_model_name(db: None) -> None:
    import json

    import httpx

    from catalog.models import RenderSidecar
    from fleet.render_pool_probes import probe_render_pool

    a = ServedModel.objects.create(name="tiny", model_path="/m/a")
    b = ServedModel.objects.create(name="tiny-b", model_path="/m/b")
    for model, port in ((a, 8100), (b, 8101)):
        config = RenderConfig.objects.create(name=model.name, port=port, served_model=model)
        RenderSidecar.objects.create(render_config=config, host="127.0.0.1", port=port)
    knows = {8100: "tiny", 8101: "tiny-b"}  # each sidecar serves only its own model's name

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.33.0"})
        if request.url.path == "/openapi.json":
            return httpx.Response(200, json={"paths": {}})
        if json.loads(request.content)["model"] != knows[request.url.port]:
            return httpx.Response(404, json={"error": {"message": "model not found"}})
        return httpx.Response(200, json={"token_ids": [1]})

    outcomes = probe_render_pool(client=httpx.Client(transport=httpx.MockTransport(handler)))
    assert outcomes == {"http://127.0.0.1:8100": True, "http://127.0.0.1:8101": True}


def patch(api: Client, path: str, data: Any) -> Any:
    return api.patch(path, data=data, content_type="application/json")


def test_scorer_weights_set_through_the_api_reach_the_snapshot(api: Client) -> None:
    ServedModel.objects.create(name="tiny", model_path="/models/tiny")
    assert build_snapshot().models["tiny"].scorer_weights == ScorerWeights(prefix=1.0, queue=0.0, tokens=0.0)
    before = read_control_version()
    response = patch(api, "/api/models/tiny", {"prefix_weight": 0, "queue_weight": 2.5})
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["prefix_weight"], body["queue_weight"], body["tokens_weight"]) == (0.0, 2.5, 0.0)
    assert read_control_version() > before  # every coordinator rebuilds its snapshot within one poll
    assert build_snapshot().models["tiny"].scorer_weights == ScorerWeights(prefix=0.0, queue=2.5, tokens=0.0)
    assert api.get("/api/models/tiny").json()["queue_weight"] == 2.5


@pytest.mark.parametrize("body", [
    {"queue_weight": -1}, {"prefix_weight": 100.5}, {"tokens_weight": "1"}, {"tokens_weight": None},
    {"affinity_weight": 1},
], ids=["negative", "above-100", "string", "null", "unknown"])
def test_a_scorer_weight_out_of_range_is_422_and_changes_nothing(api: Client, body: dict[str, Any]) -> None:
    ServedModel.objects.create(name="tiny", model_path="/models/tiny")
    before = read_control_version()
    response = patch(api, "/api/models/tiny", body)
    assert response.status_code == 422, response.content
    assert read_control_version() == before
    assert ServedModel.objects.values_list("prefix_weight", "queue_weight", "tokens_weight").get() == (1.0, 0.0, 0.0)


def test_weighing_an_unknown_model_is_404(api: Client) -> None:
    assert patch(api, "/api/models/nope", {"queue_weight": 1}).status_code == 404


def test_the_database_refuses_a_scorer_weight_out_of_range(db: None) -> None:
    with pytest.raises(IntegrityError):
        ServedModel.objects.create(name="tiny", model_path="/models/tiny", queue_weight=-0.5)


def test_a_lora_adapter_is_added_through_the_rest_api_with_its_base_and_no_render_config_of_its_own(
    api: Client,
) -> None:
    ServedModel.objects.create(name="tiny", model_path="/models/tiny")
    response = post(api, "/api/models", {"name": "tiny-lora", "model_path": "/adapters/tiny-lora", "base": "tiny"})
    assert response.status_code == 201, response.content
    assert response.json()["base"] == "tiny" and response.json()["render_config"] is None
    assert api.get("/api/models/tiny").json()["base"] is None
    assert build_snapshot().models["tiny-lora"].base == "tiny"
    # Unknown base, an adapter as base, or a render config of its own: 422, nothing written.
    for body in (
        {"name": "x", "model_path": "/a", "base": "nope"},
        {"name": "x", "model_path": "/a", "base": "tiny-lora"},
        {"name": "x", "model_path": "/a", "base": "tiny", "render_config": {"endpoint": {"host": "h", "port": 1}}},
    ):
        assert post(api, "/api/models", body).status_code == 422, body
    assert not ServedModel.objects.filter(name="x").exists()


@pytest.mark.django_db
def test_an_adapter_is_served_no_longer_than_its_base() -> None:
    base = ServedModel.objects.create(name="tiny", model_path="/models/tiny")
    adapter = ServedModel.objects.create(name="tiny-lora", model_path="/adapters/tiny-lora", base=base)
    assert build_snapshot().models["tiny-lora"].state == "active"
    for base_state, adapter_state, seen in [
        ("draining", "active", "draining"), ("retired", "active", "retired"), ("retired", "draining", "retired"),
        ("active", "draining", "draining"), ("active", "retired", "retired"), ("draining", "retired", "retired"),
    ]:
        ServedModel.objects.filter(id=base.id).update(state=base_state)
        ServedModel.objects.filter(id=adapter.id).update(state=adapter_state)
        models = build_snapshot().models
        assert (models["tiny"].state, models["tiny-lora"].state) == (base_state, seen), (base_state, adapter_state)
