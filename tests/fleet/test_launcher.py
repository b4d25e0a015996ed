"""What the launcher records about its processes: rows, instance history, and a dead engine taken out."""

from __future__ import annotations

import pytest

from catalog.models import Health, ServedModel
from fleet.models import ControlVersion, EngineInstance, InstanceEvent, ManagedProcess
from fleet.services import instance_create
from motorsite.launcher import records

pytestmark = pytest.mark.django_db


@pytest.fixture
def engine() -> EngineInstance:
    model = ServedModel.objects.create(name="tiny", model_path="/m/tiny")
    instance = instance_create(actor="test", name="e1", url="http://127.0.0.1:8201", served_model_id=model.id)
    EngineInstance.objects.filter(id=instance.id).update(health=Health.HEALTHY, consecutive_successes=5)
    return instance


def version() -> int:
    row = ControlVersion.objects.first()
    return row.value if row else 0


def test_it_links_each_engine_process_to_its_instance_by_port(engine: EngineInstance) -> None:
    records.processes_started(children=[("render", 10, "http://127.0.0.1:8100"), ("engine-1", 11, "http://127.0.0.1:8201")])
    rows = {p.name: p for p in ManagedProcess.objects.all()}
    assert rows["engine-1"].instance == engine and rows["engine-1"].pid == 11
    assert rows["render"].instance is None
    assert {p.state for p in rows.values()} == {ManagedProcess.State.RUNNING}


def test_it_takes_a_dead_engine_out_at_once_and_records_why(engine: EngineInstance) -> None:
    records.processes_started(children=[("engine-1", 11, engine.url)])
    before = version()

    records.process_changed(name="engine-1", state=ManagedProcess.State.BACKOFF, pid=11, restarts=1, reason="killed by SIGKILL")

    engine.refresh_from_db()
    assert engine.health == Health.FAILING and engine.consecutive_successes == 0
    assert version() > before  # coordinators rebuild their snapshot without the engine
    process = ManagedProcess.objects.get(name="engine-1")
    assert (process.state, process.restarts, process.last_exit_reason) == ("backoff", 1, "killed by SIGKILL")
    assert process.last_exit_at is not None
    events = list(InstanceEvent.objects.filter(instance=engine).order_by("id").values_list("kind", "old", "new", "reason"))
    assert events[-2:] == [
        ("process", "running", "backoff", "engine-1 killed by SIGKILL"),
        ("health", "healthy", "failing", "process engine-1 killed by SIGKILL"),
    ]


def test_it_leaves_health_to_the_probes_when_the_engine_is_ready_again(engine: EngineInstance) -> None:
    records.processes_started(children=[("engine-1", 11, engine.url)])
    records.process_changed(name="engine-1", state=ManagedProcess.State.BACKOFF, pid=11, restarts=1, reason="killed by SIGKILL")

    records.process_changed(name="engine-1", state=ManagedProcess.State.RUNNING, pid=12, restarts=1)

    engine.refresh_from_db()
    assert engine.health == Health.FAILING  # taken back by MOTOR_PROBE_RISE successful probes, not here
    process = ManagedProcess.objects.get(name="engine-1")
    assert (process.state, process.pid, process.last_exit_reason) == ("running", 12, "killed by SIGKILL")


def test_it_ignores_processes_it_never_registered_and_marks_all_stopped(engine: EngineInstance) -> None:
    records.processes_started(children=[("engine-1", 11, engine.url)])
    assert records.process_changed(name="render-2", state="running", pid=5, restarts=0) is None
    assert records.processes_stopped() == 1
    assert ManagedProcess.objects.get(name="engine-1").state == ManagedProcess.State.STOPPED
