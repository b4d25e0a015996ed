"""Placement scorers and profiles: each score in [0, 1], weights trade affinity against load."""

from __future__ import annotations

from dataclasses import replace

import pytest

from serving.pipeline.placement import scorers
from serving.pipeline.placement.kv_affinity import KVAffinityIndex
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Placement, Scheduler
from serving.pipeline.snapshot import FleetSnapshot, InstanceView, ScorerWeights
from tests.serving.fakes import MODEL, fleet_snapshot, instance

BLOCK = 4
E1, E2 = instance("e1"), instance("e2")
E3 = replace(E1, id=3, name="e3", url="http://127.0.0.1:9003")
PROMPT = list(range(4 * BLOCK))


def weighted(snapshot: FleetSnapshot, weights: ScorerWeights) -> FleetSnapshot:
    return replace(snapshot, models={MODEL: replace(snapshot.models[MODEL], scorer_weights=weights)})


def busy_holder() -> tuple[Scheduler, FleetSnapshot]:
    """e2 caches three of the prompt's four blocks and has two requests in flight; e1, e3 are idle."""
    index = KVAffinityIndex(default_block_size=BLOCK)
    index.record("e2", PROMPT[: 3 * BLOCK])
    s = Scheduler(LoadTracker(), affinity=index)
    return s, fleet_snapshot(E1, E2, E3)


def test_it_scores_each_candidate_in_the_unit_interval() -> None:
    s, _ = busy_holder()
    with s.load.hold(E2), s.load.hold(E2), s.load.hold(E3):
        ctx = s.scoring_context(PROMPT)
        candidates = [E1, E3, E2]  # the load order
        assert scorers.prefix(candidates, ctx) == [0.0, 0.0, 0.75]  # three of four blocks
        assert scorers.queue(candidates, ctx) == [1.0, 0.5, 0.0]  # least loaded 1, most 0
        assert scorers.tokens(candidates, ctx) == [1.0, 1.0, 1.0]  # nothing admitted: all equal


def test_it_sends_a_cached_prefix_to_its_busy_holder_by_default() -> None:
    s, snapshot = busy_holder()
    with s.load.hold(E2), s.load.hold(E2):
        assert s.place(snapshot, MODEL, PROMPT) == Placement("union", (E2,), 3)


@pytest.mark.parametrize(("weights", "expected"), [
    (ScorerWeights(prefix=1, queue=1), "e1"),  # 0.75 of the prompt cached on e2 against the queue spread: 0.75 < 1
    (ScorerWeights(prefix=2, queue=1), "e2"),  # affinity weighted above load: 2 * 0.75 > 1
    (ScorerWeights(prefix=0, queue=1), "e1"),
])
def test_it_trades_a_cached_prefix_against_load_by_weight(weights: ScorerWeights, expected: str) -> None:
    s, snapshot = busy_holder()
    with s.load.hold(E2), s.load.hold(E2):
        assert s.place(weighted(snapshot, weights), MODEL, PROMPT).instances[0].name == expected


def test_it_ignores_a_cached_prefix_when_affinity_weighs_nothing() -> None:
    s, snapshot = busy_holder()
    assert s.place(weighted(snapshot, ScorerWeights(prefix=0)), MODEL, PROMPT) == Placement("union", (E1,), 0)


def test_it_reads_the_weights_of_the_model_it_places() -> None:
    s, snapshot = busy_holder()
    other: InstanceView = replace(E1, name="o1", model="other")
    snapshot = replace(weighted(snapshot, ScorerWeights(prefix=0)), instances=(*snapshot.instances, other))
    assert s.weights(snapshot, MODEL) == ScorerWeights(prefix=0)
    assert s.weights(snapshot, "other") == ScorerWeights()  # not in the snapshot's models: the defaults
