"""The REST API under /api/: every endpoint and its errors (the schemathesis run is in test_api_schema.py)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from catalog.models import ServedModel
from fleet import services
from fleet.models import BreakerFlip, EngineInstance, InstanceEvent, ProbeResult

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_key(db: None) -> str:
    return services.api_key_create(name="ops", scope="admin")[1]


@pytest.fixture
def api(client: Client, admin_key: str) -> Client:
    client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {admin_key}"
    return client


@pytest.fixture
def served_model(db: None) -> ServedModel:
    return ServedModel.objects.create(name="tiny", model_path="/models/tiny")


@pytest.fixture
def engine_up(served_model: ServedModel) -> EngineInstance:
    return services.instance_create(actor="t", name="e1", url="http://e1.test:8201", served_model_id=served_model.id)


def post(api: Client, path: str, data: Any = None) -> Any:
    return api.post(path, data=data, content_type="application/json")


@pytest.mark.parametrize("auth", [None, "Bearer nope", "Token x"])
def test_a_missing_or_unknown_key_is_401(client: Client, auth: str | None) -> None:
    headers = {"HTTP_AUTHORIZATION": auth} if auth else {}
    response = client.get("/api/instances", **headers)
    assert response.status_code == 401 and "detail" in response.json()


def test_a_client_key_is_403(client: Client, db: None) -> None:
    _, key = services.api_key_create(name="app", scope="client")
    response = client.get("/api/instances", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert response.status_code == 403
    assert "client key" in response.json()["detail"]


def test_a_revoked_admin_key_is_401(client: Client, db: None) -> None:
    record, key = services.api_key_create(name="old", scope="admin")
    services.api_key_revoke(ids=[record.id])
    assert client.get("/api/instances", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 401


def test_it_creates_lists_reads_patches_and_deletes_an_instance(api: Client, served_model: ServedModel) -> None:
    body = {"name": "e9", "url": "http://e9.test:1", "served_model_id": served_model.id, "tp": 2}
    created = post(api, "/api/instances", body)
    assert created.status_code == 201, created.content
    data = created.json()
    assert (data["name"], data["state"], data["breaker_state"], data["served_model"], data["health"]) == (
        "e9", "active", "closed", "tiny", "unknown"
    )
    assert data["inflight_tokens"] == 0  # this process's admission holds nothing for it
    assert [i["name"] for i in api.get("/api/instances").json()] == ["e9"]
    patched = api.patch(f"/api/instances/{data['id']}", data={"weight": 5}, content_type="application/json")
    assert patched.status_code == 200 and patched.json()["weight"] == 5
    assert api.delete(f"/api/instances/{data['id']}").status_code == 204
    assert api.get(f"/api/instances/{data['id']}").status_code == 404


def test_unknown_instance_is_404_everywhere(api: Client, db: None) -> None:
    for method, path in [
        ("get", "/api/instances/404"), ("delete", "/api/instances/404"), ("post", "/api/instances/404/drain"),
        ("post", "/api/instances/404/breaker/reset"), ("get", "/api/instances/404/probes"),
    ]:
        response = getattr(api, method)(path)
        assert response.status_code == 404, (path, response.content)
        assert response.json()["detail"] == "No engine instance with id 404."


@pytest.mark.parametrize(
    "body",
    [{}, {"name": "x", "url": "http://x:1", "served_model_id": 1, "tp": 0}, {"name": "x", "url": "u", "served_model_id": 1, "bogus": 1}],
)
def test_an_invalid_body_is_422(api: Client, served_model: ServedModel, body: dict[str, Any]) -> None:
    response = post(api, "/api/instances", body)
    assert response.status_code == 422 and "detail" in response.json()


def test_a_pd_violation_is_422_with_the_reason(api: Client, served_model: ServedModel) -> None:
    common = {"served_model_id": served_model.id, "kv_connector": "NixlConnector"}
    assert post(api, "/api/instances", {"name": "p", "url": "http://p.test:1", "role": "prefill", "tp": 2, **common}).status_code == 201
    response = post(api, "/api/instances", {"name": "d", "url": "http://d.test:1", "role": "decode", "tp": 4, **common})
    assert response.status_code == 422
    assert "P's TP is a larger multiple of D's" in response.json()["detail"]


def test_drain_undrain_and_quarantine(api: Client, engine_up: EngineInstance) -> None:
    base = f"/api/instances/{engine_up.id}"
    assert post(api, f"{base}/drain").json()["state"] == "draining"
    assert post(api, f"{base}/undrain").json()["state"] == "active"
    conflict = post(api, f"{base}/undrain")
    assert conflict.status_code == 409 and "only a draining instance" in conflict.json()["detail"]
    assert post(api, f"{base}/quarantine", {"reason": "bad revision"}).json()["state"] == "quarantined"
    event = InstanceEvent.objects.filter(instance=engine_up).first()
    assert (event.new, event.actor, event.reason) == ("quarantined", "api:ops", "bad revision")


def test_breaker_open_and_reset(api: Client, engine_up: EngineInstance) -> None:
    base = f"/api/instances/{engine_up.id}/breaker"
    opened = post(api, f"{base}/open?seconds=30").json()
    assert opened["breaker_state"] == "open" and opened["breaker"]["epoch"] == 1
    assert post(api, f"{base}/open?seconds=0").status_code == 422
    assert post(api, f"{base}/reset").json()["breaker_state"] == "closed"
    assert BreakerFlip.objects.filter(instance=engine_up).count() == 2


def test_probe_history_newest_first(api: Client, engine_up: EngineInstance) -> None:
    ProbeResult.objects.create(instance=engine_up, kind="health", ok=True, latency_ms=3.0)
    ProbeResult.objects.create(instance=engine_up, kind="version", ok=False, error="drift")
    probes = api.get(f"/api/instances/{engine_up.id}/probes?limit=1").json()
    assert [(p["kind"], p["ok"], p["error"]) for p in probes] == [("version", False, "drift")]


def test_probes_run_is_503_without_the_tasks_or_202_with_them(
    api: Client, engine_up: EngineInstance, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(services, "probes_enqueue", lambda instance_ids: None)
    response = post(api, "/api/probes/run")
    assert response.status_code == 503 and "unavailable" in response.json()["detail"]
    monkeypatch.setattr(services, "probes_enqueue", lambda instance_ids: len(instance_ids))
    response = post(api, "/api/probes/run")
    assert response.status_code == 202 and response.json()["detail"] == "Queued probes of 1 instance(s)."


def test_fleet_status(api: Client, engine_up: EngineInstance) -> None:
    services.instance_set_state(instance_id=engine_up.id, action="drain", actor="t")
    status = api.get("/api/fleet/status").json()
    assert status["by_state"] == {"draining": 1} and status["instances"] == 1
    assert status["control_version"] == services.read_control_version()


def test_openapi_document_and_docs_are_served(client: Client, db: None) -> None:
    schema = client.get("/api/openapi.json").json()
    assert "/api/instances/{instance_id}/drain" in schema["paths"]
    assert client.get("/api/docs").status_code == 200
