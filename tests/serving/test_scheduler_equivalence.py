"""The scheduler's union fast path decides exactly what scoring every candidate decides.

``Scheduler.place`` skips scoring idle instances and looks affinity up only on the prompt's
holders (``placement/pools.py``, ``KVAffinityIndex.depths``). Two references, over the whole
eligibility set: the model's profile (``profile.Profile.pick``: filter, score every candidate
with every weighted scorer, pick), and for the default weights the fixed ranking placement had
before scorers had weights (``reference`` below: sort every candidate by ``scorers.union_key``,
then let the deepest prefix holder among those as able to start win within the load margin).
Random fleets, weights, loads, leases, breakers, exclusions and cached prefixes must give all
of them the same placement.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Collection, Sequence
from contextlib import ExitStack
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from serving.pipeline.flow_control.admission import AdmissionSettings, TokenAdmission
from serving.pipeline.placement import scorers
from serving.pipeline.placement.filters import union_role
from serving.pipeline.placement.kv_affinity import KVAffinityIndex
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Placement, Scheduler
from serving.pipeline.protocol import BlockRemoved, BlockStored
from serving.pipeline.resilience.breaker import BreakerBoard
from serving.pipeline.snapshot import DEFAULT_SCORER_WEIGHTS, InstanceView, ScorerWeights
from tests.serving.fakes import MODEL, fleet_snapshot, instance

BLOCK = 16
PREFIXES = [[p * 1000 + t for t in range(4 * BLOCK)] for p in range(3)]


def random_weights(rng: random.Random) -> ScorerWeights:
    return rng.choice([
        DEFAULT_SCORER_WEIGHTS,
        ScorerWeights(prefix=rng.choice([0.0, 0.5, 3.0])),  # no load scorer: the fast path
        ScorerWeights(prefix=rng.choice([0.0, 0.4, 1.0, 10.0]), queue=rng.choice([0.0, 0.3, 1.0, 5.0]),
                      tokens=rng.choice([0.0, 0.7, 2.0])),
    ])


def by_profile(
    s: Scheduler, weights: ScorerWeights, pool: list[InstanceView], ids: Sequence[int], tokens: int,
    exclude: Collection[str], requires_tokenizer: bool,
) -> Placement | None:
    """The profile's pick over every live union candidate, in snapshot order."""
    live = [i for i in pool if i.name not in exclude and i.healthy and s.breakers.allows(i)]
    pick = s.profile(weights).pick(union_role(live, requires_tokenizer=requires_tokenizer),
                                   s.scoring_context(ids, tokens))
    return Placement("union", (pick.instance,), pick.prefix_hit_blocks) if pick is not None else None


def reference(
    s: Scheduler, pool: list[InstanceView], ids: Sequence[int], tokens: int, exclude: Collection[str],
    requires_tokenizer: bool,
) -> Placement | None:
    live = [i for i in pool if i.name not in exclude and i.healthy and s.breakers.allows(i)]
    candidates = sorted(union_role(live, requires_tokenizer=requires_tokenizer),
                        key=scorers.union_key(s.load, s.admission, tokens))
    if not candidates:
        return None
    least = candidates[0]
    assert s.affinity is not None
    room = s.admission.has_room(least, tokens)
    rivals = [i for i in candidates if s.admission.has_room(i, tokens) == room]
    depths = s.affinity.depths(ids)
    scores = {i.name: depths.get(i.name, 0) for i in rivals}
    best = max(rivals, key=lambda i: scores[i.name])
    if best is not least and scores[best.name] > scores[least.name]:
        inflight = s.admission.inflight_tokens()
        if inflight.get(best.name, 0) - inflight.get(least.name, 0) <= s.load_margin_tokens:
            return Placement("union", (best,), scores[best.name])
    return Placement("union", (least,), scores[least.name])


@settings(max_examples=500, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(1, 12))
def test_it_places_as_scoring_every_candidate_would(seed: int, size: int) -> None:
    rng = random.Random(seed)
    fleet = []
    for n in range(1, size + 1):
        i = replace(
            instance("e1"), id=n, name=f"e{n}", url=f"http://127.0.0.1:{9000 + n}", weight=rng.choice([1, 1, 2, 3]), token_capacity=rng.choice([64, 256, 65536]),
            tokenizer=rng.random() < 0.4, healthy=rng.random() < 0.9,
            state=rng.choice(["active"] * 8 + ["draining"]), role=rng.choice(["union"] * 6 + ["prefill"]),
            token_generate=rng.random() < 0.95,
        )
        fleet.append(i)
    rng.shuffle(fleet)  # snapshot order is not name order
    snapshot = fleet_snapshot(*fleet)
    weights = random_weights(rng)
    snapshot = replace(snapshot, models={MODEL: replace(snapshot.models[MODEL], scorer_weights=weights)})
    breakers = BreakerBoard(threshold=1)
    admission = TokenAdmission(AdmissionSettings(queue_size=16, wait_s=0.0))
    # A small per-instance LRU evicts blocks out of order (gaps in a chain); some instances use
    # another block size (their prefixes are another chain of hashes).
    index = KVAffinityIndex(default_block_size=BLOCK, max_blocks_per_instance=rng.choice([3, 6, 64]))
    s = Scheduler(LoadTracker(), breakers=breakers, admission=admission, affinity=index,
                  load_margin_tokens=rng.choice([0, 50, 8192]))
    for i in fleet:
        if rng.random() < 0.15:
            index.set_block_size(i.name, BLOCK // 2)
        if rng.random() < 0.15:
            breakers.failure(i, "down")
        for _ in range(rng.choice([0, 0, 1, 2])):
            index.record(i.name, rng.choice(PREFIXES)[: rng.randrange(1, 5) * BLOCK])
        if rng.random() < 0.3:  # a prefix from KV events, then one of its blocks evicted: a gap
            size = index.block_size(i.name)
            tokens = rng.choice(PREFIXES)
            hashes: list[bytes | int] = [f"{i.name}-{k}".encode() for k in range(len(tokens) // size)]
            index.apply_events(i.name, [
                BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=size),
                BlockRemoved(block_hashes=[rng.choice(hashes)]),
            ])
    with ExitStack() as held:
        leases = []
        for i in fleet:
            for _ in range(rng.choice([0, 0, 0, 1, 2])):
                held.enter_context(s.load.hold(i))
            if rng.random() < 0.3:
                amount = rng.randrange(1, 300)
                if admission.has_room(i, amount):
                    leases.append(asyncio.run(admission.acquire(i, amount)))
        ids = rng.choice(PREFIXES)[: rng.randrange(0, 5) * BLOCK] + [7] * rng.randrange(0, 20)
        tokens = rng.choice([0, 10, 100, 1000])
        exclude = {i.name for i in fleet if rng.random() < 0.1}
        requires_tokenizer = rng.random() < 0.2
        pool = [i for i in snapshot.instances if i.model == MODEL and i.takes_new_requests]
        expected = by_profile(s, weights, pool, ids, tokens, exclude, requires_tokenizer)
        if weights.prefix > 0 and not weights.weighs_load:  # the default weights, or a multiple of them
            assert expected == reference(s, pool, ids, tokens, exclude, requires_tokenizer)
        try:
            got: Placement | None = s.place(snapshot, MODEL, ids, tokens=tokens, exclude=exclude,
                                            requires_tokenizer=requires_tokenizer)
        except Exception as exc:  # NoCapacity: the reference found no candidate either
            assert expected is None, exc
            got = None
        assert got == expected
        for lease in leases:
            lease.release()
    assert admission.inflight_tokens() == {} and s.load.snapshot() == {}
