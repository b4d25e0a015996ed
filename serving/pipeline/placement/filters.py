"""Placement filters: which instances may take a request at all, before any scoring.

``Scheduler.eligible`` is the live verdict (probe health and the in-memory breaker); the role
and capability filters below select the candidates of each path from the snapshot.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from serving.pipeline.snapshot import FleetSnapshot, InstanceView

if TYPE_CHECKING:
    from serving.pipeline.placement.scheduler import Scheduler


def native_instances(snapshot: FleetSnapshot, model: str) -> list[InstanceView]:
    """Union instances of ``model`` that take new requests and serve their own OpenAI API."""
    return [
        i for i in snapshot.instances
        if i.model == model and i.native_openai and i.takes_new_requests and i.role == "union"
    ]


def native_candidates(
    snapshot: FleetSnapshot, scheduler: Scheduler, model: str, *, exclude: Collection[str] = ()
) -> list[InstanceView]:
    """Eligible native-API instances of ``model``, least loaded (requests per weight) first."""
    return sorted(
        (i for i in native_instances(snapshot, model) if i.name not in exclude and scheduler.eligible(i)),
        key=lambda i: (scheduler.load.inflight(i.name) / max(i.weight, 1), i.name),
    )
