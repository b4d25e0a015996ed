"""Admin smoke tests with query-count ceilings, the actions, the filters and the API key page."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from catalog.models import RenderConfig, ServedModel
from fleet import services
from fleet.models import ApiKey, BreakerState, EngineInstance, hash_key
from motorsite.core import read_control_version


@pytest.fixture
def staff_client(client: Client, db: None) -> Client:
    client.force_login(User.objects.create(username="admin", is_staff=True, is_superuser=True))  # no password hashing: fast
    return client


@pytest.fixture
def fleet(served_model: ServedModel) -> list[EngineInstance]:
    return [
        services.instance_create(actor="t", name=f"e{n}", url=f"http://e{n}.test:1", served_model_id=served_model.id)
        for n in range(5)
    ]


@pytest.mark.parametrize(
    "url",
    [
        "/admin/fleet/engineinstance/", "/admin/fleet/engineinstance/?breaker=open", "/admin/fleet/engineinstance/?probe=failing",
        "/admin/fleet/engineinstance/?drift=yes", "/admin/fleet/engineinstance/?draining=yes",
        "/admin/fleet/engineinstance/?model_record=mismatch", "/admin/fleet/breakerflip/",
        "/admin/fleet/instanceevent/", "/admin/fleet/managedprocess/", "/admin/fleet/proberesult/", "/admin/fleet/auditreport/", "/admin/fleet/apikey/",
        "/admin/serving/servedmodel/", "/admin/serving/renderconfig/", "/admin/serving/modelrevision/",
    ],
)
def test_changelists_render_within_a_query_ceiling(
    staff_client: Client, fleet: list[EngineInstance], url: str, django_assert_max_num_queries: Any,
) -> None:
    RenderConfig.objects.create()
    with django_assert_max_num_queries(12):  # independent of the number of rows
        assert staff_client.get(url).status_code == 200


def test_change_pages_render(staff_client: Client, fleet: list[EngineInstance], django_assert_max_num_queries: Any) -> None:
    with django_assert_max_num_queries(15):
        assert staff_client.get(f"/admin/fleet/engineinstance/{fleet[0].id}/change/").status_code == 200
    assert staff_client.get("/admin/fleet/engineinstance/add/").status_code == 200
    assert staff_client.get("/admin/fleet/apikey/add/").status_code == 200


def test_the_filters_select_the_right_rows(staff_client: Client, fleet: list[EngineInstance]) -> None:
    fleet[0].drain()
    services.breaker_force_open(instance_id=fleet[1].id, actor="t")
    EngineInstance.objects.filter(id=fleet[2].id).update(health="failing", version_drift=True)
    EngineInstance.objects.filter(id=fleet[3].id).update(reported_name="qwen", model_mismatch="the engine serves 'qwen'")
    for query, name in [
        ("draining=yes", "e0"), ("breaker=open", "e1"), ("probe=failing", "e2"), ("drift=yes", "e2"), ("model_record=mismatch", "e3"),
    ]:
        names = [o.name for o in staff_client.get(f"/admin/fleet/engineinstance/?{query}").context["cl"].result_list]
        assert names == [name], query


def action(client: Client, name: str, ids: list[int]) -> Any:
    return client.post(
        "/admin/fleet/engineinstance/", {"action": name, "_selected_action": [str(i) for i in ids]}, follow=True
    )


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def test_the_actions_change_state_and_report_counts(staff_client: Client, fleet: list[EngineInstance]) -> None:
    ids = [e.id for e in fleet[:3]]
    assert messages_of(action(staff_client, "drain", ids)) == ["Drained 3 engine(s)"]
    assert messages_of(action(staff_client, "drain", ids[:1])) == ["Drained 0 engine(s); skipped 1 whose state does not allow it"]
    assert messages_of(action(staff_client, "undrain", ids[:2])) == ["Undrained 2 engine(s)"]
    assert messages_of(action(staff_client, "quarantine", ids[:1])) == ["Quarantined 1 engine(s)"]
    assert messages_of(action(staff_client, "disable", ids[:1])) == ["Disabled 1 engine(s)"]
    assert messages_of(action(staff_client, "force_breaker_open", ids[:2])) == ["Forced the breaker of 2 engine(s) open for 60 s"]
    assert messages_of(action(staff_client, "reset_breaker", ids[:1])) == ["Reset the breaker of 1 engine(s)"]
    states = dict(EngineInstance.objects.values_list("name", "state"))
    assert states["e0"] == "disabled" and states["e1"] == "active" and states["e2"] == "draining"
    assert dict(BreakerState.objects.values_list("instance__name", "state"))["e1"] == "open"
    assert EngineInstance.objects.get(name="e0").events.first().actor == "admin:admin"


def test_probe_now_reports_when_probes_are_unavailable(
    staff_client: Client, fleet: list[EngineInstance], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(services, "probes_enqueue", lambda instance_ids: None)
    assert "Probes are unavailable" in messages_of(action(staff_client, "probe_now", [fleet[0].id]))[0]
    monkeypatch.setattr(services, "probes_enqueue", lambda instance_ids: len(instance_ids))
    assert messages_of(action(staff_client, "probe_now", [fleet[0].id])) == ["Queued a probe of 1 engine(s)"]


def test_a_pd_violation_is_refused_by_the_form(staff_client: Client, served_model: ServedModel) -> None:
    services.instance_create(
        actor="t", name="p", url="http://p.test:1", role="prefill", served_model_id=served_model.id,
        kv_connector="MooncakeLayerwiseConnector",
    )
    form = {
        "name": "d", "url": "http://d.test:1", "role": "decode", "served_model": served_model.id, "kind": "vllm",
        "weight": 1, "token_capacity": 100, "cap_token_generate": "on", "hardware_kind": "cpu",
        "kv_connector": "NixlConnector", "tp": 1, "dp": 1, "ep": 1,
    }
    response = staff_client.post("/admin/fleet/engineinstance/add/", form)
    assert response.status_code == 200
    assert "incompatible KV connectors" in response.content.decode()
    assert not EngineInstance.objects.filter(name="d").exists()
    form["kv_connector"] = "MooncakeLayerwiseConnector"
    assert staff_client.post("/admin/fleet/engineinstance/add/", form).status_code == 302
    assert BreakerState.objects.filter(instance__name="d").exists()


def test_an_engine_url_without_a_scheme_is_plain_http(staff_client: Client, served_model: ServedModel) -> None:
    form = {
        "name": "u", "url": "127.0.0.1:8201", "role": "union", "served_model": served_model.id, "kind": "vllm",
        "weight": 1, "token_capacity": 100, "cap_token_generate": "on", "hardware_kind": "cpu", "tp": 1, "dp": 1, "ep": 1,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Django's warning that the default scheme becomes https in 6.0
        response = staff_client.post("/admin/fleet/engineinstance/add/", form)
    assert response.status_code == 302, response.content.decode()
    assert EngineInstance.objects.get(name="u").url == "http://127.0.0.1:8201"


def test_a_new_api_key_is_shown_once_and_only_its_hash_is_stored(staff_client: Client) -> None:
    response = staff_client.post("/admin/fleet/apikey/add/", {"name": "app", "scope": "client"}, follow=True)
    [message] = [m for m in messages_of(response) if "copy it now" in m]
    key = message.split(" is ", 1)[1].split(" ", 1)[0]
    record = ApiKey.objects.get(name="app")
    assert record.key_hash == hash_key(key) and record.prefix == key[:8]
    assert key not in str(ApiKey.objects.values_list())
    assert key not in staff_client.get(f"/admin/fleet/apikey/{record.id}/change/").content.decode()


def test_a_key_form_opened_before_a_revocation_does_not_bring_the_key_back(staff_client: Client) -> None:
    record, _ = services.api_key_create(name="app", scope="client")
    services.api_key_revoke(ids=[record.id])  # meanwhile, the revoke action
    # What a form read before the revocation posts: "revoked" unchecked, and a new name.
    form = {"name": "app-renamed", "tokens_per_minute": "", "revoked": ""}
    assert staff_client.post(f"/admin/fleet/apikey/{record.id}/change/", form).status_code == 302
    record.refresh_from_db()
    assert (record.name, record.revoked) == ("app-renamed", True)


def test_a_render_config_change_needing_a_restart_is_flagged(staff_client: Client, db: None) -> None:
    config = RenderConfig.objects.create()
    form = {"name": "default", "enable": "on", "host": "127.0.0.1", "port": 8101, "timeout_ms": 5000, "renderer_num_workers": 4,
            "stream_interval": 1, "stream_interval_ms": 0}
    response = staff_client.post(f"/admin/serving/renderconfig/{config.id}/change/", form, follow=True)
    assert any("restarts" in m for m in messages_of(response))
    config.refresh_from_db()
    assert config.port == 8101 and config.restart_required


def test_the_render_config_admin_shows_and_saves_the_time_interval(staff_client: Client, db: None) -> None:
    config = RenderConfig.objects.create()
    page = staff_client.get(f"/admin/serving/renderconfig/{config.id}/change/").content.decode()
    assert 'name="stream_interval_ms"' in page and "derender calls after its first token" in page
    form = {"name": "default", "enable": "on", "host": "127.0.0.1", "port": 8100, "timeout_ms": 5000,
            "renderer_num_workers": 4, "stream_interval": 1, "stream_interval_ms": 40}
    assert staff_client.post(f"/admin/serving/renderconfig/{config.id}/change/", form).status_code == 302
    config.refresh_from_db()
    assert config.stream_interval_ms == 40 and not config.restart_required  # the coordinator applies it
    refused = staff_client.post(f"/admin/serving/renderconfig/{config.id}/change/", {**form, "stream_interval_ms": 1001})
    assert refused.status_code == 200 and RenderConfig.objects.get().stream_interval_ms == 40


def test_the_site_is_titled_for_the_project(staff_client: Client) -> None:
    page = staff_client.get("/admin/").content.decode()
    assert "motorsite fleet administration" in page and "<title>Fleet, models and keys | motorsite admin</title>" in page
    assert "Django administration" not in page and "Django site admin" not in page


def test_the_changelist_draws_no_alarm_for_a_healthy_engine(staff_client: Client, fleet: list[EngineInstance]) -> None:
    EngineInstance.objects.filter(id=fleet[1].id).update(version_drift=True, drift_reason="root differs")
    page = staff_client.get("/admin/fleet/engineinstance/").content.decode()
    rows = page.split('<tbody>', 1)[1].split("</tbody>", 1)[0].split("<tr")[1:]
    [healthy] = [r for r in rows if f'href="/admin/fleet/engineinstance/{fleet[0].id}/change/' in r]
    [drifted] = [r for r in rows if f'href="/admin/fleet/engineinstance/{fleet[1].id}/change/' in r]
    # Django's boolean icons drew "no drift" as a red cross; the column is words now.
    assert "icon-no.svg" not in healthy and '<td class="field-drift">none</td>' in healthy
    assert '<td class="field-drift">drifted: root differs</td>' in drifted
    # The breaker column is the state, not the BreakerState's str ("9: closed").
    assert '<td class="field-breaker_column">closed</td>' in healthy and ": closed" not in healthy


def test_api_actions_appear_in_the_instance_history_next_to_admin_ones(staff_client: Client, fleet: list[EngineInstance]) -> None:
    _, key = services.api_key_create(name="ops", scope="admin")
    auth = {"HTTP_AUTHORIZATION": f"Bearer {key}"}
    e0 = fleet[0]
    assert staff_client.post(f"/api/instances/{e0.id}/drain", **auth).status_code == 200
    assert staff_client.patch(f"/api/instances/{e0.id}", {"weight": 3}, content_type="application/json", **auth).status_code == 200
    assert staff_client.post(f"/api/instances/{e0.id}/breaker/open", **auth).status_code == 200
    action(staff_client, "quarantine", [e0.id])
    page = staff_client.get(f"/admin/fleet/engineinstance/{e0.id}/history/").content.decode()
    table = page.split('id="fleet-history"', 1)[1].split("</table>", 1)[0]
    rows = [r for r in table.split("<tr>")[2:]]
    assert len(rows) == 4
    # Newest first: the admin's quarantine, then the API's breaker, edit and drain.
    assert "admin:admin" in rows[0] and "state: draining → quarantined" in rows[0]
    assert "api:ops" in rows[1] and "breaker: closed → open" in rows[1]
    assert "api:ops" in rows[2] and "config: changed" in rows[2] and "weight" in rows[2]
    assert "api:ops" in rows[3] and "state: active → draining" in rows[3]


def test_the_operator_adopts_the_model_an_engine_reports(staff_client: Client, fleet: list[EngineInstance]) -> None:
    # What the version probe wrote: e0 and e1 load /models/qwen as "qwen", the record says "tiny".
    EngineInstance.objects.filter(id__in=[fleet[0].id, fleet[1].id]).update(
        reported_name="qwen", reported_root="/models/qwen", model_mismatch="the engine serves 'qwen', the served model is named 'tiny'",
    )
    page = staff_client.get("/admin/fleet/engineinstance/").content.decode()
    assert "⚠ the engine serves &#x27;qwen&#x27;" in page and "not reported yet" in page
    assert messages_of(action(staff_client, "adopt_reported_model", [fleet[2].id])) == [
        "Not updated: e2: e2 has not reported a model yet; probe it first",
    ]
    assert messages_of(action(staff_client, "adopt_reported_model", [fleet[0].id])) == [
        "Updated 1 served model(s) from their engines: qwen (/models/qwen)",
    ]
    assert ServedModel.objects.values_list("name", "model_path").get() == ("qwen", "/models/qwen")
    assert not EngineInstance.objects.exclude(model_mismatch="").exists()
    history = staff_client.get(f"/admin/fleet/engineinstance/{fleet[1].id}/history/").content.decode()
    assert "model: true → false" in history and "adopted from e0" in history


def test_the_served_model_actions_drain_retire_and_activate(staff_client: Client, served_model: ServedModel) -> None:
    from motorsite.core import read_control_version

    def act(name: str) -> list[str]:
        data = {"action": name, "_selected_action": [str(served_model.id)]}
        return messages_of(staff_client.post("/admin/serving/servedmodel/", data, follow=True))

    for name, state in (("drain", "draining"), ("retire", "retired"), ("activate", "active")):
        before = read_control_version()
        assert act(name) == [f"1 model(s) now {state}."]
        assert ServedModel.objects.get().state == state and read_control_version() > before


def test_a_render_config_is_given_its_model_in_the_admin(staff_client: Client, served_model: ServedModel) -> None:
    config = RenderConfig.objects.create(name="tiny")
    form = {"name": "tiny", "served_model": served_model.id, "enable": "on", "host": "127.0.0.1", "port": 8100,
            "timeout_ms": 5000, "renderer_num_workers": 4, "stream_interval": 1, "stream_interval_ms": 0}
    assert staff_client.post(f"/admin/serving/renderconfig/{config.id}/change/", form).status_code == 302
    assert RenderConfig.objects.get().served_model == served_model


def test_scorer_weights_are_edited_in_the_admin(staff_client: Client, served_model: ServedModel) -> None:
    form = {"name": served_model.name, "model_path": served_model.model_path, "max_model_len": 2048,
            "state": "active", "prefix_weight": "3", "queue_weight": "0.5", "tokens_weight": "0"}
    before = read_control_version()
    assert staff_client.post(f"/admin/serving/servedmodel/{served_model.id}/change/", form).status_code == 302
    assert ServedModel.objects.values_list("prefix_weight", "queue_weight", "tokens_weight").get() == (3.0, 0.5, 0.0)
    assert read_control_version() > before
    refused = staff_client.post(f"/admin/serving/servedmodel/{served_model.id}/change/", {**form, "queue_weight": "-1"})
    assert refused.status_code == 200 and "greater than or equal to 0" in refused.content.decode()
    assert "3 / 0.5 / 0" in staff_client.get("/admin/serving/servedmodel/").content.decode()


def test_the_engine_admin_shows_what_its_probe_found_it_serves(staff_client: Client, fleet: list[EngineInstance]) -> None:
    EngineInstance.objects.filter(id=fleet[0].id).update(cap_native_openai=True, cap_tokenizer=True, capabilities={
        "version": "0.32.0", "token_in": True, "routes": {"generate": True, "native": ["chat", "completions"]},
        "tokenizer_loaded": True, "lora": {"enabled": True}}, lora_adapters=["sql-lora"])
    EngineInstance.objects.filter(id=fleet[1].id).update(capabilities={"version": "0.32.0", "lora": {"enabled": True}})
    listing = staff_client.get("/admin/fleet/engineinstance/").content.decode()
    # The adapters come from the LoRA probe's record, the one placement reads.
    assert "token-only (tokenizer loaded); native chat, completions; LoRA sql-lora" in listing
    assert "LoRA enabled, no adapter loaded" in listing
    assert "not probed yet: the record&#x27;s capabilities stand" in listing  # the others
    page = staff_client.get(f"/admin/fleet/engineinstance/{fleet[0].id}/change/").content.decode()
    assert "native chat, completions" in page and "sql-lora" in page and "0.32.0" in page
