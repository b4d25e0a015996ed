"""``services.probes_enqueue``: one health check queued per instance, None when the broker refuses."""

from __future__ import annotations

import pytest
from kombu.exceptions import OperationalError

from fleet import services, tasks
from fleet.models import EngineInstance


def test_it_queues_one_probe_per_instance(engine_up: EngineInstance, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[int] = []
    monkeypatch.setattr(tasks.probe_instance, "delay_on_commit", sent.append)
    assert services.probes_enqueue(instance_ids=[engine_up.id, engine_up.id]) == 2
    assert sent == [engine_up.id, engine_up.id]


def test_it_returns_none_when_the_broker_refuses(engine_up: EngineInstance, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(instance_id: int) -> None:
        raise OperationalError("connection refused")

    monkeypatch.setattr(tasks.probe_instance, "delay_on_commit", refuse)
    assert services.probes_enqueue(instance_ids=[engine_up.id]) is None
