"""The render config endpoints of the REST API."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from catalog.models import RenderConfig
from fleet import services

pytestmark = pytest.mark.django_db


@pytest.fixture
def api(client: Client, db: None) -> Client:
    client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {services.api_key_create(name='ops', scope='admin')[1]}"
    return client


@pytest.fixture
def config(db: None) -> RenderConfig:
    return RenderConfig.objects.create()


def post(api: Client, path: str, data: Any) -> Any:
    return api.post(path, data=data, content_type="application/json")


def test_it_lists_and_reads_render_configs(api: Client, config: RenderConfig) -> None:
    assert [c["name"] for c in api.get("/api/render-configs").json()] == ["default"]
    body = api.get(f"/api/render-configs/{config.id}").json()
    assert (body["port"], body["health"], body["streaming_derender"]) == (8100, "unknown", True)
    assert api.get("/api/render-configs/999").status_code == 404


def test_publish_applies_changes_and_reports_a_needed_restart(api: Client, config: RenderConfig) -> None:
    response = post(api, f"/api/render-configs/{config.id}/publish", {"timeout_ms": 2000})
    assert response.status_code == 200
    assert response.json()["changed"] == ["timeout_ms"] and response.json()["restart_required"] is False
    response = post(api, f"/api/render-configs/{config.id}/publish", {"port": 8200})
    assert response.json()["restart_required"] is True and response.json()["config"]["restart_required"] is True


def test_publish_refuses_unknown_fields(api: Client, config: RenderConfig) -> None:
    response = post(api, f"/api/render-configs/{config.id}/publish", {"enabled": False})
    assert response.status_code == 422
    assert RenderConfig.objects.get().enable is True


def test_import_takes_the_rfc_shape_and_names_an_unknown_key(api: Client, config: RenderConfig) -> None:
    ok = post(api, "/api/render-configs/import", {"render_config": {"enable": False, "endpoint": {"host": "127.0.0.1", "port": 8100}}})
    assert ok.status_code == 200 and ok.json()["changed"] == ["enable"]
    bad = post(api, "/api/render-configs/import", {"render_config": {"timeout": 10}})
    assert bad.status_code == 422
    assert [(e["loc"], e["type"]) for e in bad.json()["detail"]] == [(["body", "body", "render_config", "timeout"], "extra_forbidden")]


def test_coalescing_and_the_stream_interval_are_published_and_reach_the_snapshot(api: Client, config: RenderConfig) -> None:
    from serving.snapshots import build_snapshot

    body = api.get(f"/api/render-configs/{config.id}").json()
    assert (body["derender_coalesce"], body["stream_interval"]) == (True, 1)
    response = post(api, f"/api/render-configs/{config.id}/publish", {"stream_interval": 4, "derender_coalesce": False})
    assert response.status_code == 200, response.json()
    assert sorted(response.json()["changed"]) == ["derender_coalesce", "stream_interval"]
    assert response.json()["restart_required"] is False  # the coordinator applies it; the sidecar is untouched
    render = build_snapshot().render
    assert (render.stream_interval, render.derender_coalesce) == (4, False)
    for bad in (0, 65, "4"):
        refused = post(api, f"/api/render-configs/{config.id}/publish", {"stream_interval": bad})
        assert refused.status_code == 422, bad
    assert RenderConfig.objects.get().stream_interval == 4
    imported = post(api, "/api/render-configs/import", {"render_config": {"stream_interval": 8}})
    assert imported.status_code == 200 and RenderConfig.objects.get().stream_interval == 8


def test_the_time_interval_is_published_imported_and_reaches_the_snapshot(api: Client, config: RenderConfig) -> None:
    from serving.snapshots import build_snapshot

    assert api.get(f"/api/render-configs/{config.id}").json()["stream_interval_ms"] == 0  # off by default
    assert build_snapshot().render.stream_interval_ms == 0
    response = post(api, f"/api/render-configs/{config.id}/publish", {"stream_interval_ms": 40})
    assert response.status_code == 200, response.json()
    assert response.json()["changed"] == ["stream_interval_ms"] and response.json()["restart_required"] is False
    assert response.json()["config"]["stream_interval_ms"] == 40
    assert build_snapshot().render.stream_interval_ms == 40
    for bad in (-1, 1001, "40", True):
        refused = post(api, f"/api/render-configs/{config.id}/publish", {"stream_interval_ms": bad})
        assert refused.status_code == 422, bad
        refused = post(api, "/api/render-configs/import", {"render_config": {"stream_interval_ms": bad}})
        assert refused.status_code == 422, bad
    assert RenderConfig.objects.get().stream_interval_ms == 40
    imported = post(api, "/api/render-configs/import", {"render_config": {"stream_interval_ms": 0}})
    assert imported.status_code == 200 and RenderConfig.objects.get().stream_interval_ms == 0
    schema = api.get("/api/openapi.json").json()["components"]["schemas"]
    assert "stream_interval_ms" in schema["RenderConfigOut"]["properties"]
