"""Placement scorers: how union candidates are ordered, best first, before the pick.

Each scorer maps an instance to a number where lower is better; ``union_key`` applies them in
order (a later one only breaks ties of the earlier), then the name, so the order is stable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from serving.pipeline.flow_control.admission import TokenAdmission
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.snapshot import InstanceView

Scorer = Callable[[InstanceView], float]


def union_key(
    load: LoadTracker, admission: TokenAdmission, tokens: int, *, inflight: Mapping[str, int] | None = None
) -> Callable[[InstanceView], tuple[float | str, ...]]:
    """The sort key of union candidates for a request of ``tokens`` admission tokens.

    ``inflight`` is ``admission.inflight_tokens()`` when the caller already read it.
    """
    if inflight is None:
        inflight = admission.inflight_tokens()  # once per placement, not once per candidate

    def no_room(i: InstanceView) -> float:
        # An instance that can start the request now beats one it would wait on.
        return 0.0 if admission.has_room(i, tokens) else 1.0

    def requests_per_weight(i: InstanceView) -> float:
        return load.inflight(i.name) / max(i.weight, 1)

    def tokens_per_capacity(i: InstanceView) -> float:
        return inflight.get(i.name, 0) / max(i.token_capacity, 1)

    order: tuple[Scorer, ...] = (no_room, requests_per_weight, tokens_per_capacity)
    return lambda i: (*(score(i) for score in order), i.name)
