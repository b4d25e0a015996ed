"""A placement profile: filter -> score -> pick over one request's union candidates.

The candidates are the eligibility set's union instances (``filters.py``: serves the model,
takes requests, healthy, breaker closed, not excluded). A profile then

1. filters them (``CandidateFilter``s, in order; a filter that would leave none keeps them all,
   so a filter only ever prefers);
2. scores them with every named scorer (``scorers.SCORERS``) whose weight is above zero, each
   score in [0, 1], and adds the scores up times their weights;
3. picks the highest total; equal totals go to the load order (``scorers.union_key``), so the
   pick is deterministic and the default weights give exactly the ranking before weights.

This is the whole rule, scoring every candidate; ``Scheduler.place`` reaches the same pick
faster for profiles that do not weigh load (``tests/serving/test_scheduler_equivalence.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from serving.pipeline.placement.scorers import SCORERS, Scorer, ScoringContext
from serving.pipeline.snapshot import InstanceView, ScorerWeights

# Keeps the candidates it prefers, in their order; the profile ignores an empty answer.
CandidateFilter = Callable[[Sequence[InstanceView], ScoringContext], list[InstanceView]]


def can_start_now(candidates: Sequence[InstanceView], ctx: ScoringContext) -> list[InstanceView]:
    """Candidates admission lets start the request now: never wait for room elsewhere."""
    return [i for i in candidates if ctx.admission.has_room(i, ctx.tokens)]


# Every profile's filters, in the order they apply. They prefer; what an engine must have to serve
# a request at all (a capability, an adapter) belongs in the eligibility set (``filters.py``),
# which both the profile and the scheduler's fast path read. A preference added here must be
# taught to the fast path too (``Scheduler._least_loaded`` and ``_union`` apply
# ``can_start_now`` by hand); ``tests/serving/test_scheduler_equivalence.py`` fails until it is.
FILTERS: tuple[CandidateFilter, ...] = (can_start_now,)


@dataclass(frozen=True, slots=True)
class Pick:
    instance: InstanceView
    score: float  # the weighted total
    prefix_hit_blocks: int  # the instance's cached leading blocks of the prompt


@dataclass(frozen=True, slots=True)
class Profile:
    filters: tuple[CandidateFilter, ...]
    scorers: tuple[tuple[str, Scorer, float], ...]  # name, scorer, weight (> 0)

    @classmethod
    def of(cls, weights: ScorerWeights, *, filters: tuple[CandidateFilter, ...] = FILTERS) -> Profile:
        """The profile a model's weights describe; scorers weighted 0 are not run."""
        return cls(filters, tuple((name, SCORERS[name], w) for name, w in weights.by_name().items() if w > 0))

    def pick(self, candidates: Sequence[InstanceView], ctx: ScoringContext) -> Pick | None:
        """The best candidate by the module docstring's rule; None when there is none."""
        kept = sorted(candidates, key=ctx.order())  # the scorers and the tie-break read the load order
        for keep in self.filters:
            kept = keep(kept, ctx) or kept
        if not kept:
            return None
        totals = [0.0] * len(kept)
        for _name, scorer, weight in self.scorers:
            for n, score in enumerate(scorer(kept, ctx)):
                totals[n] += weight * score
        # The first of the highest totals: ``kept`` is in the load order, so ties go to it.
        best = max(range(len(kept)), key=lambda n: (totals[n], -n))
        instance = kept[best]
        return Pick(instance, totals[best], ctx.depths.get(instance.name, 0))
