"""Placement filters: the one eligibility set every path places from, and its role filters.

An instance is eligible when it serves the model (its own, or a LoRA adapter it holds:
``InstanceView.serves``), takes new requests (active, not draining),
fits the deployment's obfuscation (``obfuscation.eligible``: the key id its weights were
permuted with), is not excluded by an earlier attempt, and passes the live verdict
(the scheduler's: its health probe and its circuit breaker). Without a live verdict the
set is the snapshot's static one (what routing asks before placement: does any engine load a
tokenizer). Union, P/D and the native path (union instances' own API, or P/D pairs' in
``topologies/native_pd.py``) then only pick roles and capabilities out of that one set; scoring and picking follow in
``scheduler.py`` (union) and ``topologies/hybrid.py`` (P/D).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from serving.pipeline.obfuscation.keyring import eligible as key_eligible
from serving.pipeline.snapshot import FleetSnapshot, InstanceView

# The KV transfer modes a P/D pair can run (pull: Handoff, push: Trigger).
KV_TRANSFER_MODES = ("pull", "push")

# The live half of eligibility (probe health and the in-memory breaker): ``Scheduler.eligible``.
Live = Callable[[InstanceView], bool]


def _always(_instance: InstanceView) -> bool:
    return True


def statically_eligible(instance: InstanceView, snapshot: FleetSnapshot, model: str) -> bool:
    """The half of eligibility the snapshot alone decides: serves ``model`` (a LoRA adapter's
    request only on an engine that holds the adapter), takes new requests, fits the obfuscation key
    (``pools.build_pool`` keeps it per snapshot, adding the probe's verdict)."""
    return instance.serves(model) and instance.takes_new_requests and key_eligible(instance, snapshot.render)[0]


def eligible_instances(
    snapshot: FleetSnapshot, model: str, *, live: Live = _always, exclude: Collection[str] = ()
) -> list[InstanceView]:
    """The eligibility set of ``model`` (see the module docstring), in snapshot order."""
    return [
        i for i in snapshot.instances
        if i.name not in exclude and statically_eligible(i, snapshot, model) and live(i)
    ]


def is_union(instance: InstanceView, *, requires_tokenizer: bool = False) -> bool:
    """A token-only instance that prefills and decodes on its own (with a tokenizer when asked)."""
    return instance.role == "union" and instance.token_generate and (instance.tokenizer or not requires_tokenizer)


def union_role(pool: Iterable[InstanceView], *, requires_tokenizer: bool = False) -> list[InstanceView]:
    """The union instances of ``pool`` (``is_union``)."""
    return [i for i in pool if is_union(i, requires_tokenizer=requires_tokenizer)]


def pd_role(pool: Iterable[InstanceView], role: str) -> list[InstanceView]:
    """Token-only instances of ``role`` ("prefill" | "decode") that transfer KV."""
    return [i for i in pool if i.role == role and i.token_generate and i.kv_transfer in KV_TRANSFER_MODES]


def native_role(pool: Iterable[InstanceView], kind: str | None = None) -> list[InstanceView]:
    """Union instances that serve their own OpenAI API (its route for request ``kind``, when given:
    ``InstanceView.serves_native``, what the capability probe found)."""
    return [i for i in pool if i.role == "union" and i.serves_native(kind)]


def native_pd_role(pool: Iterable[InstanceView], role: str, kind: str | None = None) -> list[InstanceView]:
    """Instances of ``role`` ("prefill" | "decode") that serve their own OpenAI API (for ``kind``)
    and transfer KV: the native path's P/D pairs (``topologies/native_pd.py``)."""
    return [i for i in pool if i.role == role and i.serves_native(kind) and i.kv_transfer in KV_TRANSFER_MODES]


def pairs_with(prefill: InstanceView, decode: InstanceView) -> bool:
    """Whether a prefill and a decode instance can move KV to each other: one transfer mode, and
    one connector (a blank one on either side is taken as the other's)."""
    return prefill.kv_transfer == decode.kv_transfer and (
        not prefill.kv_connector or not decode.kv_connector or prefill.kv_connector == decode.kv_connector
    )


def has_native_pd(snapshot: FleetSnapshot, model: str, kind: str | None = None) -> bool:
    """Whether ``model`` has a prefill and a decode instance that pair, whatever their state, and
    could serve the native path (for ``kind``) together."""
    pool = [i for i in snapshot.instances if i.serves(model)]
    prefills, decodes = native_pd_role(pool, "prefill", kind), native_pd_role(pool, "decode", kind)
    return any(pairs_with(p, d) for p in prefills for d in decodes)


def unpaired_native_pd(snapshot: FleetSnapshot, model: str, kind: str | None = None) -> str:
    """Why ``model``'s prefill and decode instances that serve their own OpenAI API (for ``kind``)
    form no pair (their transfer modes or connectors differ), or "" when some pair, or there are
    not both.

    What a refusal says instead of "no engine serves its own OpenAI API", which they do."""
    pool = [i for i in snapshot.instances if i.serves(model)]
    prefills, decodes = native_pd_role(pool, "prefill", kind), native_pd_role(pool, "decode", kind)
    if not prefills or not decodes or any(pairs_with(p, d) for p in prefills for d in decodes):
        return ""

    def kinds(instances: list[InstanceView], field: str) -> str:
        return "/".join(sorted({getattr(i, field) or "-" for i in instances}))

    if not {p.kv_transfer for p in prefills} & {d.kv_transfer for d in decodes}:
        return (f"its prefill engines transfer KV by {kinds(prefills, 'kv_transfer')} and its decode engines "
                f"by {kinds(decodes, 'kv_transfer')}")
    return (f"its prefill engines use the KV connector {kinds(prefills, 'kv_connector')} and its decode engines "
            f"{kinds(decodes, 'kv_connector')}")
