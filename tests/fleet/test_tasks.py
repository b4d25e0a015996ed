"""Task bodies called directly (no broker): fan-out, idempotence, retention, audit, the schedule."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from catalog.models import RenderConfig, ServedModel
from fleet import probes, tasks
from fleet.models import AuditReport, EngineInstance, ProbeResult
from fleet.services import instance_create
from motorsite.celery import app


@pytest.fixture
def all_down(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    # The probes' own client is httpx (fleet/probes.py): every tier refuses, no HTTP in question.
    monkeypatch.setattr(probes, "http_client", lambda: httpx.Client(transport=httpx.MockTransport(refuse)))


@pytest.fixture
def fleet(db: None) -> list[EngineInstance]:
    model = ServedModel.objects.create(name="tiny", model_path="/nonexistent/tiny")
    RenderConfig.objects.create(name="default", host="render.test")
    made = [instance_create(actor="test", name=f"e{n}", url=f"http://e{n}.test", served_model_id=model.id) for n in (1, 2, 3)]
    made[2].disable(actor="test")
    return made


def test_it_fans_out_a_health_check_to_every_instance_not_disabled(fleet: list[EngineInstance], eager: None, all_down: None) -> None:
    assert tasks.probe_health() == 3  # render + e1 + e2
    probed = set(ProbeResult.objects.filter(kind="health").values_list("instance__name", flat=True))
    assert probed == {None, "e1", "e2"}


def test_it_ignores_an_instance_deleted_before_its_probe(db: None, all_down: None) -> None:
    assert tasks.probe_instance(987654) is None


def test_it_is_idempotent_for_the_verdict(fleet: list[EngineInstance], all_down: None) -> None:
    for _ in range(5):
        assert tasks.probe_instance(fleet[0].id) is False
    e1 = EngineInstance.objects.get(id=fleet[0].id)
    assert e1.health == "failing" and e1.events.filter(kind="health").count() == 1


def test_it_records_version_probe_errors_without_raising(fleet: list[EngineInstance], all_down: None) -> None:
    out = tasks.probe_versions()
    assert set(out["errors"]) == {"render", "e1", "e2"} and out["drifted"] == []
    assert ProbeResult.objects.filter(kind="version", ok=False).count() == 3


def test_it_prunes_probe_results_past_retention(fleet: list[EngineInstance], settings: object) -> None:
    settings.MOTOR_PROBE_RETENTION_DAYS = 7  # type: ignore[attr-defined]
    old = ProbeResult.objects.create(instance=fleet[0], kind="health", ok=True)
    ProbeResult.objects.filter(id=old.id).update(created=timezone.now() - timedelta(days=8))
    ProbeResult.objects.create(instance=fleet[0], kind="health", ok=True)
    assert tasks.prune_probe_results() == 1
    assert tasks.prune_probe_results() == 0
    assert ProbeResult.objects.count() == 1


def test_it_records_an_audit_of_the_fleet(fleet: list[EngineInstance]) -> None:
    EngineInstance.objects.filter(id=fleet[1].id).update(health="failing", version_drift=True, drift_reason="x")
    report = AuditReport.objects.get(id=tasks.audit_fleet())
    counts = report.summary["counts"]
    assert counts["total"] == 3 and counts["failing"] == 1 and counts["version_drift"] == 1
    assert counts["serving"] == 1 and counts["by_state"]["disabled"] == 1
    assert report.summary["render"]["url"] == "http://render.test:8100"


def test_it_schedules_only_registered_tasks() -> None:
    schedule = app.conf.beat_schedule
    assert set(schedule) == set(tasks.BEAT_SCHEDULE)
    for entry in schedule.values():
        assert entry["task"] in app.tasks
