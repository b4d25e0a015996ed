"""Placement scorers: named, each scores every union candidate in [0, 1], higher is better.

A profile (``profile.py``) adds them up with the model's weights (``ScorerWeights``) and picks the
highest total; ties go to the load order (``union_key``: can start now, fewest requests per
weight, fewest in-flight tokens per capacity, then the name), so a placement is deterministic.

- ``prefix``: KV-cache affinity, the candidate's cached leading blocks of the prompt over the
  prompt's full blocks (1: the whole prompt is cached there). It abstains (scores every candidate
  0) when the candidate it alone would pick holds more than the least loaded candidate but has
  more than ``margin`` in-flight tokens above it (``MOTOR_AFFINITY_LOAD_MARGIN_TOKENS``): a queue
  behind a hot instance costs more than computing the prefix again.
- ``queue``: requests in flight per instance weight, min-max normalised over the candidates
  (the least loaded scores 1, the most 0; all equal: all 1).
- ``tokens``: admitted tokens in flight per token capacity, normalised the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from serving.pipeline.flow_control.admission import TokenAdmission
from serving.pipeline.placement.kv_affinity import KVAffinityIndex, PromptBlocks
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.snapshot import InstanceView


def union_key(
    load: LoadTracker, admission: TokenAdmission, tokens: int, *, inflight: Mapping[str, int] | None = None
) -> Callable[[InstanceView], tuple[float | str, ...]]:
    """The load order of union candidates for a request of ``tokens`` admission tokens, best
    first: can start now, requests per weight, tokens per capacity, name.

    ``inflight`` is ``admission.inflight_tokens()`` when the caller already read it.
    """
    if inflight is None:
        inflight = admission.inflight_tokens()  # once per placement, not once per candidate

    def key(i: InstanceView) -> tuple[float | str, ...]:
        # An instance that can start the request now beats one it would wait on.
        no_room = 0.0 if admission.has_room(i, tokens) else 1.0
        return (no_room, requests_per_weight(load, i), tokens_per_capacity(inflight, i), i.name)

    return key


def requests_per_weight(load: LoadTracker, i: InstanceView) -> float:
    return load.inflight(i.name) / max(i.weight, 1)


def tokens_per_capacity(inflight: Mapping[str, int], i: InstanceView) -> float:
    return inflight.get(i.name, 0) / max(i.token_capacity, 1)


@dataclass(slots=True)
class ScoringContext:
    """What the scorers of one placement read: the live load and the prompt's cached prefix."""

    load: LoadTracker
    admission: TokenAdmission
    tokens: int  # the request's admission tokens
    blocks: PromptBlocks  # the prompt, as the engines see it
    affinity: KVAffinityIndex | None
    margin: int  # the prefix scorer's load margin, in tokens
    inflight: Mapping[str, int] = field(default_factory=dict)  # admission.inflight_tokens(), read once
    _depths: dict[str, int] | None = None

    @property
    def depths(self) -> Mapping[str, int]:
        """Leading cached blocks per instance holding at least the prompt's first block."""
        if self._depths is None:
            self._depths = self.affinity.depths(self.blocks) if self.affinity is not None else {}
        return self._depths

    def order(self) -> Callable[[InstanceView], tuple[float | str, ...]]:
        return union_key(self.load, self.admission, self.tokens, inflight=self.inflight)


# A scorer: one score in [0, 1] per candidate, in the candidates' order (best first by load).
Scorer = Callable[[Sequence[InstanceView], ScoringContext], list[float]]


def prefix(candidates: Sequence[InstanceView], ctx: ScoringContext) -> list[float]:
    """The share of the prompt's full blocks each candidate caches; see the module docstring for
    when it abstains. ``candidates`` come in the load order (the first is the least loaded)."""
    depths = ctx.depths
    got = [depths.get(i.name, 0) for i in candidates]
    if not candidates or not any(got):
        return [0.0] * len(candidates)
    # The candidate affinity alone would pick: the deepest, the earliest in the load order among equals.
    best = max(range(len(candidates)), key=lambda n: (got[n], -n))
    if got[best] > got[0]:
        hot = ctx.inflight.get(candidates[best].name, 0) - ctx.inflight.get(candidates[0].name, 0)
        if hot > ctx.margin:
            return [0.0] * len(candidates)
    # One denominator for all (the prompt's blocks at the smallest block size among holders), so
    # instances of different block sizes compare by blocks, as the ranking before weights did.
    assert ctx.affinity is not None  # depths are empty without an index
    index = ctx.affinity
    total = max(len(ctx.blocks) // index.block_size(i.name) for i, d in zip(candidates, got, strict=True) if d)
    return [d / total for d in got]


def _least_scores_one(values: list[float]) -> list[float]:
    low, high = min(values), max(values)
    if high == low:
        return [1.0] * len(values)
    return [(high - v) / (high - low) for v in values]


def queue(candidates: Sequence[InstanceView], ctx: ScoringContext) -> list[float]:
    """Requests in flight per instance weight, min-max normalised: the least loaded scores 1."""
    return _least_scores_one([requests_per_weight(ctx.load, i) for i in candidates]) if candidates else []


def tokens(candidates: Sequence[InstanceView], ctx: ScoringContext) -> list[float]:
    """Admitted tokens in flight per token capacity, min-max normalised: the least loaded scores 1."""
    return _least_scores_one([tokens_per_capacity(ctx.inflight, i) for i in candidates]) if candidates else []


# The scorers by the name their weight has (``ScorerWeights``' fields, ``ServedModel.*_weight``).
SCORERS: Mapping[str, Scorer] = {"prefix": prefix, "queue": queue, "tokens": tokens}
