"""PD Hybrid: which topology a prompt takes (union, Handoff or Trigger), from prompt length,
prefix-cache hits and load, falling back to union when P or D is unavailable.

``choose_topology`` is pure (the scheduler calls it with what it knows, tests table it);
``pd_topology_policy`` binds it to the scheduler's load, eligibility and KV affinity as the
scheduler's ``topology_policy``; ``install`` does that for one scheduler (the composition root).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)

from serving.pipeline.errors import NoCapacity
from serving.pipeline.placement.filters import eligible_instances, pd_role
from serving.pipeline.placement.scheduler import Placement
from serving.pipeline.snapshot import FleetSnapshot, InstanceView

if TYPE_CHECKING:
    from serving.pipeline.placement.scheduler import Scheduler

logger = logging.getLogger(__name__)

# Prefix hits are reported in blocks of vLLM's default size.
_BLOCK_SIZE = 128

class Topology(enum.Enum):
    # One instance prefills and decodes.
    UNION = "union"
    # P first, D pulls P's KV with the params P returned.
    HANDOFF = "handoff"
    # D first, its metaserver callback starts P, which pushes the KV.
    TRIGGER = "trigger"


# The topology each KV transfer mode of a P/D pair runs.
TRANSFER_TOPOLOGY = {"pull": Topology.HANDOFF, "push": Topology.TRIGGER}


# -- choosing -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PDPolicy:
    """When a fleet with both P/D pairs and union instances sends a request to P/D."""

    # Below this many prompt tokens the prefill is cheap and the extra hop costs more than it saves.
    min_prompt_tokens: int = 256
    # Union wins when its best instance already caches at least this share of the prompt.
    union_cache_share: float = 0.5
    # Union wins when the P/D pair's load exceeds the best union's by more than this (load units
    # are the scheduler's: in-flight tokens or requests per capacity, 0..1 and beyond).
    load_slack: float = 0.25


@dataclass(frozen=True, slots=True)
class TopologyChoice:
    topology: Topology
    reason: str
    prefill: InstanceView | None = None  # Handoff: the P; Trigger: the best P at placement time
    decode: InstanceView | None = None
    # Trigger picks its P only when D's callback arrives; these are the candidates, best first.
    prefill_candidates: tuple[InstanceView, ...] = ()


def pd_instances(
    snapshot: FleetSnapshot, model: str, role: str, *, live: Callable[[InstanceView], bool] = lambda _i: True,
    exclude: Iterable[str] = (),
) -> list[InstanceView]:
    """Eligible instances of ``role`` ("prefill" | "decode") for ``model`` that transfer KV.

    The placement's own eligibility set (``filters.eligible_instances``) with ``live`` as its
    breaker verdict (``Scheduler.eligible``), narrowed to the role.
    """
    return pd_role(eligible_instances(snapshot, model, live=live, exclude=frozenset(exclude)), role)


def pd_ineligible(engine_request: Mapping[str, Any]) -> str:
    """Why ``engine_request`` must run on one instance, or "" if P/D can serve it exactly.

    D computes no prompt tokens, so it cannot return prompt logprobs; several samples per prompt
    would each need their own KV handoff.
    """
    params = engine_request.get("sampling_params") or {}
    if params.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if int(params.get("n") or 1) > 1:
        return "n>1"
    if engine_request.get("kv_transfer_params"):
        # The client brought its own transfer params (render hoists them): not ours to orchestrate.
        return "client_kv_transfer_params"
    return ""


def _pairable(prefills: list[InstanceView], decodes: list[InstanceView]) -> tuple[str, list[InstanceView], list[InstanceView]]:
    """The transfer mode both sides share (pull first), with the instances that speak it."""
    for mode in ("pull", "push"):
        ps = [p for p in prefills if p.kv_transfer == mode]
        ds = [d for d in decodes if d.kv_transfer == mode]
        # A pair must speak one connector; an empty name on either side is taken as a match.
        ds = [d for d in ds if any(not p.kv_connector or not d.kv_connector or p.kv_connector == d.kv_connector for p in ps)]
        if ps and ds:
            return mode, ps, ds
    return "", [], []


def choose_topology(
    *,
    prompt_tokens: int,
    unions: list[InstanceView],
    prefills: list[InstanceView],
    decodes: list[InstanceView],
    load: Callable[[InstanceView], float],
    cached_tokens: Mapping[str, int] | None = None,
    ineligible: str = "",
    policy: PDPolicy = PDPolicy(),
) -> TopologyChoice:
    """Pick the topology of one prompt (PD Hybrid); pure, so the scheduler can table-test it.

    ``unions``/``prefills``/``decodes`` are the eligible instances of each role (see
    ``pd_instances``); ``load`` is the scheduler's load of an instance; ``cached_tokens`` maps
    instance names to the prompt tokens their prefix cache holds (KV affinity). Returns a union
    choice (with no instance: the scheduler picks it) whenever P or D is missing; raises
    ``NoCapacity`` only when nothing at all can serve the prompt.
    """
    cached = cached_tokens or {}
    mode, ps, ds = _pairable(prefills, decodes)
    if not mode:
        if not unions:
            raise NoCapacity("no union instance and no prefill/decode pair can serve this model right now")
        missing = "prefill instance" if not prefills else "decode instance" if not decodes else "matching prefill/decode pair"
        return TopologyChoice(Topology.UNION, f"no {missing}")
    if ineligible:
        if not unions:
            raise NoCapacity(f"this request needs a union instance ({ineligible}) and none is available")
        return TopologyChoice(Topology.UNION, ineligible)
    # P computes the prompt: prefer the one that caches most of it, then the least loaded.
    ps = sorted(ps, key=lambda i: (-cached.get(i.name, 0), load(i), i.name))
    ds = sorted(ds, key=lambda i: (load(i), i.name))
    choice = TopologyChoice(TRANSFER_TOPOLOGY[mode], "", ps[0], ds[0], tuple(ps))
    if not unions:
        return _with_reason(choice, "only prefill/decode instances")
    if prompt_tokens < policy.min_prompt_tokens:
        return TopologyChoice(Topology.UNION, f"short prompt ({prompt_tokens} < {policy.min_prompt_tokens} tokens)")
    best_union_cached = max((cached.get(u.name, 0) for u in unions), default=0)
    if prompt_tokens and best_union_cached >= policy.union_cache_share * prompt_tokens:
        return TopologyChoice(Topology.UNION, f"prefix cached on a union instance ({best_union_cached} tokens)")
    pd_load = max(load(ps[0]), load(ds[0]))
    union_load = min(load(u) for u in unions)
    if pd_load > union_load + policy.load_slack:
        return TopologyChoice(Topology.UNION, f"prefill/decode busier ({pd_load:.2f} vs {union_load:.2f})")
    return _with_reason(choice, "long prompt")


def _with_reason(choice: TopologyChoice, reason: str) -> TopologyChoice:
    return TopologyChoice(choice.topology, reason, choice.prefill, choice.decode, choice.prefill_candidates)


def pd_topology_policy(
    load: Callable[[InstanceView], float],
    *,
    cached_tokens: Callable[[FleetSnapshot, str, Sequence[int]], Mapping[str, int]] | None = None,
    policy: PDPolicy = PDPolicy(),
    block_size: Callable[[str], int] = lambda _name: _BLOCK_SIZE,
) -> Callable[[FleetSnapshot, str, Sequence[int], list[InstanceView], list[InstanceView]], Placement | None]:
    """A ``Scheduler(topology_policy=...)`` for PD Hybrid: a P/D ``Placement``, or None for union.

    ``load`` is the scheduler's load per instance; the P and D candidates come from the
    placement's eligibility set the scheduler hands over (``pool``, every role, already filtered);
    ``cached_tokens`` is KV affinity's prefix-hit lookup (tokens cached per instance name) and
    ``block_size`` each instance's KV block size (prefix hits are reported in P's blocks).
    Requests P/D cannot serve exactly (``pd_ineligible``) never reach it: the scheduler keeps
    them on union (``Scheduler.place(pd_ineligible=...)``).
    """

    def place(
        snapshot: FleetSnapshot, model: str, prompt_ids: Sequence[int], unions: list[InstanceView],
        pool: list[InstanceView],
    ) -> Placement | None:
        prefills = pd_role(pool, "prefill")
        decodes = pd_role(pool, "decode")
        if not prefills and not decodes:
            return None  # a union-only fleet: the scheduler's own path, no log noise
        cached = cached_tokens(snapshot, model, prompt_ids) if cached_tokens is not None else {}
        try:
            choice = choose_topology(
                prompt_tokens=len(prompt_ids), unions=unions, prefills=prefills, decodes=decodes,
                load=load, cached_tokens=cached, policy=policy,
            )
        except NoCapacity:
            return None  # the scheduler raises its own NoCapacity for an empty union list
        logger.debug("topology model=%s prompt_tokens=%d topology=%s reason=%s",
                     model, len(prompt_ids), choice.topology.value, choice.reason)
        if choice.topology is Topology.UNION or choice.prefill is None or choice.decode is None:
            return None
        hit = cached.get(choice.prefill.name, 0) // max(1, block_size(choice.prefill.name))
        return Placement(choice.topology.value, (choice.prefill, choice.decode), prefix_hit_blocks=hit)

    return place


def install(scheduler: Scheduler, *, policy: PDPolicy = PDPolicy()) -> None:
    """Turn PD Hybrid on in ``scheduler`` (``serving.runtime`` calls this once per process).

    A fleet without P/D instances is unaffected: the policy then leaves every request to union.
    The scheduler's KV affinity index (when it has one) adds prefix hits to the choice, in each
    instance's own block size: one index for placement and policy.
    """
    index = scheduler.affinity
    cached = scheduler.cached_tokens if index is not None else None
    scheduler.topology_policy = pd_topology_policy(
        lambda i: scheduler.load.inflight(i.name) / max(i.weight, 1),
        cached_tokens=cached,
        policy=policy,
        block_size=index.block_size if index is not None else (lambda _name: _BLOCK_SIZE),
    )
