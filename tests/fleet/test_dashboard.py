"""The fleet dashboard page under the admin: staff only, every instance, a query ceiling."""

from __future__ import annotations

from typing import Iterator

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from catalog.models import RenderConfig, ServedModel
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
    # reports; not one per instance.
    assert len(queries) <= 7, [q["sql"] for q in queries]
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
    assert len(queries) <= 7  # the process rides along with the instance query (+1: the reports)
    assert '<tr class="instance sick" data-instance="e3"' in html  # restarting: out of service
    assert "process restarting" in html
    assert '<td data-field="process">restarting<br>' in html and "last exit: engine core killed by SIGILL" in html
    assert '<td data-field="restarts">3</td>' in html
    assert '<tr class="instance" data-instance="e4"' in html and '<td data-field="restarts">1</td>' in html
