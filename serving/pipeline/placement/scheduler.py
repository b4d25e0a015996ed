"""Placement: which instances run a request, and in which topology.

``Scheduler.place`` returns a ``Placement``: the topology ("union" | "handoff" | "trigger"),
its instances (union: one; handoff / trigger: prefill then decode) and the prefix-hit blocks
that decided it. Filter -> score -> pick: the eligibility set is computed once per placement
(``filters.eligible_instances``: serves the model, takes new requests, passes its health probe,
fits the obfuscation key, not excluded, breaker lets traffic through); union candidates are
scored (``scorers.union_key``: room now, requests per weight, tokens per capacity) so the least
loaded comes first and concurrent requests spread; then KV affinity may pick a prefix holder
instead (below). P/D topologies pick from the same set through ``topology_policy``
(``topologies/hybrid.py``).

KV-cache affinity (``affinity``, a ``KVAffinityIndex``) then bends the union choice toward the
instance that already caches the prompt's leading blocks. The rule, in tokens:

- score every union candidate by its cached leading full blocks of the prompt, over the ids
  the engines see (``engine_ids``: physical ids when obfuscation is on);
- the candidate with the most blocks wins (ties: the least loaded, i.e. the earlier candidate),
  unless its in-flight tokens exceed the least loaded candidate's by more than
  ``load_margin_tokens`` (``MOTOR_AFFINITY_LOAD_MARGIN_TOKENS``): then the least loaded wins and
  the prefix is computed again there, because a queue behind a hot instance costs more than a
  prefill;
- only candidates with token room like the least loaded one's compete, so affinity never sends
  a request to wait for admission that would run elsewhere now.

Breaker-open, unhealthy and draining instances are never candidates, whatever they cache.
After placing, the prompt's blocks are recorded on every placed instance that publishes no KV
events (approximate mode); an instance with ``kv_events_endpoint`` is indexed only from its
events (precise mode, ``serving.runtime`` keeps the subscriptions).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from serving.pipeline.errors import NoCapacity
from serving.pipeline.flow_control.admission import TokenAdmission
from serving.pipeline.placement import scorers
from serving.pipeline.placement.filters import eligible_instances, union_role
from serving.pipeline.placement.kv_affinity import KVAffinityIndex
from serving.pipeline.protocol import TopologyName
from serving.pipeline.resilience.breaker import BreakerBoard
from serving.pipeline.snapshot import FleetSnapshot, InstanceView

# How many more in-flight tokens than the least loaded candidate an instance holding the prompt's
# prefix may have and still win: about two long prompts' prefill on a small engine.
DEFAULT_AFFINITY_LOAD_MARGIN_TOKENS = 8192


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
# engines' (``Scheduler.engine_ids``), so prefix lookups match.
TopologyPolicy = Callable[[FleetSnapshot, str, Sequence[int], list[InstanceView], list[InstanceView]], "Placement | None"]

# The ids the engines see for a prompt's semantic ids under ``snapshot`` (obfuscation's
# ``to_physical`` when a mapping is active); None: they are the same.
EngineIds = Callable[[FleetSnapshot, Sequence[int]], Sequence[int]]


class LoadTracker:
    """In-process count of requests in flight per instance."""

    def __init__(self) -> None:
        self._inflight: Counter[str] = Counter()

    def inflight(self, name: str) -> int:
        return self._inflight[name]

    @contextmanager
    def hold(self, instance: InstanceView) -> Iterator[None]:
        self._inflight[instance.name] += 1
        try:
            yield
        finally:
            self._inflight[instance.name] -= 1
            if not self._inflight[instance.name]:
                del self._inflight[instance.name]

    def snapshot(self) -> dict[str, int]:
        return dict(self._inflight)


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

    def eligible(self, instance: InstanceView) -> bool:
        """Probe health and the breaker are separate signals; either keeps traffic away."""
        return instance.healthy and self.breakers.allows(instance)

    def pool(self, snapshot: FleetSnapshot, model: str, *, exclude: Collection[str] = ()) -> list[InstanceView]:
        """The eligibility set of one placement (``filters.eligible_instances`` with this scheduler's
        live verdict): what union, P/D and the native path all pick from."""
        return eligible_instances(snapshot, model, live=self.eligible, exclude=exclude)

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
        """Prefix-hit lookup: leading cached tokens per instance of ``model`` (any role).

        The shape ``topologies.pd_topology_policy(cached_tokens=...)`` takes; ``engine_prompt_ids``
        are the engines' ids, as the scheduler hands them to its topology policy.
        """
        if self.affinity is None:
            return {}
        index = self.affinity
        names = [i.name for i in snapshot.instances if i.model == model]
        return {name: n * index.block_size(name) for name, n in index.scores(names, engine_prompt_ids).items() if n}

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
        # Filter once: every topology below picks from this one set.
        pool = self.pool(snapshot, model, exclude=exclude)
        candidates = self.candidates(
            snapshot, model, requires_tokenizer=requires_tokenizer, tokens=tokens, pool=pool
        )
        placed: Placement | None = None
        if self.topology_policy is not None and not requires_tokenizer and not pd_ineligible:
            placed = self.topology_policy(snapshot, model, ids, candidates, pool)
        if placed is None:
            if not candidates:
                raise NoCapacity(f"no engine instance can serve model {model!r} right now")
            placed = self._union(candidates, ids, tokens)
        self._record(placed, ids)
        return placed

    def _union(self, candidates: list[InstanceView], ids: Sequence[int], tokens: int) -> Placement:
        """The union placement by the module docstring's rule (candidates least loaded first)."""
        least = candidates[0]
        if self.affinity is None:
            return Placement("union", (least,))
        room = self.admission.has_room(least, tokens)
        # Only candidates as able to start now as the least loaded one compete.
        rivals = [i for i in candidates if self.admission.has_room(i, tokens) == room]
        scores = self.affinity.scores([i.name for i in rivals], ids)
        best = max(rivals, key=lambda i: scores[i.name])  # max keeps the first of equals: least loaded
        if best is not least and scores[best.name] > scores[least.name]:
            inflight = self.admission.inflight_tokens()
            if inflight.get(best.name, 0) - inflight.get(least.name, 0) <= self.load_margin_tokens:
                return Placement("union", (best,), scores[best.name])
        return Placement("union", (least,), scores[least.name])

    def _record(self, placement: Placement, ids: Sequence[int]) -> None:
        """Approximate mode: the placed instances will hold the prompt's blocks (a failed attempt
        leaves a guess the engine does not hold; the retry excludes that instance anyway)."""
        if self.affinity is None:
            return
        for instance in placement.instances:
            if not instance.kv_events_endpoint:
                self.affinity.record(instance.name, ids)
