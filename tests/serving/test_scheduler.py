"""Placement: eligible candidates (health, breaker, capability), load and token spreading, the
topology seam, and the shape of a ``Placement``."""

from __future__ import annotations

from dataclasses import replace

import pytest

from serving.pipeline.errors import NoCapacity
from serving.pipeline.flow_control.admission import TokenAdmission
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Placement, Scheduler
from serving.pipeline.resilience.breaker import BreakerBoard
from tests.serving.fakes import MODEL, fleet_snapshot, instance

E1, E2 = instance("e1"), instance("e2")


def scheduler(**kwargs: object) -> Scheduler:
    return Scheduler(LoadTracker(), **kwargs)  # type: ignore[arg-type]


def test_it_places_union_on_the_least_loaded_instance() -> None:
    s = scheduler()
    snap = fleet_snapshot(E1, E2)
    first = s.place(snap, MODEL, [1, 2, 3])
    assert first == Placement("union", (E1,), 0)
    with s.load.hold(E1):
        assert s.place(snap, MODEL, [1, 2, 3]).instances == (E2,)


@pytest.mark.parametrize(
    ("e1", "expected"),
    [
        (replace(E1, healthy=False), "e2"),
        (replace(E1, state="draining"), "e2"),
        (replace(E1, token_generate=False), "e2"),
        (replace(E1, role="prefill"), "e2"),
        (replace(E1, model="other"), "e2"),
        (E1, "e1"),
    ],
    ids=["unhealthy", "draining", "no-token-generate", "prefill-role", "other-model", "eligible"],
)
def test_only_eligible_instances_are_candidates(e1: object, expected: str) -> None:
    assert scheduler().place(fleet_snapshot(e1, E2), MODEL, [1]).instances[0].name == expected  # type: ignore[arg-type]


def test_an_open_breaker_keeps_traffic_away() -> None:
    breakers = BreakerBoard(threshold=1)
    breakers.failure(E1, "down")
    assert scheduler(breakers=breakers).place(fleet_snapshot(E1, E2), MODEL, [1]).instances == (E2,)


def test_requests_needing_an_engine_tokenizer_go_only_to_tokenizer_engines() -> None:
    e2 = replace(E2, tokenizer=True)
    s = scheduler()
    with s.load.hold(e2), s.load.hold(e2):
        assert s.place(fleet_snapshot(E1, e2), MODEL, [1], requires_tokenizer=True).instances == (e2,)
    with pytest.raises(NoCapacity):
        s.place(fleet_snapshot(E1, E2), MODEL, [1], requires_tokenizer=True)


async def test_instances_with_token_room_come_first() -> None:
    admission = TokenAdmission()
    small = replace(E1, token_capacity=100)
    s = scheduler(admission=admission)
    lease = await admission.acquire(small, 90)
    assert s.place(fleet_snapshot(small, E2), MODEL, [1], tokens=50).instances == (E2,)
    lease.release()


def test_exclusions_and_no_capacity() -> None:
    s = scheduler()
    assert s.place(fleet_snapshot(E1, E2), MODEL, [1], exclude={"e1"}).instances == (E2,)
    with pytest.raises(NoCapacity):
        s.place(fleet_snapshot(E1, E2), MODEL, [1], exclude={"e1", "e2"})


def test_a_topology_policy_can_choose_handoff() -> None:
    p = replace(E1, id=3, name="p1", role="prefill", kv_transfer="pull")
    d = replace(E2, id=4, name="d1", role="decode", kv_transfer="pull")
    seen = []

    def policy(snapshot, model, prompt_ids, candidates, pool):  # type: ignore[no-untyped-def]
        seen.append((model, list(prompt_ids), [c.name for c in candidates], [i.name for i in pool]))
        return Placement("handoff", (p, d), prefix_hit_blocks=2)

    s = scheduler(topology_policy=policy)
    placement = s.place(fleet_snapshot(E1, E2, p, d), MODEL, [7, 8])
    assert placement.topology == "handoff" and placement.names == "p1,d1" and placement.prefix_hit_blocks == 2
    assert seen == [(MODEL, [7, 8], ["e1", "e2"], ["e1", "e2", "p1", "d1"])]


def test_a_topology_policy_is_not_consulted_for_a_union_only_model() -> None:
    def policy(*_args):  # type: ignore[no-untyped-def]
        raise AssertionError("consulted without prefill or decode instances")

    assert scheduler(topology_policy=policy).place(fleet_snapshot(E1, E2), MODEL, [7]).instances == (E1,)
