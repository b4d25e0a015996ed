"""The fleet dashboard page under the admin: staff only, every instance, a query ceiling."""

from __future__ import annotations

from typing import Iterator

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from catalog.models import RenderConfig, RenderSidecar, ServedModel
from fleet.models import BreakerState, EngineInstance, ManagedProcess
from fleet.services import instance_create
from serving.pipeline import metrics

URL = "/admin/fleet/dashboard/"


@pytest.fixture
def staff_client(db: None) -> Client:
    user = User.objects.create_user("ops", password="pw", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def recorded() -> Iterator[None]:
    metrics.REGISTRY.clear()
    yield
    metrics.REGISTRY.clear()


@pytest.fixture
def fleet(db: None) -> list[EngineInstance]:
    model = ServedModel.objects.create(name="tiny", model_path="/m/tiny")
    RenderConfig.objects.create(name="default")
    made = [instance_create(actor="test", name=f"e{n}", url=f"http://e{n}.test", served_model_id=model.id) for n in range(1, 6)]
    BreakerState.for_instance(made[1].id).force_open(actor="test", seconds=30)
    return made


def test_it_needs_staff(db: None) -> None:
    response = Client().get(URL)
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_it_shows_every_instance_within_a_query_ceiling(staff_client: Client, fleet: list[EngineInstance], recorded: None) -> None:
    metrics.record_request("e1", 0.05, 0.01, ok=True)
    metrics.record_request("e2", None, None, ok=False)
    with CaptureQueriesContext(connection) as queries:
        response = staff_client.get(URL)
    assert response.status_code == 200
    # session + user + instances (with breaker and model) + render config + the coordinators'
    # reports + the render pools' members; not one per instance.
    assert len(queries) <= 8, [q["sql"] for q in queries]
    html = response.content.decode()
    for i in fleet:
        assert f'data-instance="{i.name}"' in html
    assert html.count('class="spark"') == 4 * len(fleet)
    assert '<tr class="instance sick" data-instance="e2"' in html  # breaker forced open
    assert '<tr class="instance" data-instance="e1"' in html


def test_it_is_linked_from_the_admin_index(staff_client: Client) -> None:
    assert 'href="/admin/fleet/dashboard/"' in staff_client.get("/admin/").content.decode()


def test_it_serves_prometheus_metrics(client: Client, recorded: None, db: None) -> None:
    metrics.record_request("e1", 0.05, None, ok=True)
    ManagedProcess.objects.create(name="engine-1", state=ManagedProcess.State.BACKOFF, restarts=2)
    ManagedProcess.objects.create(name="render", state=ManagedProcess.State.RUNNING)
    response = client.get("/metrics")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain")
    text = response.content.decode()
    assert 'motor_engine_requests_total{instance="e1"} 1.0' in text
    # The launcher's processes: restarts so far, and engine-1 down while it waits to restart.
    assert 'motor_process_restarts_total{process="engine-1"} 2.0' in text
    assert 'motor_process_up{process="engine-1"} 0.0' in text
    assert 'motor_process_up{process="render"} 1.0' in text


def test_it_shows_the_launchers_restarts_and_last_exit(staff_client: Client, fleet: list[EngineInstance], recorded: None) -> None:
    ManagedProcess.objects.create(
        name="engine-3", instance=fleet[2], state=ManagedProcess.State.BACKOFF, restarts=3,
        last_exit_reason="engine core killed by SIGILL (then the process exited with code 0)",
    )
    ManagedProcess.objects.create(name="engine-4", instance=fleet[3], state=ManagedProcess.State.RUNNING, restarts=1)
    with CaptureQueriesContext(connection) as queries:
        html = staff_client.get(URL).content.decode()
    assert len(queries) <= 8  # the process rides along with the instance query (+1: the reports, +1: the pools)
    assert '<tr class="instance sick" data-instance="e3"' in html  # restarting: out of service
    assert "process restarting" in html
    assert '<td data-field="process">restarting<br>' in html and "last exit: engine core killed by SIGILL" in html
    assert '<td data-field="restarts">3</td>' in html
    assert '<tr class="instance" data-instance="e4"' in html and '<td data-field="restarts">1</td>' in html


def test_it_shows_each_engines_and_each_sidecars_capabilities(staff_client: Client, fleet: list[EngineInstance]) -> None:
    EngineInstance.objects.filter(id=fleet[0].id).update(cap_native_openai=True, cap_tokenizer=True, capabilities={
        "version": "0.32.0", "token_in": True, "routes": {"generate": True, "native": ["chat", "completions"]},
        "tokenizer_loaded": False, "lora": {"enabled": False, "adapters": []}})
    EngineInstance.objects.filter(id=fleet[1].id).update(capabilities={
        "version": "0.22.0", "token_in": False, "routes": {"generate": True, "native": []}, "tokenizer_loaded": None})
    config = RenderConfig.objects.get()
    RenderSidecar.objects.create(render_config=config, host="127.0.0.1", port=8100, sidecar_version="0.26.0",
                                 capabilities={"routes": {"render": ["chat", "completions"], "derender": ["chat"]}})
    html = staff_client.get(URL).content.decode()
    e1 = html.split('data-instance="e1"')[1].split("</tr>")[0]
    assert "token-only; no native: tokens-only (no tokenizer loaded)" in e1
    e2 = html.split('data-instance="e2"')[1].split("</tr>")[0]
    assert "no token-only: vLLM 0.22.0 is older than 0.23" in e2
    sidecar = html.split('data-sidecar="http://127.0.0.1:8100"')[1].split("</tr>")[0]
    assert "older than 0.27" in sidecar and "does not serve render messages, render responses, derender completions" in sidecar


def test_it_counts_why_each_models_requests_went_native(
    staff_client: Client, fleet: list[EngineInstance], monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fleet import reports
    from serving import runtime
    from serving.pipeline.metric_names import ROUTE_DECISIONS

    runtime.counters.clear()
    monkeypatch.setattr(runtime.counters, "on_inc", None)  # no reporter thread: the other process is a row below
    for _ in range(2):
        runtime.counters.inc(ROUTE_DECISIONS, model="tiny", path="native", reason="stop_strings")
    runtime.counters.inc(ROUTE_DECISIONS, model="tiny", path="refused", reason="api:messages")
    runtime.counters.inc(ROUTE_DECISIONS, model="tiny-b", path="native", reason="echo")
    # Another coordinator process's report adds its own counts.
    reports.report_write(host="replica-b", pid=7, payload={"series": {}, "in_flight": {}, "route_decisions": [
        ["tiny", "native", "stop_strings", 3]]})
    try:
        html = staff_client.get(URL).content.decode()
    finally:
        runtime.counters.clear()
    table = html.split('id="native-reasons"')[1].split("</table>")[0]
    stop = table.split('data-model="tiny" data-reason="stop_strings"')[1].split("</tr>")[0]
    assert '<td data-field="native">5</td>' in stop and '<td data-field="refused">0</td>' in stop
    messages = table.split('data-model="tiny" data-reason="api:messages"')[1].split("</tr>")[0]
    assert '<td data-field="refused">1</td>' in messages
    assert 'data-model="tiny-b" data-reason="echo"' in table
