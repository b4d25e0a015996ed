"""``demo_fleet`` (every ``make run``) brings the demo instances up to date through the fleet's
services and model methods: what it changes on an existing instance is in that instance's history."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command

from fleet.models import EngineInstance, InstanceEvent


def demo_fleet(*engines: str) -> None:
    args = ["demo_fleet", "--model-dir", "/m", "--engine-kind", "sim"]
    for url in engines:
        args += ["--engine", url]
    call_command(*args, stdout=io.StringIO())


@pytest.mark.django_db
def test_a_second_run_records_what_it_changed_in_each_instances_history() -> None:
    demo_fleet("http://127.0.0.1:8201", "http://127.0.0.1:8202")
    first, second = EngineInstance.objects.order_by("name")
    assert (first.name, second.name) == ("union-1", "union-2")
    assert first.quarantine(reason="bad answers", actor="admin:alice")  # left so by the last run
    EngineInstance.objects.filter(id=second.id).update(health="failing")  # the probes' verdict

    demo_fleet("http://127.0.0.1:8301", "http://127.0.0.1:8202")  # union-1 now on another port

    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.state, first.url) == ("active", "http://127.0.0.1:8301")
    history = [(e.kind, e.old, e.new, e.actor, e.reason) for e in InstanceEvent.objects.filter(instance=first)]
    assert history == [
        ("state", "quarantined", "active", "demo_fleet", ""),
        ("config", "", "changed", "demo_fleet", "url"),
        ("state", "active", "quarantined", "admin:alice", "bad answers"),
    ]
    # Nothing changed on union-2: no history row, and the probes' column is not the command's.
    assert not InstanceEvent.objects.filter(instance=second).exists()
    assert second.health == "failing"


@pytest.mark.django_db
def test_a_run_with_fewer_engines_removes_the_others() -> None:
    demo_fleet("http://127.0.0.1:8201", "http://127.0.0.1:8202")
    demo_fleet("http://127.0.0.1:8201")
    assert list(EngineInstance.objects.values_list("name", flat=True)) == ["union-1"]
