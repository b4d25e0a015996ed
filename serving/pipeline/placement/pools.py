"""The static half of eligibility, computed once per snapshot and model instead of per request.

What ``filters.eligible_instances`` decides from the snapshot alone (serves the model, takes new
requests, fits the obfuscation key, passes its health probe) cannot change until the control
plane publishes a new snapshot, so the scheduler keeps it here and applies only the live half
(breakers, exclusions, load) per decision. Union instances are kept in name order: the order the
scorers fall back to between equally loaded instances.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from serving.pipeline.placement.filters import eligible_instances, union_role
from serving.pipeline.snapshot import FleetSnapshot, InstanceView


@dataclass(frozen=True, slots=True)
class ModelPool:
    union: tuple[InstanceView, ...]  # union role, token generate, by name
    union_tokenizer: tuple[InstanceView, ...]  # the same with an engine tokenizer
    by_name: Mapping[str, InstanceView]  # every statically eligible instance of the model
    has_pd: bool  # any prefill or decode instance: the topology policy has a choice to make


def _probed_healthy(instance: InstanceView) -> bool:
    return instance.healthy


def build_pool(snapshot: FleetSnapshot, model: str) -> ModelPool:
    # The probe's verdict is in the snapshot too; only the breaker is left for each decision.
    static = eligible_instances(snapshot, model, live=_probed_healthy)
    union = tuple(sorted(union_role(static), key=lambda i: i.name))
    return ModelPool(
        union=union,
        union_tokenizer=tuple(i for i in union if i.tokenizer),
        by_name={i.name: i for i in static},
        has_pd=any(i.role in ("prefill", "decode") for i in static),
    )


class PoolCache:
    """The pools of the latest snapshot seen; a new snapshot object starts over."""

    def __init__(self) -> None:
        self._snapshot: FleetSnapshot | None = None
        self._pools: dict[str, ModelPool] = {}

    def get(self, snapshot: FleetSnapshot, model: str) -> ModelPool:
        if snapshot is not self._snapshot:
            self._snapshot, self._pools = snapshot, {}
        pool = self._pools.get(model)
        if pool is None:
            pool = self._pools[model] = build_pool(snapshot, model)
        return pool
