"""Fleet operations called from two or more of admin, API, tasks and commands.

Every function that changes control data ends with ``bump_control_version()`` (inside the same
transaction), which is how coordinator processes learn that their snapshot is stale.
Functions raise the ``motorsite.core`` error tree with a message meant for the operator:
``NotFoundError`` (-> 404), ``ConflictError`` (-> 409), ``InvalidError`` (-> 422).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

from django.core.exceptions import ValidationError
from django.db import DatabaseError, transaction
from django.db.models import Count

from catalog.models import Health, ServedModel
from fleet import ascend
from fleet.models import MAX_PORT, ApiKey, BreakerFlip, BreakerState, EngineInstance, InstanceEvent, hash_key
from motorsite.core import (
    ConflictError,
    InvalidError,
    NotFoundError,
    bump_control_version,
    current_render_config,
    read_control_version,
)

logger = logging.getLogger(__name__)


# -- P/D validation -----------------------------------------------------------------------------

PULL_CONNECTORS = frozenset({"NixlConnector", "MooncakeConnector"})  # Handoff: D pulls P's KV
PUSH_CONNECTORS = frozenset({"MooncakeLayerwiseConnector"})  # Trigger: P pushes layer by layer


@dataclass(frozen=True)
class PDDeclaration:
    """What P/D validation needs from an instance (a saved row or a form/API body not yet saved)."""

    id: int | None
    name: str
    role: str
    served_model_id: int
    hardware_kind: str
    kv_connector: str
    kv_transfer: str
    tp: int

    @classmethod
    def of(cls, i: EngineInstance) -> PDDeclaration:
        return cls(i.id, i.name, i.role, i.served_model_id, i.hardware_kind, i.kv_connector, i.kv_transfer, i.tp)


def _connector_problem(d: PDDeclaration) -> str | None:
    if d.role == EngineInstance.Role.UNION:
        return None
    if not d.kv_connector:
        return f"{d.role} instance {d.name!r} needs a KV connector"
    transfer = d.kv_transfer or ("push" if d.kv_connector in PUSH_CONNECTORS else "pull")
    if transfer == "pull" and d.kv_connector not in PULL_CONNECTORS | {"ExampleConnector"}:
        return (
            f"{d.name!r}: Handoff (pull) needs a pull connector (NixlConnector, MooncakeConnector), "
            f"not {d.kv_connector}"
        )
    if transfer == "push" and d.kv_connector not in PUSH_CONNECTORS | {"ExampleConnector"}:
        return (
            f"{d.name!r}: Trigger (push) needs a push/layer-wise connector (MooncakeLayerwiseConnector), "
            f"not {d.kv_connector}"
        )
    return None


def _transfer(d: PDDeclaration) -> str:
    return d.kv_transfer or ("push" if d.kv_connector in PUSH_CONNECTORS else "pull")


def pd_problems(candidate: PDDeclaration, others: Iterable[PDDeclaration]) -> list[str]:
    """Why ``candidate`` cannot join the P/D group of its served model, given the ``others`` there."""
    problems = []
    own = _connector_problem(candidate)
    if own:
        problems.append(own)
    if candidate.role == EngineInstance.Role.UNION:
        return problems
    opposite = EngineInstance.Role.DECODE if candidate.role == EngineInstance.Role.PREFILL else EngineInstance.Role.PREFILL
    for other in others:
        if other.id is not None and other.id == candidate.id:
            continue
        if other.served_model_id != candidate.served_model_id or other.role != opposite:
            continue
        if other.hardware_kind != candidate.hardware_kind:
            # The seed's limits: KV moves only within one generation (no P on A2 with D on A3).
            problems.append(
                f"P and D of one served model must be of the same hardware generation: {candidate.name!r} is "
                f"{candidate.hardware_kind}, {other.name!r} is {other.hardware_kind}"
            )
        if candidate.kv_connector and other.kv_connector and _transfer(candidate) != _transfer(other):
            problems.append(
                f"incompatible KV connectors: {candidate.name!r} uses {candidate.kv_connector} "
                f"({_transfer(candidate)}), {other.name!r} uses {other.kv_connector} ({_transfer(other)})"
            )
        p, d = (candidate, other) if candidate.role == EngineInstance.Role.PREFILL else (other, candidate)
        ratio = ascend.tp_ratio_problem(p.name, p.tp, d.name, d.tp)
        if ratio:
            problems.append(ratio)
    return problems


def validate_pd(candidate: PDDeclaration) -> None:
    """Raise ``InvalidError`` if ``candidate`` breaks the P/D rules of its served model."""
    others = [
        PDDeclaration.of(i)
        for i in EngineInstance.objects.filter(served_model_id=candidate.served_model_id).exclude(role="union")
    ]
    problems = pd_problems(candidate, others)
    if problems:
        raise InvalidError("; ".join(problems))


# -- vllm-ascend launch arguments ---------------------------------------------------------------


def engine_record(instance: EngineInstance) -> ascend.EngineRecord:
    """``instance`` as ``fleet.ascend`` reads it (``served_model`` should be selected with it)."""
    host, http_port = instance.endpoint()
    return ascend.EngineRecord(
        name=instance.name,
        role=instance.role,
        served_model_id=instance.served_model_id,
        served_model_name=instance.served_model.name,
        model_path=instance.model_dir or instance.served_model.model_path,
        hardware=instance.hardware_kind,
        kv_connector=instance.kv_connector,
        kv_transfer=instance.kv_transfer,
        host=host,
        http_port=http_port,
        kv_port=instance.kv_port,
        tp=instance.tp,
        dp=instance.dp,
        ep=instance.ep,
        max_model_len=instance.max_model_len or instance.served_model.max_model_len,
        # An engine that also serves the native OpenAI API needs its tokenizer: no --tokens-only.
        tokens_only=instance.cap_token_generate and not (instance.cap_native_openai or instance.cap_tokenizer),
        ports=instance.bound_ports(),
    )


def _fleet_records(exclude_id: int | None = None) -> list[ascend.EngineRecord]:
    rows = EngineInstance.objects.select_related("served_model").exclude(id=exclude_id)
    return [engine_record(i) for i in rows]


def instance_ascend_launch(*, instance: EngineInstance) -> ascend.AscendLaunch:
    """vllm-ascend's command for ``instance`` among the fleet; ``InvalidError`` lists every DFX problem."""
    try:
        return ascend.launch_config(engine_record(instance), _fleet_records(exclude_id=instance.id))
    except ascend.AscendConfigError as exc:
        raise InvalidError(str(exc)) from None


def validate_ports(instance: EngineInstance) -> None:
    """Refuse an instance with a KV port whose ports another engine on its host already binds.

    Only instances with a KV port are checked: they are the ones whose launch motorsite produces,
    and a fleet registered before KV ports existed must still save.
    """
    if instance.kv_port is None:
        return
    last = instance.kv_port + instance.dp * instance.tp - 1
    if last > MAX_PORT:
        raise InvalidError(
            f"kv_port {instance.kv_port} with TP {instance.tp} x DP {instance.dp} needs KV handshake ports up to "
            f"{last}, past {MAX_PORT}."
        )
    problems = ascend.port_conflicts(engine_record(instance), _fleet_records(exclude_id=instance.id))
    if problems:
        raise InvalidError("; ".join(problems))


# -- instances ----------------------------------------------------------------------------------

INSTANCE_FIELDS = (
    "name", "url", "role", "served_model_id", "weight", "token_capacity", "max_model_len",
    "cap_token_generate", "cap_native_openai", "cap_tokenizer", "kind", "hardware_kind", "kv_connector",
    "kv_transfer", "kv_port", "kv_events_endpoint", "tp", "dp", "ep", "model_dir", "obfuscation_key_id",
)


def _get(instance_id: int) -> EngineInstance:
    try:
        return EngineInstance.objects.select_related("served_model").get(id=instance_id)
    except EngineInstance.DoesNotExist:
        raise NotFoundError(f"No engine instance with id {instance_id}.") from None


def instance_get(*, instance_id: int) -> EngineInstance:
    """The instance with its served model; ``NotFoundError`` when there is none."""
    return _get(instance_id)


def instance_create(*, actor: str, **fields: Any) -> EngineInstance:
    instance = EngineInstance(**fields)
    return instance_save(instance=instance, actor=actor)


def instance_update(*, instance_id: int, actor: str, **fields: Any) -> EngineInstance:
    """Change the operator fields named in ``fields`` and no other column (a REST PATCH)."""
    instance = _get(instance_id)
    for name, value in fields.items():
        if name not in INSTANCE_FIELDS:
            raise InvalidError(f"Field {name!r} cannot be changed here.")
        setattr(instance, name, value)
    return instance_save(instance=instance, actor=actor, fields=tuple(fields))


def instance_save(*, instance: EngineInstance, actor: str, fields: Iterable[str] | None = None) -> EngineInstance:
    """Validate ``instance`` and save it: a new one whole, an existing one only its ``fields``.

    ``fields`` are operator fields (``INSTANCE_FIELDS``; default: all of them). The object is a
    copy read a moment ago, and a whole-row save would write back the state, health, drift and
    probe columns as they were then, undoing a quarantine or a probe verdict that landed
    meanwhile: those columns change only through their compare-and-set methods. Raises
    ``NotFoundError`` (the instance or its served model is gone), ``ConflictError`` (name taken),
    ``InvalidError`` (a field or a fleet rule).
    """
    names = INSTANCE_FIELDS if fields is None else tuple(_column(f) for f in fields)
    unknown = [f for f in names if f not in INSTANCE_FIELDS]
    if unknown:
        raise InvalidError(f"Field(s) {', '.join(map(repr, unknown))} cannot be changed here.")
    if not ServedModel.objects.filter(id=instance.served_model_id).exists():
        raise NotFoundError(f"No served model with id {instance.served_model_id}.")
    try:
        instance.full_clean(exclude=["served_model"])
    except ValidationError as exc:
        message = "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())
        # A name another instance holds is a conflict with that instance, not a malformed request.
        codes = {error.code for errors in exc.error_dict.values() for error in errors}
        raise (ConflictError if codes == {"unique"} else InvalidError)(message) from None
    validate_pd(PDDeclaration.of(instance))
    validate_ports(instance)
    before = EngineInstance.objects.filter(id=instance.id).values(*names).first() if instance.id else None
    if instance.id and before is None:
        raise NotFoundError(f"No engine instance with id {instance.id}.")  # deleted meanwhile
    try:
        with transaction.atomic():
            _save_instance(instance, before, names, actor)
    except DatabaseError:
        if instance.id and not EngineInstance.objects.filter(id=instance.id).exists():
            raise NotFoundError(f"No engine instance with id {instance.id}.") from None  # deleted meanwhile
        raise
    logger.info("instance saved id=%s name=%s actor=%s", instance.id, instance.name, actor)
    return instance


def _save_instance(instance: EngineInstance, before: dict[str, Any] | None, names: tuple[str, ...], actor: str) -> None:
    # An existing row: only ``names`` (an empty tuple saves nothing, Django's rule for update_fields).
    instance.save(update_fields=None if before is None else names)
    BreakerState.objects.get_or_create(instance=instance)
    # One history row per edit, whoever made it (admin form, API, command), so the instance's
    # history shows API edits next to the admin's. (A creation is the row itself.)
    if before is not None:
        changed = [f for f in names if before[f] != getattr(instance, f)]
        if changed:
            InstanceEvent.objects.create(
                instance=instance, kind="config", new="changed", actor=actor, reason=", ".join(changed)[:500]
            )
    bump_control_version()


def _column(field: str) -> str:
    """The ``INSTANCE_FIELDS`` name of a model or form field (the form says ``served_model``)."""
    return "served_model_id" if field == "served_model" else field


def instance_delete(*, instance_id: int, actor: str) -> None:
    instance = _get(instance_id)
    with transaction.atomic():
        instance.delete()
        bump_control_version()
    logger.info("instance deleted id=%s actor=%s", instance_id, actor)


_STATE_ACTIONS = {
    "drain": ("drain", "draining", "only an active instance can be drained"),
    "undrain": ("undrain", "active", "only a draining instance can be undrained"),
    "quarantine": ("quarantine", "quarantined", "an instance that is already quarantined or disabled cannot be quarantined"),
    "disable": ("disable", "disabled", "the instance is already disabled"),
    "activate": ("activate", "active", "the instance is already active"),
}


def instance_set_state(*, instance_id: int, action: str, actor: str, reason: str = "") -> EngineInstance:
    """Run ``drain``/``undrain``/``quarantine``/``disable``/``activate``; ``ConflictError`` if the state forbids it."""
    method, _, why = _STATE_ACTIONS[action]
    instance = _get(instance_id)
    with transaction.atomic():
        fn = getattr(instance, method)
        ok = fn(reason=reason, actor=actor) if method == "quarantine" else fn(actor=actor)
        if not ok:
            raise ConflictError(f"Cannot {action} {instance.name!r} (state {instance.state}): {why}.")
        bump_control_version()
    return instance


def instances_set_state(*, ids: Iterable[int], action: str, actor: str, reason: str = "") -> int:
    """Bulk form for admin actions: how many instances changed (the others are skipped)."""
    changed = 0
    for instance_id in ids:
        try:
            instance_set_state(instance_id=instance_id, action=action, actor=actor, reason=reason)
            changed += 1
        except (ConflictError, NotFoundError):
            pass
    return changed


def breaker_reset(*, instance_id: int, actor: str) -> BreakerState:
    _get(instance_id)
    with transaction.atomic():
        breaker = BreakerState.for_instance(instance_id)
        breaker.reset(actor=actor)
        bump_control_version()
    return breaker


def breaker_force_open(*, instance_id: int, actor: str, seconds: float = 60.0) -> BreakerState:
    _get(instance_id)
    if not 0 < seconds <= 86400:
        raise InvalidError("seconds must be in (0, 86400].")
    with transaction.atomic():
        breaker = BreakerState.for_instance(instance_id)
        breaker.force_open(actor=actor, seconds=seconds)
        bump_control_version()
    return breaker


def breaker_record(
    *, instance_id: int, new_state: str, reason: str, epoch: int, consecutive_failures: int,
    open_until: Any, open_seconds: float,
) -> bool:
    """Write back a transition the request path already made under operator ``epoch`` (see
    ``fleet.writeback``); False when nothing was written (instance gone, epoch overtaken)."""
    if not EngineInstance.objects.filter(id=instance_id).exists():
        return False  # deleted meanwhile: nothing to record
    with transaction.atomic():
        breaker = BreakerState.for_instance(instance_id)
        changed = breaker.record(
            new_state, reason=reason, epoch=epoch, consecutive_failures=consecutive_failures,
            open_until=open_until, open_seconds=open_seconds,
        )
        bump_control_version()
    return changed


@dataclass(frozen=True)
class HistoryEntry:
    """One line of an instance's history: a state, health, config or breaker change."""

    created: Any
    actor: str
    what: str
    reason: str


def instance_history(*, instance_id: int, limit: int = 200) -> list[HistoryEntry]:
    """State, health, config and breaker changes of an instance, newest first, from any actor."""
    entries = [
        HistoryEntry(e.created, e.actor, f"{e.kind}: {e.old} → {e.new}" if e.old else f"{e.kind}: {e.new}", e.reason)
        for e in InstanceEvent.objects.filter(instance_id=instance_id)[:limit]
    ] + [
        HistoryEntry(f.created, f.actor, f"breaker: {f.old_state} → {f.new_state}", f.reason)
        for f in BreakerFlip.objects.filter(instance_id=instance_id)[:limit]
    ]
    entries.sort(key=lambda e: e.created, reverse=True)
    return entries[:limit]


# -- served model record from the engines -------------------------------------------------------


def served_model_adopt_reported(*, instance_id: int, actor: str) -> ServedModel:
    """Set the instance's served model's name and model_path to what its engine reports.

    The operator picks an engine rather than typing a name and a path; the version probe keeps
    ``reported_name``/``reported_root`` (from ``/v1/models``). Raises ``InvalidError`` when the
    engine has reported nothing yet, ``ConflictError`` when another engine of the same model
    reports something else or another served model already has that name.
    """
    instance = _get(instance_id)
    if not instance.reported_name:
        raise InvalidError(f"{instance.name} has not reported a model yet; probe it first")
    name, path = instance.reported_name, instance.reported_root
    with transaction.atomic():
        model = ServedModel.objects.select_for_update().get(id=instance.served_model_id)
        others = (
            EngineInstance.objects.filter(served_model=model).exclude(id=instance.id).exclude(reported_name="")
            .exclude(reported_name=name, reported_root=path).values_list("name", flat=True)
        )
        if others:
            raise ConflictError(f"engines of {model.name} report other models: {', '.join(sorted(others))}")
        if ServedModel.objects.filter(name=name).exclude(id=model.id).exists():
            raise ConflictError(f"another served model is already named {name!r}")
        old = f"name {model.name!r}, model_path {model.model_path!r}"
        model.name, model.model_path = name, path or model.model_path
        model.save(update_fields=["name", "model_path"])
        # The record now matches every engine reporting these values: clear their mismatch now
        # rather than at the next version probe, and say so in each one's history.
        for matched in EngineInstance.objects.filter(served_model=model, reported_name=name, reported_root=path):
            InstanceEvent.objects.create(
                instance=matched, kind="model", old=str(bool(matched.model_mismatch)).lower(), new="false",
                actor=actor, reason=f"served model record adopted from {instance.name}: was {old}"[:500],
            )
        EngineInstance.objects.filter(served_model=model, reported_name=name, reported_root=path).update(model_mismatch="")
        bump_control_version()  # the snapshot routes by the served model's name
    logger.info("served model %s adopted %s, %s from %s", model.id, name, path, instance.name)
    return model


# -- API keys -----------------------------------------------------------------------------------


def api_key_create(
    *, name: str, scope: str, tokens_per_minute: int | None = None, key: str | None = None, allow_priority: bool = False,
) -> tuple[ApiKey, str]:
    """Create a key record; return it and the key itself (shown once, never stored)."""
    key = key or ApiKey.generate(scope)
    obj = ApiKey(name=name, scope=scope, tokens_per_minute=tokens_per_minute, allow_priority=allow_priority)
    obj.set_key(key)
    with transaction.atomic():
        obj.save()
        bump_control_version()
    return obj, key


def api_key_ensure(*, name: str, scope: str, key: str, tokens_per_minute: int | None = None) -> ApiKey:
    """Idempotent form for ``demo_fleet``: the record for ``key`` exists and is not revoked."""
    with transaction.atomic():
        obj, _ = ApiKey.objects.update_or_create(
            key_hash=hash_key(key),
            defaults={"name": name, "scope": scope, "prefix": key[:8], "revoked": False, "tokens_per_minute": tokens_per_minute},
        )
        bump_control_version()
    return obj


def api_key_revoke(*, ids: Iterable[int]) -> int:
    with transaction.atomic():
        n = ApiKey.objects.filter(id__in=list(ids), revoked=False).update(revoked=True)
        bump_control_version()
    return n


def api_key_lookup(key: str) -> ApiKey | None:
    return ApiKey.objects.filter(key_hash=hash_key(key), revoked=False).first()


# -- probes and status --------------------------------------------------------------------------


def probes_enqueue(*, instance_ids: Iterable[int]) -> int | None:
    """Queue a health check of each instance (after commit); how many, or None when the broker refuses.

    Outside a transaction (an API call, an admin action) ``delay_on_commit`` sends at once, so a
    broker that is down shows here as kombu's ``OperationalError`` rather than as a lost probe.
    """
    # Here, not at the top: Celery costs each Django boot a second of CPU and only this send needs
    # it. ``motorsite.celery`` makes motorsite's app current: the task goes to motorsite's broker.
    from kombu.exceptions import OperationalError

    import motorsite.celery  # noqa: F401
    from fleet import tasks

    n = 0
    try:
        for instance_id in instance_ids:
            tasks.probe_instance.delay_on_commit(instance_id)
            n += 1
    except OperationalError:
        logger.warning("probes not queued: the Celery broker is unavailable", exc_info=True)
        return None
    return n


def fleet_status() -> dict[str, Any]:
    by_state = dict(EngineInstance.objects.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
    render = current_render_config()
    return {
        "control_version": read_control_version(),
        "instances": sum(by_state.values()),
        "by_state": by_state,
        "breaker_open": BreakerState.objects.exclude(state=BreakerState.State.CLOSED).count(),
        "probe_failing": EngineInstance.objects.filter(health=Health.FAILING).count(),
        "version_drift": EngineInstance.objects.filter(version_drift=True).count(),
        "render_health": render.health if render else "unknown",
        "render_restart_required": bool(render and render.restart_required),
    }
