"""State flips of engines and breakers: compare-and-set, history rows, and P/D validation."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from catalog.models import ServedModel
from fleet import services
from fleet.models import BreakerFlip, BreakerState, EngineInstance, InstanceEvent
from fleet.services import PDDeclaration, pd_problems


def test_it_drains_once_and_writes_one_history_row(engine_up: EngineInstance) -> None:
    assert engine_up.drain(actor="alice")
    assert not engine_up.drain(actor="bob")  # already draining: the second flip is refused
    events = list(InstanceEvent.objects.filter(instance=engine_up).values_list("old", "new", "actor"))
    assert events == [("active", "draining", "alice")]


def test_it_refuses_a_flip_when_the_row_changed_behind_the_object(engine_up: EngineInstance) -> None:
    stale = EngineInstance.objects.get(id=engine_up.id)
    assert engine_up.quarantine(reason="probe", actor="worker-1")
    # ``stale`` still thinks the engine is active; the database decides.
    assert not stale.undrain(actor="worker-2")
    assert EngineInstance.objects.get(id=engine_up.id).state == "quarantined"


@pytest.mark.parametrize(
    ("action", "start", "allowed"),
    [
        ("drain", "active", True), ("drain", "draining", False), ("undrain", "active", False),
        ("undrain", "draining", True), ("quarantine", "disabled", False), ("quarantine", "draining", True),
        ("disable", "quarantined", True), ("disable", "disabled", False), ("activate", "active", False),
        ("activate", "disabled", True),
    ],
)
def test_it_allows_state_changes_by_table(engine_up: EngineInstance, action: str, start: str, allowed: bool) -> None:
    EngineInstance.objects.filter(id=engine_up.id).update(state=start)
    if allowed:
        services.instance_set_state(instance_id=engine_up.id, action=action, actor="t")
        after = {"drain": "draining", "undrain": "active", "quarantine": "quarantined",
                 "disable": "disabled", "activate": "active"}[action]
        assert EngineInstance.objects.get(id=engine_up.id).state == after
        events = list(InstanceEvent.objects.filter(instance=engine_up).values_list("old", "new", "actor"))
        assert events == [(start, after, "t")]
    else:
        with pytest.raises(services.ConflictError, match=f"Cannot {action}"):
            services.instance_set_state(instance_id=engine_up.id, action=action, actor="t")
        assert EngineInstance.objects.get(id=engine_up.id).state == start


def test_it_bumps_the_control_version_on_every_change(engine_up: EngineInstance) -> None:
    before = services.read_control_version()
    services.instance_set_state(instance_id=engine_up.id, action="drain", actor="t")
    services.breaker_force_open(instance_id=engine_up.id, actor="t", seconds=5)
    assert services.read_control_version() == before + 2


def test_operator_breaker_actions_bump_the_epoch_and_record_flips(engine_up: EngineInstance) -> None:
    breaker = services.breaker_force_open(instance_id=engine_up.id, actor="alice", seconds=30)
    assert (breaker.state, breaker.epoch, breaker.open_seconds) == ("open", 1, 30)
    assert breaker.open_until > timezone.now()
    breaker = services.breaker_reset(instance_id=engine_up.id, actor="bob")
    assert (breaker.state, breaker.epoch, breaker.open_until) == ("closed", 2, None)
    flips = list(BreakerFlip.objects.filter(instance=engine_up).order_by("id").values_list("old_state", "new_state", "actor"))
    assert flips == [("closed", "open", "alice"), ("open", "closed", "bob")]


def test_request_path_record_does_not_bump_the_epoch(engine_up: EngineInstance) -> None:
    until = timezone.now() + timedelta(seconds=4)
    assert services.breaker_record(
        instance_id=engine_up.id, new_state="open", reason="3 failures", epoch=0, consecutive_failures=3,
        open_until=until, open_seconds=4.0,
    )
    breaker = BreakerState.objects.get(instance=engine_up)
    assert (breaker.state, breaker.epoch, breaker.consecutive_failures) == ("open", 0, 3)
    assert BreakerFlip.objects.get(instance=engine_up).actor == "request path"


def test_a_write_back_decided_before_an_operator_reset_is_dropped(engine_up: EngineInstance) -> None:
    services.breaker_reset(instance_id=engine_up.id, actor="alice")  # epoch 0 -> 1
    stale = {"new_state": "open", "reason": "3 failures", "consecutive_failures": 3, "open_until": None, "open_seconds": 5.0}
    assert not services.breaker_record(instance_id=engine_up.id, epoch=0, **stale)
    breaker = BreakerState.objects.get(instance=engine_up)
    assert (breaker.state, breaker.epoch) == ("closed", 1)
    assert list(BreakerFlip.objects.filter(instance=engine_up).values_list("actor", flat=True)) == ["alice"]
    assert services.breaker_record(instance_id=engine_up.id, epoch=1, **stale)  # decided after it: recorded
    assert BreakerState.objects.get(instance=engine_up).state == "open"


def test_recording_for_a_deleted_instance_is_a_no_op(db: None) -> None:
    assert not services.breaker_record(
        instance_id=999, new_state="open", reason="x", epoch=0, consecutive_failures=1, open_until=None, open_seconds=1.0
    )


def _d(name: str, role: str, *, hw: str = "cpu", conn: str = "NixlConnector", transfer: str = "", tp: int = 1) -> PDDeclaration:
    return PDDeclaration(None, name, role, 1, hw, conn, transfer, tp)


@pytest.mark.parametrize(
    ("p", "d", "problem"),
    [
        (_d("p", "prefill"), _d("d", "decode"), None),
        (_d("p", "prefill", hw="A2"), _d("d", "decode"), "same hardware generation"),
        (_d("p", "prefill", hw="A2"), _d("d", "decode", hw="A3"), "'d' is A3"),
        (_d("p", "prefill", hw="A3"), _d("d", "decode", hw="A3"), None),
        (_d("p", "prefill", conn="MooncakeLayerwiseConnector"), _d("d", "decode"), "incompatible KV connectors"),
        (_d("p", "prefill", conn="MooncakeLayerwiseConnector", transfer="pull"), _d("d", "decode"), "Handoff (pull) needs a pull connector"),
        (_d("p", "prefill", conn="NixlConnector", transfer="push"), _d("d", "decode", conn="MooncakeLayerwiseConnector"), "Trigger (push) needs a push"),
        (_d("p", "prefill", conn=""), _d("d", "decode"), "needs a KV connector"),
        (_d("p", "prefill", tp=4), _d("d", "decode", tp=2), None),
        (_d("p", "prefill", tp=2), _d("d", "decode", tp=4), "P's TP is a larger multiple"),
        (_d("p", "prefill", tp=3), _d("d", "decode", tp=2), "P's TP is a larger multiple"),
        (_d("p", "prefill", conn="MooncakeLayerwiseConnector"), _d("d", "decode", conn="MooncakeLayerwiseConnector"), None),
    ],
)
def test_it_validates_pd_pairs_by_table(p: PDDeclaration, d: PDDeclaration, problem: str | None) -> None:
    # Registering P then D, or D then P: the pair is refused (or accepted) either way.
    for candidate, other in ((p, d), (d, p)):
        problems = pd_problems(candidate, [other]) + pd_problems(other, [])
        if problem is None:
            assert problems == []
        else:
            assert any(problem in text for text in problems), problems


def test_it_refuses_a_decode_instance_incompatible_with_the_registered_prefill(served_model: ServedModel) -> None:
    services.instance_create(
        actor="t", name="p1", url="http://p1.test:1", role="prefill", served_model_id=served_model.id,
        kv_connector="NixlConnector", tp=2,
    )
    with pytest.raises(services.InvalidError, match="same hardware generation: 'd1' is A3, 'p1' is cpu"):
        services.instance_create(
            actor="t", name="d1", url="http://d1.test:1", role="decode", served_model_id=served_model.id,
            kv_connector="NixlConnector", hardware_kind="A3",
        )
    assert not EngineInstance.objects.filter(name="d1").exists()


@pytest.mark.parametrize(
    ("url", "valid"),
    [
        ("http://engine-1:8201", True),  # a compose or Kubernetes service name
        ("http://prefill-1:8211", True),
        ("http://127.0.0.1:8201", True),
        ("http://engine_1:8201", False),
        ("http://engine 1:8201", False),
        ("engine-1:8201", False),
    ],
)
def test_an_engine_is_registered_by_its_service_name(served_model: ServedModel, url: str, valid: bool) -> None:
    fields = dict(served_model=served_model, role=EngineInstance.Role.UNION)
    if valid:
        instance = services.instance_create(actor="test", name="e", url=url, **fields)
        assert EngineInstance.objects.get(id=instance.id).url == url
    else:
        with pytest.raises(services.InvalidError, match="url"):
            services.instance_create(actor="test", name="e", url=url, **fields)
