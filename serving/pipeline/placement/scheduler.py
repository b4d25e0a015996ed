"""Placement: which instances run a request, and in which topology.

``Scheduler.place`` returns a ``Placement``: the topology ("union" | "handoff" | "trigger"),
its instances (union: one; handoff / trigger: prefill then decode) and the prefix-hit blocks
that decided it. Filter -> score -> pick: the eligibility set is computed once per placement
(``filters.eligible_instances``: serves the model, takes new requests, passes its health probe,
fits the obfuscation key, not excluded, breaker lets traffic through); its union instances are
then filtered, scored and picked by the model's profile (``profile.Profile``: prefer those that
can start now; named scorers ``prefix``, ``queue``, ``tokens`` in [0, 1] weighted by the
model's ``ScorerWeights``; the highest total wins, ties to the load order ``scorers.union_key``).
P/D topologies pick from the same set through ``topology_policy`` (``topologies/hybrid.py``).

With the default weights (``prefix`` 1, the load scorers 0) the rule reads, in tokens:

- score every union candidate by its cached leading full blocks of the prompt, over the ids
  the engines see (``engine_ids``: physical ids when obfuscation is on);
- the candidate with the most blocks wins (ties: the least loaded, i.e. the earlier candidate),
  unless its in-flight tokens exceed the least loaded candidate's by more than
  ``load_margin_tokens`` (``MOTOR_AFFINITY_LOAD_MARGIN_TOKENS``): then the least loaded wins and
  the prefix is computed again there, because a queue behind a hot instance costs more than a
  prefill;
- only candidates with token room like the least loaded one's compete, so affinity never sends
  a request to wait for admission that would run elsewhere now.

A profile that weighs no load scorer is placed by that rule without scoring the fleet
(``_least_loaded``, then the prefix's holders only, ``_union``); one that does scores every
candidate (the normalisation needs every candidate's load). Both pick what ``Profile.pick``
picks (``tests/serving/test_scheduler_equivalence.py``).

Breaker-open, unhealthy and draining instances are never candidates, whatever they cache.
After placing, the prompt's blocks are recorded on every placed instance that publishes no KV
events (approximate mode); an instance with ``kv_events_endpoint`` is indexed only from its
events (precise mode, ``serving.runtime`` keeps the subscriptions).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Callable, Sequence

from serving.pipeline.errors import NoCapacity
from serving.pipeline.flow_control.admission import TokenAdmission
from serving.pipeline.placement import scorers
from serving.pipeline.placement.filters import eligible_instances, is_union, native_role, union_role
from serving.pipeline.placement.kv_affinity import KVAffinityIndex, PromptBlocks
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.pools import ModelPool, PoolCache
from serving.pipeline.placement.profile import Profile
from serving.pipeline.placement.scorers import ScoringContext
from serving.pipeline.protocol import TopologyName
from serving.pipeline.resilience.breaker import BreakerBoard
from serving.pipeline.snapshot import DEFAULT_SCORER_WEIGHTS, FleetSnapshot, InstanceView, ScorerWeights

# How many more in-flight tokens than the least loaded candidate an instance holding the prompt's
# prefix may have and still win: about two long prompts' prefill on a small engine.
DEFAULT_AFFINITY_LOAD_MARGIN_TOKENS = 8192


def lora_of(snapshot: FleetSnapshot, model: str) -> str | None:
    """``model``'s name when it is a LoRA adapter (its KV is keyed apart from its base's), else None."""
    view = snapshot.models.get(model)
    return model if view is not None and view.base else None


@dataclass(frozen=True, slots=True)
class Placement:
    topology: TopologyName  # union: one instance; handoff / trigger: prefill then decode
    instances: tuple[InstanceView, ...]  # union: (engine,); handoff / trigger: (prefill, decode)
    prefix_hit_blocks: int = 0

    @property
    def names(self) -> str:
        return ",".join(i.name for i in self.instances)


# A topology policy may replace the union default: given the request's prompt ids, the eligible
# union candidates (best first) and the whole eligibility set (``filters.eligible_instances``,
# every role), return a Placement or None to keep union. The prompt ids it receives are the
# engines' (``Scheduler.engine_ids``), so prefix lookups match. It is consulted only for models
# with prefill or decode instances: without them there is no topology to choose.
TopologyPolicy = Callable[[FleetSnapshot, str, Sequence[int], list[InstanceView], list[InstanceView]], "Placement | None"]

# The ids the engines see for a prompt's semantic ids under ``snapshot`` (obfuscation's
# ``to_physical`` when a mapping is active); None: they are the same.
EngineIds = Callable[[FleetSnapshot, Sequence[int]], Sequence[int]]


class Scheduler:
    def __init__(
        self,
        load: LoadTracker,
        *,
        breakers: BreakerBoard | None = None,
        admission: TokenAdmission | None = None,
        topology_policy: TopologyPolicy | None = None,
        affinity: KVAffinityIndex | None = None,
        load_margin_tokens: int = DEFAULT_AFFINITY_LOAD_MARGIN_TOKENS,
        engine_ids: EngineIds | None = None,
    ) -> None:
        self.load = load
        self.breakers = breakers or BreakerBoard()
        self.admission = admission or TokenAdmission()
        self.topology_policy = topology_policy
        self.affinity = affinity
        self.load_margin_tokens = load_margin_tokens
        self.engine_ids = engine_ids
        self._pools = PoolCache()
        self._profiles: dict[ScorerWeights, Profile] = {}

    def weights(self, snapshot: FleetSnapshot, model: str) -> ScorerWeights:
        """``model``'s scorer weights (``ModelView.scorer_weights``), the defaults when unknown."""
        view = snapshot.models.get(model)
        return view.scorer_weights if view is not None else DEFAULT_SCORER_WEIGHTS

    def profile(self, weights: ScorerWeights) -> Profile:
        """The profile of ``weights``, built once per distinct weights."""
        profile = self._profiles.get(weights)
        if profile is None:
            profile = self._profiles[weights] = Profile.of(weights)
        return profile

    def scoring_context(self, ids: Sequence[int] | PromptBlocks, tokens: int = 0) -> ScoringContext:
        """What the scorers of one placement read (``ids``: the engines' prompt ids)."""
        blocks = ids if isinstance(ids, PromptBlocks) else PromptBlocks(ids)
        return ScoringContext(self.load, self.admission, tokens, blocks, self.affinity, self.load_margin_tokens,
                              self.admission.inflight_tokens())

    def eligible(self, instance: InstanceView) -> bool:
        """Probe health and the breaker are separate signals; either keeps traffic away."""
        return instance.healthy and self.breakers.allows(instance)

    def pool(self, snapshot: FleetSnapshot, model: str, *, exclude: Collection[str] = ()) -> list[InstanceView]:
        """The eligibility set of one placement (``filters.eligible_instances`` with this scheduler's
        live verdict): what union, P/D and the native path all pick from."""
        return eligible_instances(snapshot, model, live=self.eligible, exclude=exclude)

    def native_candidates(
        self, snapshot: FleetSnapshot, model: str, *, exclude: Collection[str] = (), kind: str | None = None
    ) -> list[InstanceView]:
        """Eligible native-API instances of ``model`` (that serve ``kind``'s route), least loaded
        (requests per weight) first."""
        return sorted(native_role(self.pool(snapshot, model, exclude=exclude), kind),
                      key=lambda i: (self.load.inflight(i.name) / max(i.weight, 1), i.name))

    def candidates(
        self, snapshot: FleetSnapshot, model: str, *, exclude: Collection[str] = (), requires_tokenizer: bool = False,
        tokens: int = 0, pool: list[InstanceView] | None = None,
    ) -> list[InstanceView]:
        """Eligible union instances for ``model``, best first (``scorers.union_key``)."""
        if pool is None:
            pool = self.pool(snapshot, model, exclude=exclude)
        key = scorers.union_key(self.load, self.admission, tokens)
        return sorted(union_role(pool, requires_tokenizer=requires_tokenizer), key=key)

    def cached_tokens(self, snapshot: FleetSnapshot, model: str, engine_prompt_ids: Sequence[int]) -> dict[str, int]:
        """Prefix-hit lookup: leading cached tokens per placeable instance of ``model`` (any role).

        The shape ``topologies.pd_topology_policy(cached_tokens=...)`` takes; ``engine_prompt_ids``
        are the engines' ids, as the scheduler hands them to its topology policy.
        """
        if self.affinity is None:
            return {}
        index = self.affinity
        # Only instances placement may pick matter, and only prefix holders have a hit.
        placeable = self._pools.get(snapshot, model).by_name
        return {
            name: n * index.block_size(name)
            for name, n in index.depths(PromptBlocks(engine_prompt_ids, lora_of(snapshot, model))).items()
            if name in placeable
        }

    def place(
        self, snapshot: FleetSnapshot, model: str, prompt_ids: Sequence[int], *, tokens: int = 0,
        exclude: Collection[str] = (), requires_tokenizer: bool = False, pd_ineligible: str = "",
    ) -> Placement:
        """Choose where one prompt runs; raise ``NoCapacity`` when no instance can take it.

        ``prompt_ids`` are semantic; affinity and the topology policy see ``engine_ids`` of them.
        ``pd_ineligible`` (``topologies.pd_ineligible``: why P/D cannot serve the request exactly)
        keeps the request on union, away from the topology policy.
        """
        ids = self.engine_ids(snapshot, prompt_ids) if self.engine_ids is not None else prompt_ids
        # Hashed at most once per block size, for lookup and record; a LoRA adapter's chain apart.
        blocks = PromptBlocks(ids, lora_of(snapshot, model))
        static = self._pools.get(snapshot, model)
        weights = self.weights(snapshot, model)
        placed: Placement | None = None
        least: InstanceView | None = None
        if self.topology_policy is not None and static.has_pd and not requires_tokenizer and not pd_ineligible:
            # Filter once: every topology below picks from this one set.
            pool = self.pool(snapshot, model, exclude=exclude)
            candidates = self.candidates(
                snapshot, model, requires_tokenizer=requires_tokenizer, tokens=tokens, pool=pool
            )
            placed = self.topology_policy(snapshot, model, ids, candidates, pool)
            if placed is None and not candidates:
                raise NoCapacity(f"no engine instance can serve model {model!r} right now")
            least = candidates[0] if candidates else None
        if placed is None:
            if weights.weighs_load:
                placed = self._scored(static, blocks, tokens, exclude, requires_tokenizer, weights)
            else:
                least = least or self._least_loaded(static, tokens, exclude, requires_tokenizer)
                if least is not None:
                    placed = self._union(least, static, blocks, tokens, exclude, requires_tokenizer,
                                         affinity=weights.prefix > 0)
            if placed is None:
                raise NoCapacity(f"no engine instance can serve model {model!r} right now")
        self._record(placed, blocks)
        return placed

    def _scored(
        self, static: ModelPool, blocks: PromptBlocks, tokens: int, exclude: Collection[str],
        requires_tokenizer: bool, weights: ScorerWeights,
    ) -> Placement | None:
        """The union placement of a profile that weighs load: every live candidate scored."""
        live = [
            i for i in (static.union_tokenizer if requires_tokenizer else static.union)
            if i.name not in exclude and self.breakers.allows(i)
        ]
        pick = self.profile(weights).pick(live, self.scoring_context(blocks, tokens))
        return Placement("union", (pick.instance,), pick.prefix_hit_blocks) if pick is not None else None

    def _least_loaded(
        self, static: ModelPool, tokens: int, exclude: Collection[str], requires_tokenizer: bool
    ) -> InstanceView | None:
        """``candidates(...)[0]`` without scoring the whole fleet.

        An instance with nothing in flight always fits (admission admits one request of any
        size on an idle instance) and scores zero load, so every idle instance ties and ranks
        before every busy one: the first live idle instance in name order is the least loaded.
        Only when all are busy are the busy ones scored.
        """
        busy_requests = self.load.busy()
        inflight = self.admission.inflight_tokens()
        busy: list[InstanceView] = []
        for i in static.union_tokenizer if requires_tokenizer else static.union:
            if i.name in exclude or not self.breakers.allows(i):
                continue
            if i.name in busy_requests or i.name in inflight:
                busy.append(i)
                continue
            return i
        if not busy:
            return None
        return min(busy, key=scorers.union_key(self.load, self.admission, tokens, inflight=inflight))

    def _union(
        self, least: InstanceView, static: ModelPool, blocks: PromptBlocks, tokens: int, exclude: Collection[str],
        requires_tokenizer: bool = False, *, affinity: bool = True,
    ) -> Placement:
        """The union placement by the module docstring's rule (``least``: the least loaded).

        Only instances holding more of the prompt's leading blocks than ``least`` can beat it, so
        the index's holder sets are read from the deepest block down (``KVAffinityIndex.levels``)
        and the first level with a live union candidate as able to start as ``least`` decides:
        among its instances the least loaded wins. The cost follows the prefix's holders, not
        the fleet.
        """
        if self.affinity is None:
            return Placement("union", (least,))
        index = self.affinity
        levels = index.levels(blocks)
        least_depth = index.depth_of(least.name, levels)
        if not affinity:  # the prefix scorer weighs nothing: the least loaded, whatever it caches
            return Placement("union", (least,), least_depth)
        room = self.admission.has_room(least, tokens)

        def rival(name: str) -> InstanceView | None:
            i = static.by_name.get(name)
            if (
                i is not None and is_union(i, requires_tokenizer=requires_tokenizer)
                and name not in exclude and self.breakers.allows(i) and self.admission.has_room(i, tokens) == room
            ):
                return i
            return None

        best: list[InstanceView] = []
        depth = least_depth
        if len(levels) == 1:
            chain = levels[0]
            # Deepest level first; an instance counts at its real depth (a gap in its chain
            # moves it down), so the first level with a rival holds the deepest ones.
            for level in range(len(chain), least_depth, -1):
                best = [
                    i for name in chain[level - 1]
                    if (i := rival(name)) is not None and index.depth_of(name, levels) == level
                ]
                if best:
                    depth = level
                    break
        elif levels:  # instances of several block sizes: compare every holder's depth
            for name, d in index.depths(blocks).items():
                if d > depth and (i := rival(name)) is not None:
                    best, depth = [i], d
                elif d == depth > least_depth and (i := rival(name)) is not None:
                    best.append(i)
        if best:
            winner = min(best, key=scorers.union_key(self.load, self.admission, tokens))
            inflight = self.admission.inflight_tokens()
            if inflight.get(winner.name, 0) - inflight.get(least.name, 0) <= self.load_margin_tokens:
                return Placement("union", (winner,), depth)
        return Placement("union", (least,), least_depth)

    def _record(self, placement: Placement, ids: PromptBlocks) -> None:
        """Approximate mode: the placed instances will hold the prompt's blocks (a failed attempt
        leaves a guess the engine does not hold; the retry excludes that instance anyway)."""
        if self.affinity is None:
            return
        for instance in placement.instances:
            if not instance.kv_events_endpoint:
                self.affinity.record(instance.name, ids)
