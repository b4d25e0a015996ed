"""The render pool in the control plane: member rows (migration 0010 makes each config's own
address its first member), the REST API that lists, adds and removes them, the snapshot's
``RenderView.members`` with each member's version floors and health, the admin's per-member
capabilities, and the probe that records what each member reports."""

from __future__ import annotations

import io
import json
from typing import Any

import httpx
import pytest
from django.core.management.base import CommandError
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client

from catalog.models import Health, RenderConfig, RenderSidecar
from fleet import services
from fleet.render_pool_probes import probe_render_pool
from motorsite.core import read_control_version
from serving.snapshots import build_snapshot

BEFORE = [("serving", "0009_renderconfig_stream_interval_ms")]


@pytest.fixture
def api(client: Client, db: None) -> Client:
    client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {services.api_key_create(name='ops', scope='admin')[1]}"
    return client


def post(api: Client, path: str, data: Any) -> Any:
    return api.post(path, data=data, content_type="application/json")


@pytest.mark.django_db(transaction=True)
def test_the_migration_makes_each_configs_address_its_first_member() -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    old = executor.loader.project_state(BEFORE).apps
    old.get_model("serving", "RenderConfig").objects.create(name="default", host="10.0.0.5", port=8123,
                                                            sidecar_version="0.33.0", health="healthy")
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
    member = RenderSidecar.objects.get()
    assert (member.render_config.name, member.base_url, member.sidecar_version, member.health) == (
        "default", "http://10.0.0.5:8123", "0.33.0", "healthy")


@pytest.mark.django_db
def test_the_api_lists_adds_and_removes_members_and_the_snapshot_follows(api: Client) -> None:
    config = RenderConfig.objects.create()
    RenderSidecar.objects.create(render_config=config, host="127.0.0.1", port=8100)
    base = f"/api/render-configs/{config.id}/sidecars"
    assert [m["base_url"] for m in api.get(base).json()] == ["http://127.0.0.1:8100"]

    version = read_control_version()
    added = post(api, base, {"host": "127.0.0.1", "port": 8101})
    assert added.status_code == 201 and added.json()["base_url"] == "http://127.0.0.1:8101"
    assert read_control_version() != version  # coordinators adopt it within a poll interval
    assert post(api, base, {"host": "127.0.0.1", "port": 8101}).status_code == 409
    assert post(api, base, {"host": "127.0.0.1", "port": 0}).status_code == 422
    assert [m["port"] for m in api.get(f"/api/render-configs/{config.id}").json()["sidecars"]] == [8100, 8101]
    assert [m.base_url for m in build_snapshot().render.members] == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]

    first = api.get(base).json()[0]["id"]
    assert api.delete(f"{base}/{first}").status_code == 204
    assert [m.base_url for m in build_snapshot().render.members] == ["http://127.0.0.1:8101"]
    last = api.get(base).json()[0]["id"]
    assert api.delete(f"{base}/{last}").status_code == 409  # a pool keeps one sidecar
    assert api.delete(f"{base}/99999").status_code == 404


@pytest.mark.django_db
def test_each_member_carries_its_own_floors_and_health_into_the_snapshot() -> None:
    config = RenderConfig.objects.create()
    RenderSidecar.objects.create(render_config=config, port=8100, sidecar_version="0.26.1", health=Health.HEALTHY)
    RenderSidecar.objects.create(render_config=config, port=8101, sidecar_version="0.33.0", health=Health.FAILING)
    RenderSidecar.objects.create(render_config=config, port=8102, sidecar_version="0.33.0",
                                 capabilities={"derender": False, "streaming_derender": False})
    render = build_snapshot().render
    old, failing, no_derender = render.members
    assert (old.token_in, old.derender, old.streaming_derender, old.healthy) == (True, True, False, True)
    assert (failing.streaming_derender, failing.healthy) == (True, False)
    assert (no_derender.derender, no_derender.streaming_derender) == (False, False)
    # The path choice reads what some member can do: streams stay token-only.
    assert render.streaming_derender and render.base_url == "http://127.0.0.1:8100"


@pytest.mark.django_db
def test_a_config_without_member_rows_is_one_sidecar_at_its_address() -> None:
    RenderConfig.objects.create(port=8123, sidecar_version="0.26.0")
    (member,) = build_snapshot().render.members
    assert (member.base_url, member.streaming_derender) == ("http://127.0.0.1:8123", False)


@pytest.mark.django_db
def test_the_probe_records_each_members_version_routes_and_health() -> None:
    config = RenderConfig.objects.create()
    RenderSidecar.objects.create(render_config=config, host="new.test", port=8100)
    RenderSidecar.objects.create(render_config=config, host="old.test", port=8101)
    paths = {"/v1/chat/completions/render": {}, "/v1/completions/render": {}, "/v1/chat/completions/derender": {},
             "/v1/completions/derender": {}}

    def handler(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if path == "/version":
            return httpx.Response(200, json={"version": "0.33.0" if host == "new.test" else "0.26.0"})
        if path == "/openapi.json":
            return httpx.Response(200, json={"paths": {**paths, "/v1/messages/render": {}} if host == "new.test" else paths})
        assert path == "/v1/chat/completions/render" and json.loads(request.content)["max_tokens"] == 1
        return httpx.Response(200, json={"token_ids": [1]})

    version = read_control_version()
    outcomes = probe_render_pool(client=httpx.Client(transport=httpx.MockTransport(handler)))
    assert outcomes == {"http://new.test:8100": True, "http://old.test:8101": True}
    new, old = RenderSidecar.objects.order_by("port")
    assert new.capabilities["routes"] == {"render": ["chat", "completions", "messages"], "derender": ["chat", "completions"]}
    assert (new.sidecar_version, new.capabilities["streaming_derender"], new.capabilities["tokenizer_loaded"]) == (
        "0.33.0", True, True)
    assert (old.sidecar_version, old.capabilities["streaming_derender"]) == ("0.26.0", False)
    assert read_control_version() != version
    members = build_snapshot().render.members
    assert [m.streaming_derender for m in members] == [True, False]


@pytest.mark.django_db
def test_the_admin_shows_each_members_capabilities_and_the_pools_traffic(admin_client: Client) -> None:
    config = RenderConfig.objects.create()
    RenderSidecar.objects.create(render_config=config, port=8100, sidecar_version="0.26.0")
    RenderSidecar.objects.create(render_config=config, port=8101, sidecar_version="0.33.0",
                                 capabilities={"routes": {"render": ["chat", "completions"], "derender": ["chat", "completions"]}})
    page = admin_client.get(f"/admin/serving/renderconfig/{config.id}/change/").content.decode()
    assert "streams derendered by 1 of 2 sidecars" in page
    assert "older than 0.27 (no streaming derender)" in page  # the old member's own line
    assert "does not serve render messages, render responses" in page


@pytest.mark.django_db
def test_the_admin_adds_a_member_and_the_snapshot_has_it(admin_client: Client) -> None:
    config = RenderConfig.objects.create()
    RenderSidecar.objects.create(render_config=config, port=8100)
    version = read_control_version()
    form = {"render_config": config.id, "host": "127.0.0.1", "port": 8109}
    assert admin_client.post("/admin/serving/rendersidecar/add/", form).status_code == 302
    assert read_control_version() != version
    assert [m.base_url for m in build_snapshot().render.members][-1] == "http://127.0.0.1:8109"


@pytest.mark.django_db
def test_demo_fleet_makes_the_pool_make_run_started(tmp_path: Any) -> None:
    from django.core.management import call_command

    def run(*ports: int) -> list[int]:
        extra = [a for p in ports[1:] for a in ("--render-member-port", str(p))]
        call_command("demo_fleet", "--model-dir", str(tmp_path), "--render-port", str(ports[0]), *extra,
                     "--engine-kind", "sim", stdout=io.StringIO())
        config = RenderConfig.objects.get()
        assert config.pool_size == len(ports)
        return list(config.sidecars.values_list("port", flat=True))

    assert run(8100) == [8100]  # one sidecar by default, as before
    assert run(8100, 8101) == [8100, 8101]
    assert run(8100) == [8100]  # a run with fewer leaves no member nobody listens on


@pytest.mark.django_db
def test_demo_fleet_registers_members_at_their_own_addresses(tmp_path: Any) -> None:
    # Compose and k8s run each sidecar in a container or pod of its own (docker/compose.yaml, deploy/k8s).
    from django.core.management import call_command

    def run(*members: str) -> list[tuple[str, int]]:
        extra = [a for m in members for a in ("--render-member", m)]
        call_command("demo_fleet", "--model-dir", str(tmp_path), "--render-host", "render", "--render-port", "8100",
                     *extra, "--engine-kind", "sim", stdout=io.StringIO())
        config = RenderConfig.objects.get()
        assert config.pool_size == 1 + len(members)
        return list(config.sidecars.values_list("host", "port"))

    assert run("render-member-2:8101") == [("render", 8100), ("render-member-2", 8101)]
    RenderSidecar.objects.create(render_config=RenderConfig.objects.get(), host="elsewhere", port=9000)
    # On a host this run names, the pool is exactly this run's; a host it does not name is the operator's.
    assert run("render-member-2:8111") == [("render", 8100), ("elsewhere", 9000), ("render-member-2", 8111)]
    with pytest.raises(CommandError):
        call_command("demo_fleet", "--model-dir", str(tmp_path), "--render-member", "no-port", stdout=io.StringIO())


@pytest.mark.django_db
def test_the_routes_a_probe_found_reach_the_snapshot() -> None:
    config = RenderConfig.objects.create()
    RenderSidecar.objects.create(render_config=config, port=8100, sidecar_version="0.33.0", capabilities={
        "routes": {"render": ["chat", "completions"], "derender": ["chat", "completions"]}})
    RenderSidecar.objects.create(render_config=config, port=8101)
    probed, unprobed = build_snapshot().render.members
    assert probed.render_routes == frozenset({"chat", "completions"}) and probed.derender_routes == probed.render_routes
    assert unprobed.render_routes is None and unprobed.derender_routes is None
