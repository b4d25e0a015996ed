"""Placement: which instances run a request, and in which topology.

``Scheduler.place`` returns a ``Placement``: the topology ("union" | "handoff" | "trigger"),
its instances (union: one; handoff / trigger: prefill then decode) and the prefix-hit blocks
that decided it. Candidates are the model's token-only instances that take new requests, pass
their health probe and whose circuit breaker lets traffic through; among them the least loaded
(in-flight requests per weight, then in-flight tokens) wins, so concurrent requests spread.
KV-cache affinity and P/D topologies plug in through ``topology_policy`` (kv_affinity.py,
topologies.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from serving.pipeline.errors import NoCapacity
from serving.pipeline.router.breaker import BreakerBoard
from serving.pipeline.router.flow_control import TokenAdmission
from serving.pipeline.snapshot import FleetSnapshot, InstanceView


@dataclass(frozen=True, slots=True)
class Placement:
    topology: str  # union | handoff | trigger
    instances: tuple[InstanceView, ...]  # union: (engine,); handoff / trigger: (prefill, decode)
    prefix_hit_blocks: int = 0

    @property
    def names(self) -> str:
        return ",".join(i.name for i in self.instances)


# A topology policy may replace the union default: given the request's prompt ids and the
# eligible union candidates (best first), return a Placement or None to keep union.
TopologyPolicy = Callable[[FleetSnapshot, str, Sequence[int], list[InstanceView], Collection[str]], "Placement | None"]


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
    ) -> None:
        self.load = load
        self.breakers = breakers or BreakerBoard()
        self.admission = admission or TokenAdmission()
        self.topology_policy = topology_policy

    def eligible(self, instance: InstanceView) -> bool:
        """Probe health and the breaker are separate signals; either keeps traffic away."""
        return instance.healthy and self.breakers.allows(instance)

    def candidates(
        self, snapshot: FleetSnapshot, model: str, *, exclude: Collection[str] = (), requires_tokenizer: bool = False,
        tokens: int = 0,
    ) -> list[InstanceView]:
        """Eligible union instances for ``model``, best first."""
        out = [
            i for i in snapshot.union_instances(model)
            if i.name not in exclude and self.eligible(i) and (i.tokenizer or not requires_tokenizer)
        ]
        inflight = self.admission.inflight_tokens()
        return sorted(out, key=lambda i: (
            not self.admission.has_room(i, tokens),
            self.load.inflight(i.name) / max(i.weight, 1),
            inflight.get(i.name, 0) / max(i.token_capacity, 1),
            i.name,
        ))

    def place(
        self, snapshot: FleetSnapshot, model: str, prompt_ids: Sequence[int], *, tokens: int = 0,
        exclude: Collection[str] = (), requires_tokenizer: bool = False,
    ) -> Placement:
        """Choose where one prompt runs; raise ``NoCapacity`` when no instance can take it."""
        candidates = self.candidates(
            snapshot, model, exclude=exclude, requires_tokenizer=requires_tokenizer, tokens=tokens
        )
        if self.topology_policy is not None and not requires_tokenizer:
            placed = self.topology_policy(snapshot, model, prompt_ids, candidates, exclude)
            if placed is not None:
                return placed
        if not candidates:
            raise NoCapacity(f"no engine instance can serve model {model!r} right now")
        return Placement("union", (candidates[0],))

    def pick_union(self, snapshot: FleetSnapshot, model: str, *, exclude: set[str] = frozenset()) -> InstanceView:  # type: ignore[assignment]
        """Return the least loaded union instance for ``model``; raise ``NoCapacity`` if none."""
        candidates = self.candidates(snapshot, model, exclude=exclude)
        if not candidates:
            raise NoCapacity(f"no engine instance can serve model {model!r} right now")
        return candidates[0]
