"""Render config and model revision operations shared by the admin, the REST API and management commands.

An imported config is the RFC's ``render_config`` object (optionally wrapped as
``{"render_config": {...}}``) plus this project's keys. Unknown or misspelled keys are an error
naming the key, never dropped: a renamed key must not silently turn render off.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from catalog import sidecar_addresses
from catalog.fingerprints import fingerprint_model_dir
from catalog.key_refs import InvalidKeyRef, check_key_ref
from catalog.models import (
    STREAM_INTERVAL_MAX,
    STREAM_INTERVAL_MS_MAX,
    ModelRevision,
    RenderConfig,
    RenderSidecar,
    RenderStreamReport,
    ServedModel,
)
from motorsite.core import ConflictError, InvalidError, NotFoundError, bump_control_version

logger = logging.getLogger(__name__)

# key -> expected type; "endpoint" is the RFC's nested {"host", "port"}.
_TYPES: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "enable": bool,
    "image_name": str,
    "timeout_ms": int,
    "renderer_num_workers": int,
    "context_budget": bool,
    "derender_coalesce": bool,
    "stream_interval": int,
    "stream_interval_ms": int,
    "local_stream_detokenize": bool,
    "obfuscation": bool,
    "obfuscation_key_ref": str,
    "obfuscation_key_id": str,
    "host": str,
    "port": int,
}
_ENDPOINT_KEYS = {"host", "port"}
_POSITIVE = {"timeout_ms", "renderer_num_workers", "port", "stream_interval"}
_NON_NEGATIVE = {"stream_interval_ms"}  # 0: off
_MAXIMUM = {"stream_interval": STREAM_INTERVAL_MAX, "stream_interval_ms": STREAM_INTERVAL_MS_MAX}


def parse_render_config(data: Any) -> dict[str, Any]:
    """Flatten and type-check an imported render config; ``InvalidError`` names the offending key."""
    if isinstance(data, dict) and set(data) == {"render_config"}:
        data = data["render_config"]
    if not isinstance(data, dict):
        raise InvalidError("A render config must be a JSON object.")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key == "endpoint":
            if not isinstance(value, dict):
                raise InvalidError("render_config.endpoint must be an object with host and port.")
            for sub, subvalue in value.items():
                if sub not in _ENDPOINT_KEYS:
                    raise InvalidError(f"Unknown key render_config.endpoint.{sub} (expected host, port).")
                flat[sub] = subvalue
        elif key in _TYPES and key not in _ENDPOINT_KEYS:
            flat[key] = value
        else:
            raise InvalidError(f"Unknown key render_config.{key} (expected one of: endpoint, {', '.join(k for k in _TYPES if k not in _ENDPOINT_KEYS)}).")
    for key, value in flat.items():
        expected = _TYPES[key]
        # bool is an int in Python; a port of `true` is still a mistake.
        if (expected is int and isinstance(value, bool)) or not isinstance(value, expected):
            name = "endpoint." + key if key in _ENDPOINT_KEYS else key
            raise InvalidError(f"render_config.{name} must be {getattr(expected, '__name__', expected)}, got {value!r}.")
        if key in _POSITIVE and value <= 0:
            raise InvalidError(f"render_config.{key} must be positive, got {value}.")
        if key in _NON_NEGATIVE and value < 0:
            raise InvalidError(f"render_config.{key} must be 0 or more, got {value}.")
        if key in _MAXIMUM and value > _MAXIMUM[key]:
            raise InvalidError(f"render_config.{key} must be at most {_MAXIMUM[key]}, got {value}.")
    if flat.get("obfuscation") and not (flat.get("obfuscation_key_ref") and flat.get("obfuscation_key_id")):
        raise InvalidError("render_config.obfuscation needs obfuscation_key_ref and obfuscation_key_id.")
    if flat.get("obfuscation_key_ref"):
        key_ref_check(flat["obfuscation_key_ref"])
    return flat


def key_ref_check(ref: str) -> None:
    """Raise ``InvalidError`` unless ``ref`` names an obfuscation key (``catalog.key_refs``)."""
    try:
        check_key_ref(ref)
    except InvalidKeyRef as exc:
        raise InvalidError(f"{exc}.") from None


@dataclass(frozen=True)
class PublishResult:
    config: RenderConfig
    changed: tuple[str, ...]  # field names whose value changed
    restart_required: bool  # the managed sidecar must restart for this to take effect


def render_config_publish(*, changes: dict[str, Any], actor: str, name: str | None = None) -> PublishResult:
    """Apply ``changes`` (already parsed) to the render config ``name`` (created if missing) and publish it.

    Publishing bumps the control version, so every coordinator process adopts the config within a
    poll interval. A change to the endpoint, worker count, image or obfuscation key cannot take
    effect in a running sidecar: the result and the row's ``restart_required`` say so. Restarting
    the managed sidecar is the launcher's job, not this function's.
    """
    name = changes.pop("name", None) or name or "default"
    unknown = set(changes) - set(RenderConfig.IMPORT_KEYS)
    if unknown:
        raise InvalidError(f"Unknown render config field(s): {', '.join(sorted(unknown))}.")
    with transaction.atomic():
        config = RenderConfig.objects.select_for_update().filter(name=name).first() or RenderConfig(name=name)
        changed = tuple(k for k, v in changes.items() if getattr(config, k) != v)
        for k, v in changes.items():
            setattr(config, k, v)
        return _publish(config, changed, actor)


# What an operator sets on a render config; every other column is the probes' or the launcher's.
RENDER_CONFIG_FIELDS = ("name", "served_model", *RenderConfig.IMPORT_KEYS)
# The columns only the probes and the launcher write (compare-and-set updates, never a save).
_MACHINE_FIELDS = (
    "sidecar_version", "streaming_derender", "model_mismatch", "health", "last_probe_at", "last_probe_error",
    "restart_required", "pool_size",
)


def render_config_save(*, config: RenderConfig, changed: tuple[str, ...], actor: str) -> PublishResult:
    """Save the fields ``changed`` of ``config`` (the admin form's copy) and publish the result.

    ``config`` was read when the form was posted: saved whole, it would write back the probes'
    verdict (health, versions), the launcher's port and ``restart_required`` as they were then,
    undoing whatever landed meanwhile. So only ``changed`` (operator fields) is copied onto the row
    as it is now, read under a row lock so the obfuscation rule is checked against what the
    database holds. Raises ``InvalidError`` (a field or that rule), ``NotFoundError`` (deleted).
    """
    unknown = [f for f in changed if f not in RENDER_CONFIG_FIELDS]
    if unknown:
        raise InvalidError(f"Render config field(s) {', '.join(map(repr, unknown))} cannot be changed here.")
    if config.pk is None:
        return _publish(config, changed, actor)
    with transaction.atomic():
        current = RenderConfig.objects.select_for_update().filter(pk=config.pk).first()
        if current is None:
            raise NotFoundError(f"No render config with id {config.pk}.")
        # (A form posted without the values it was opened with names every field: keep the real
        # changes, so an unchanged port does not flag a restart.)
        changed = tuple(f for f in changed if getattr(current, f) != getattr(config, f))
        for field in changed:
            setattr(current, field, getattr(config, field))
        result = _publish(current, changed, actor)
    # The caller's copy shows what was saved (the admin's messages and redirect read it).
    for field in (*RENDER_CONFIG_FIELDS, *_MACHINE_FIELDS):
        setattr(config, field, getattr(current, field))
    return result


def _publish(config: RenderConfig, changed: tuple[str, ...], actor: str) -> PublishResult:
    """Save ``config`` (a new one whole; an existing one, read fresh under a lock, only ``changed``)."""
    if config.obfuscation and not (config.obfuscation_key_ref and config.obfuscation_key_id):
        raise InvalidError("Obfuscation needs obfuscation_key_ref and obfuscation_key_id.")
    if config.obfuscation_key_ref:
        key_ref_check(config.obfuscation_key_ref)
    # A config's own address may be a unix socket too; its port is then not used.
    unix = sidecar_addresses.is_unix(config.host)
    if (error := sidecar_addresses.address_error(config.host, 0 if unix else config.port)) is not None:
        raise InvalidError(error[1][:1].upper() + error[1][1:] + ".")
    restart = config.pk is not None and any(k in RenderConfig.RESTART_KEYS for k in changed)
    with transaction.atomic():
        if config.pk is None:
            config.save()
        else:
            # Set, never cleared here: only the launcher clears it, once a sidecar serves the change.
            if restart:
                config.restart_required = True
            config.save(update_fields=[*changed, "restart_required"] if restart else changed)
        bump_control_version()
    logger.info(
        "render config published name=%s changed=%s restart_required=%s actor=%s",
        config.name, changed, restart, actor,
    )
    return PublishResult(config, changed, restart)


def render_config_import(*, data: Any, actor: str) -> PublishResult:
    return render_config_publish(changes=parse_render_config(data), actor=actor)


def render_config_get(*, config_id: int) -> RenderConfig:
    try:
        return RenderConfig.objects.get(id=config_id)
    except RenderConfig.DoesNotExist:
        raise NotFoundError(f"No render config with id {config_id}.") from None


def render_sidecar_moved(
    *, config_id: int, expected: dict[str, Any], port: int, actor: str, host: str | None = None
) -> bool:
    """Point the config at a replacement sidecar on ``port`` (and ``host``: a replacement on a unix
    socket has a socket of its own), if it is still as ``expected``.

    The launcher's side of a graceful restart: the new sidecar is ready before this runs, so
    coordinators switch to it within a poll interval. No restart is owed for this change (the
    sidecar there was started for it). False, changing nothing, when the config changed
    meanwhile: the launcher then starts over from the newer config.
    """
    with transaction.atomic():
        before = RenderConfig.objects.filter(id=config_id, **expected).values("host", "port").first()
        moved = RenderConfig.objects.filter(id=config_id, **expected).update(port=port, host=host or F("host"))
        if moved and before is not None:
            # The pool member the launcher manages moves with it (the others are not restarted here);
            # a member on a unix socket has port 0.
            unix = sidecar_addresses.is_unix(before["host"])
            RenderSidecar.objects.filter(render_config_id=config_id, host=before["host"],
                                         port=0 if unix else before["port"]).update(
                port=0 if host and sidecar_addresses.is_unix(host) else port, host=host or before["host"])
        if moved:
            bump_control_version()
    logger.info("render sidecar moved config_id=%s port=%s moved=%s actor=%s", config_id, port, bool(moved), actor)
    return bool(moved)


def render_member_add(*, config_id: int, host: str, port: int | None, actor: str) -> RenderSidecar:
    """Add the sidecar at ``host``:``port`` (or the unix socket ``host`` = ``unix:/path``, no port)
    to the config's pool; coordinators use it within a poll interval (its version floors apply once
    a probe records its version). ``InvalidError`` for an address that is none
    (``sidecar_addresses.address_error``), ``ConflictError`` when the pool has it already."""
    if (error := sidecar_addresses.address_error(host, port)) is not None:
        raise InvalidError(error[1][:1].upper() + error[1][1:] + ".")
    port = port or 0
    config = render_config_get(config_id=config_id)
    with transaction.atomic():
        member, created = RenderSidecar.objects.get_or_create(render_config=config, host=host, port=port)
        if not created:
            raise ConflictError(f"The pool of render config {config.name!r} has {member.address} already.")
        bump_control_version()
    logger.info("render sidecar added config=%s address=%s actor=%s", config.name, member.address, actor)
    return member


def render_member_remove(*, config_id: int, member_id: int, actor: str) -> None:
    """Take a sidecar out of the config's pool. Requests already running keep the pool they began
    with; new ones stop using it within a poll interval. The last member cannot go (``ConflictError``):
    a pool of none would silently fall back to the config's own address."""
    with transaction.atomic():
        member = RenderSidecar.objects.select_for_update().filter(id=member_id, render_config_id=config_id).first()
        if member is None:
            raise NotFoundError(f"No sidecar {member_id} in render config {config_id}.")
        if RenderSidecar.objects.filter(render_config_id=config_id).count() <= 1:
            raise ConflictError("A render pool keeps at least one sidecar; add another before removing this one.")
        member.delete()
        bump_control_version()
    logger.info("render sidecar removed config_id=%s url=%s actor=%s", config_id, member.base_url, actor)


def render_member_moved(
    *, config_id: int, expected: dict[str, Any], host: str, old_port: int, port: int, actor: str,
    new_host: str | None = None,
) -> bool:
    """Point the pool member at ``host``:``old_port`` at its replacement on ``port`` (at ``new_host``
    when it has an address of its own: a unix socket), if the config is still as ``expected`` (the
    launcher's rolling restart of a pool, one member at a time)."""
    new_host = new_host or host
    with transaction.atomic():
        if not RenderConfig.objects.filter(id=config_id, **expected).exists():
            return False
        moved = RenderSidecar.objects.filter(
            render_config_id=config_id, host=host, port=0 if sidecar_addresses.is_unix(host) else old_port,
        ).update(host=new_host, port=0 if sidecar_addresses.is_unix(new_host) else port)
        if moved:
            bump_control_version()
    logger.info("render pool member moved config_id=%s %s:%s -> %s:%s actor=%s", config_id, host, old_port, new_host,
                port, actor)
    return True


def render_sidecar_restarted(*, config_id: int, expected: dict[str, Any], actor: str) -> bool:
    """Clear ``restart_required`` once a sidecar started for ``expected`` serves (compare-and-set).

    A change published while the restart ran leaves the flag set, so it gets its own restart.
    """
    cleared = RenderConfig.objects.filter(id=config_id, restart_required=True, **expected).update(
        restart_required=False
    )
    logger.info("render sidecar restarted config_id=%s cleared=%s actor=%s", config_id, bool(cleared), actor)
    return bool(cleared)


def render_streams_report(*, host: str, pid: int, counts: dict[str, int]) -> None:
    """Record what the coordinator process ``host``/``pid`` holds on each sidecar (one row per process)."""
    RenderStreamReport.objects.update_or_create(
        host=host, pid=pid, defaults={"counts": counts, "updated": timezone.now()}
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def render_live_streams(
    *, base_urls: Collection[str], host: str, alive: Callable[[int], bool] = _pid_alive
) -> int:
    """How many requests live processes on ``host`` report on any of ``base_urls``.

    Only processes on this machine can reach a sidecar the launcher manages (it listens on
    127.0.0.1), so only their rows count, and whether each is alive is asked of the kernel: a
    process writes only when its counts change, so a timestamp could not tell an idle live
    process from a dead one without a heartbeat of writes. Rows of dead processes are deleted.
    """
    total = 0
    dead: list[int] = []
    for row in RenderStreamReport.objects.filter(host=host):
        if not alive(row.pid):
            dead.append(row.pk)
            continue
        counts = row.counts if isinstance(row.counts, dict) else {}
        total += sum(int(counts.get(url) or 0) for url in base_urls)
    if dead:
        RenderStreamReport.objects.filter(pk__in=dead).delete()
    return total


# -- model revisions ----------------------------------------------------------------------------

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _special_tokens(model_dir: Path) -> dict[str, Any]:
    """The named special tokens from ``tokenizer_config.json`` ({} when absent or unreadable)."""
    try:
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    # A token may be a string or an AddedToken dict; keep only its text so both spell the same.
    out: dict[str, Any] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _revision_key(rev: ModelRevision) -> tuple[Any, ...]:
    return (*sorted(rev.fingerprint().items()), rev.reasoning_parser, rev.tool_parser, sorted(rev.special_tokens.items()))


@dataclass(frozen=True)
class RevisionResult:
    revision: ModelRevision  # the served model's active revision after the call
    created: bool  # False: the directory matched the active revision, nothing changed


def revision_record(
    *, served_model: ServedModel, model_dir: str | Path, actor: str, reasoning_parser: str = "", tool_parser: str = ""
) -> RevisionResult:
    """Fingerprint ``model_dir`` and make it ``served_model``'s active revision if it differs.

    Idempotent: recording an unchanged directory (every ``make run``) creates no row, so the
    version probe keeps comparing the engines against the same record. A new revision is set
    active by compare-and-set on the revision read first; ``ConflictError`` when another
    writer switched it meanwhile (the caller re-reads and decides again).
    """
    model_dir = Path(model_dir)
    hashes = fingerprint_model_dir(model_dir)
    candidate = ModelRevision(
        served_model=served_model,
        config_hash=hashes["config"],
        tokenizer_hash=hashes["tokenizer"],
        chat_template_hash=hashes["chat_template"],
        generation_config_hash=hashes["generation_config"],
        special_tokens=_special_tokens(model_dir),
        reasoning_parser=reasoning_parser,
        tool_parser=tool_parser,
        label=hashes["tokenizer"][:8] + "/" + hashes["chat_template"][:8],
    )
    with transaction.atomic():
        active_id = ServedModel.objects.filter(id=served_model.pk).values_list("active_revision_id", flat=True).get()
        active = ModelRevision.objects.filter(id=active_id).first() if active_id else None
        if active is not None and _revision_key(active) == _revision_key(candidate):
            return RevisionResult(active, False)
        candidate.save()
        if not ServedModel.objects.filter(id=served_model.pk, active_revision_id=active_id).update(
            active_revision=candidate
        ):
            raise ConflictError(f"The active revision of {served_model.name} changed meanwhile; try again.")
        bump_control_version()
    served_model.active_revision = candidate
    logger.info(
        "model revision recorded model=%s revision=%s previous=%s actor=%s",
        served_model.name, candidate.pk, active_id, actor,
    )
    return RevisionResult(candidate, True)
