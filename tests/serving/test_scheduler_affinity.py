"""KV-cache affinity in placement: a request goes where its prefix is cached, unless that instance
is busier than the least loaded one by more than the margin; breaker-open and unhealthy instances
never win; obfuscation scores physical ids; approximate mode records, precise mode waits for
events; the process's event hub follows the snapshot and closes cleanly.

Prompts are longer than a block (128 tokens): only full blocks are cached.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from enginesim.kvcache import EventPublisher, PrefixCache
from serving.pipeline.flow_control.admission import TokenAdmission
from serving.pipeline.obfuscation import keyring as obfuscation
from serving.pipeline.obfuscation.mapping import TokenMapping
from serving.pipeline.placement.kv_affinity import KVAffinityIndex
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Placement, Scheduler
from serving.pipeline.resilience.breaker import BreakerBoard
from serving.pipeline.topologies.hybrid import PDPolicy, pd_topology_policy
from tests.serving.fakes import MODEL, fleet_snapshot, instance

E1, E2 = instance("e1"), instance("e2")
BLOCK = 128
PREFIX = [(7 * i + 3) % 4000 for i in range(3 * BLOCK)]  # three full blocks


def prompt(suffix: int) -> list[int]:
    return PREFIX + [suffix, suffix + 1, suffix + 2]


def scheduler(**kwargs: object) -> Scheduler:
    kwargs.setdefault("affinity", KVAffinityIndex())
    kwargs.setdefault("admission", TokenAdmission())
    return Scheduler(LoadTracker(), **kwargs)  # type: ignore[arg-type]


def assert_idle(s: Scheduler) -> None:
    assert s.load.snapshot() == {}
    assert s.admission.inflight_tokens() == {}
    assert s.admission.waiting() == 0


def test_a_request_goes_where_its_prefix_is_cached() -> None:
    s = scheduler()
    assert s.affinity is not None
    s.affinity.record("e2", PREFIX)
    placed = s.place(fleet_snapshot(E1, E2), MODEL, prompt(10))
    assert placed == Placement("union", (E2,), 3)
    # No prefix anywhere: the least loaded (then by name) instance, no hit.
    assert s.place(fleet_snapshot(E1, E2), MODEL, list(range(500, 800))) == Placement("union", (E1,), 0)
    assert_idle(s)


def test_a_prompt_shorter_than_a_block_never_hits() -> None:
    s = scheduler()
    assert s.affinity is not None
    s.affinity.record("e2", PREFIX[: BLOCK - 1])
    assert s.place(fleet_snapshot(E1, E2), MODEL, PREFIX[: BLOCK - 1]) == Placement("union", (E1,), 0)


def test_the_longest_cached_prefix_wins() -> None:
    s = scheduler()
    assert s.affinity is not None
    s.affinity.record("e1", PREFIX[:BLOCK])
    s.affinity.record("e2", PREFIX)
    assert s.place(fleet_snapshot(E1, E2), MODEL, prompt(1)).instances == (E2,)


@pytest.mark.parametrize(
    ("extra", "expected"), [(0, "e2"), (100, "e2"), (101, "e1")], ids=["equal", "at-margin", "past-margin"]
)
async def test_load_overrides_affinity_past_the_margin(extra: int, expected: str) -> None:
    admission = TokenAdmission()
    s = scheduler(admission=admission, load_margin_tokens=100)
    assert s.affinity is not None
    s.affinity.record("e2", PREFIX)
    base_e1, base_e2 = await admission.acquire(E1, 50), await admission.acquire(E2, 50 + extra)
    placed = s.place(fleet_snapshot(E1, E2), MODEL, prompt(1), tokens=10)
    assert placed.instances[0].name == expected
    assert placed.prefix_hit_blocks == (3 if expected == "e2" else 0)
    base_e1.release()
    base_e2.release()
    assert_idle(s)


async def test_an_instance_without_token_room_loses_its_affinity() -> None:
    admission = TokenAdmission()
    small = replace(E2, token_capacity=600)
    s = scheduler(admission=admission, load_margin_tokens=10_000)
    assert s.affinity is not None
    s.affinity.record("e2", PREFIX)
    lease = await admission.acquire(small, 500)
    assert s.place(fleet_snapshot(E1, small), MODEL, prompt(1), tokens=400).instances == (E1,)
    lease.release()
    assert_idle(s)


@pytest.mark.parametrize("fault", ["breaker-open", "unhealthy", "draining"])
def test_a_faulty_instance_never_wins_by_affinity(fault: str) -> None:
    breakers = BreakerBoard(threshold=1)
    e2 = E2
    if fault == "breaker-open":
        breakers.failure(E2, "down")
    elif fault == "unhealthy":
        e2 = replace(E2, healthy=False)
    else:
        e2 = replace(E2, state="draining")
    s = scheduler(breakers=breakers)
    assert s.affinity is not None
    s.affinity.record("e2", PREFIX)
    assert s.place(fleet_snapshot(E1, e2), MODEL, prompt(1)) == Placement("union", (E1,), 0)


def test_approximate_mode_records_the_placed_prompt_and_precise_mode_waits_for_events() -> None:
    s = scheduler()
    assert s.affinity is not None
    assert s.place(fleet_snapshot(E1, E2), MODEL, prompt(1), exclude={"e1"}).instances == (E2,)
    assert s.affinity.match("e2", prompt(2)) == 3
    # The prefix is on e2 now: the next request sharing it follows, though e1 comes first when idle.
    assert s.place(fleet_snapshot(E1, E2), MODEL, prompt(3)) == Placement("union", (E2,), 3)

    precise = replace(E1, kv_events_endpoint="ipc:///nonexistent")
    s2 = scheduler()
    assert s2.affinity is not None
    s2.place(fleet_snapshot(precise, E2), MODEL, prompt(1))
    assert s2.affinity.blocks("e1") == 0


def test_obfuscation_scores_and_records_physical_ids() -> None:
    from serving import runtime

    mapping = TokenMapping.from_key(b"affinity-test-key", 4096)
    obfuscation.register_mapping(mapping)
    try:
        # Engines that take obfuscated traffic declare the deployment's key id.
        e1, e2 = (replace(e, obfuscation_key_id=mapping.key_id) for e in (E1, E2))
        snap = fleet_snapshot(e1, e2)
        snap = replace(snap, render=replace(snap.render, obfuscation=True, obfuscation_key_id=mapping.key_id))
        physical = mapping.to_physical(PREFIX)
        assert physical != PREFIX

        s = scheduler(engine_ids=runtime.engine_ids)
        assert s.affinity is not None
        s.affinity.record("e2", physical)
        s.affinity.record("e1", PREFIX)  # the semantic ids no engine ever sees
        assert s.place(snap, MODEL, prompt(1)) == Placement("union", (e2,), 3)

        fresh = [(11 * i + 5) % 4000 for i in range(2 * BLOCK)]
        placed = s.place(snap, MODEL, fresh)
        assert s.affinity.match(placed.names, mapping.to_physical(fresh)) == 2
        assert s.affinity.match(placed.names, fresh) == 0
    finally:
        obfuscation.clear_mappings()


def test_the_topology_policy_gets_engine_ids_and_a_cached_tokens_lookup_of_its_shape() -> None:
    p = replace(E1, id=3, name="p1", role="prefill", kv_transfer="pull")
    d = replace(E1, id=4, name="d1", role="decode", kv_transfer="pull")
    s = scheduler(engine_ids=lambda _snap, ids: [i + 1 for i in ids])
    assert s.affinity is not None
    shifted = [i + 1 for i in PREFIX]
    s.affinity.record("e2", shifted)
    snap = fleet_snapshot(E1, E2, p, d)
    assert s.cached_tokens(snap, MODEL, shifted) == {"e2": 3 * BLOCK}
    seen: list[list[int]] = []
    pd = pd_topology_policy(lambda _i: 0.0, cached_tokens=s.cached_tokens,
                            policy=PDPolicy(min_prompt_tokens=1))

    def policy(snapshot, model, ids, candidates, exclude):  # type: ignore[no-untyped-def]
        seen.append(list(ids))
        return pd(snapshot, model, ids, candidates, exclude)

    s.topology_policy = policy
    # e2 caches the whole prefix: PD Hybrid keeps it union, and union follows the prefix.
    assert s.place(snap, MODEL, prompt(1)) == Placement("union", (E2,), 3)
    assert seen == [[i + 1 for i in prompt(1)]]


async def test_the_event_hub_follows_the_snapshot_indexes_events_and_closes(tmp_path: Path) -> None:
    from serving import runtime

    before = asyncio.all_tasks()
    endpoint = f"ipc://{tmp_path}/e2.ipc"
    cache = PrefixCache(BLOCK, 64, EventPublisher(endpoint))
    e2 = replace(E2, kv_events_endpoint=endpoint)
    snap = replace(fleet_snapshot(E1, e2), version=101)
    runtime.affinity.forget("e1")
    runtime.affinity.forget("e2")
    s = scheduler(affinity=runtime.affinity)
    try:
        runtime.sync_kv_events(snap)
        hub = runtime.kv_event_hub()
        assert hub is not None and set(hub.subscribers) == {"e2"}
        runtime.sync_kv_events(snap)  # same version: nothing restarts
        subscriber = hub.subscribers["e2"]
        await subscriber.wait_ready()
        # A PUB drops what it sends before the subscription reaches it: publish until indexed.
        for _ in range(500):
            cache.clear()
            cache.store(PREFIX)
            await asyncio.sleep(0.01)
            if runtime.affinity.blocks("e2") == 3:
                break
        assert runtime.affinity.blocks("e2") == 3
        assert s.place(snap, MODEL, prompt(1)) == Placement("union", (e2,), 3)
        assert runtime.affinity.blocks("e2") == 3  # precise mode: placement recorded nothing

        # A new version without the endpoint stops the subscriber and forgets its blocks.
        runtime.sync_kv_events(replace(snap, version=102, instances=(E1, E2)))
        assert hub.subscribers == {} and runtime.affinity.blocks("e2") == 0
        assert s.place(snap, MODEL, prompt(1)).prefix_hit_blocks == 0
        # An instance gone from the fleet is forgotten in approximate mode too.
        assert runtime.affinity.blocks("e1") == 3
        runtime.sync_kv_events(replace(snap, version=103, instances=(E2,)))
        assert runtime.affinity.blocks("e1") == 0
    finally:
        await runtime.aclose_kv_events()
        cache.publisher.close()  # type: ignore[union-attr]
    assert runtime.kv_event_hub() is None
    assert asyncio.all_tasks() - before - {asyncio.current_task()} == set()  # type: ignore[operator]
    assert_idle(s)
