"""Celery tasks of the fleet: health checks, probe rounds (LoRA adapters, versions), retention and the audit.

Tasks take ids, re-fetch what they act on, are idempotent (running one twice records two probes
and changes a verdict at most once), and call one function of ``fleet.probes`` or ``fleet.rounds``
(a probe round of the engines). The fan-out task enqueues one health check per instance so a slow
engine delays only its own probe.

Django models are imported inside the task bodies: ``motorsite.celery`` reads ``BEAT_SCHEDULE``
from here before Django is set up.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from celery import shared_task

if TYPE_CHECKING:
    from fleet.rounds import RoundSummary

# MOTOR_PROBE_INTERVAL_MS, as settings.MOTOR_PROBE_INTERVAL_S reads it: beat builds its schedule
# from this module before Django is set up, so it reads the environment itself.
PROBE_INTERVAL_S = int(os.environ.get("MOTOR_PROBE_INTERVAL_MS", "15000")) / 1000

BEAT_SCHEDULE: dict[str, dict[str, Any]] = {
    # Health: with FALL=3 a dead engine is out of the snapshot within about 45 s (at once when the
    # launcher saw it exit), while a probe (one 1-token request) every 15 s costs a CPU engine well
    # under 1% of its time.
    "probe-health": {"task": "fleet.tasks.probe_health", "schedule": timedelta(seconds=PROBE_INTERVAL_S)},
    # A probe round of the engines (fleet.rounds): each engine's /v1/models read once serves the
    # LoRA adapters every round (loaded and unloaded at runtime: placement follows within a probe
    # interval) and, once a minute, the version probe (versions change only when someone
    # redeploys a tier; four model files and a few small endpoints per engine are cheap).
    "probe-engines": {"task": "fleet.tasks.probe_engines", "schedule": timedelta(seconds=PROBE_INTERVAL_S)},
    # Retention is measured in days; hourly keeps the table within an hour of the limit.
    "prune-probe-results": {"task": "fleet.tasks.prune_probe_results", "schedule": timedelta(hours=1)},
    # The audit is a record for people reading history later; every 15 minutes is enough detail.
    "audit-fleet": {"task": "fleet.tasks.audit_fleet", "schedule": timedelta(minutes=15)},
}


@shared_task(ignore_result=True)
def probe_health() -> int:
    """Enqueue a health check of the render sidecar and of every instance not disabled; return how many."""
    from fleet.models import EngineInstance

    ids = list(EngineInstance.objects.exclude(state=EngineInstance.State.DISABLED).values_list("id", flat=True))
    probe_render.delay()
    for instance_id in ids:
        probe_instance.delay(instance_id)
    return len(ids) + 1


@shared_task(ignore_result=True)
def probe_instance(instance_id: int) -> bool | None:
    """One health check of one engine; its outcome, or None when the instance no longer exists."""
    from fleet import probes

    result = probes.probe_engine_health(instance_id)
    return None if result is None else result.ok


@shared_task(ignore_result=True)
def probe_render() -> bool | None:
    """One health check of the render sidecar; its outcome, or None when render is off or unconfigured."""
    from fleet import probes, render_pool_probes

    result = probes.probe_render_health()
    render_pool_probes.probe_render_pool()  # each member's version, routes and health
    return None if result is None else result.ok


@shared_task(ignore_result=True)
def probe_engines() -> dict[str, Any]:
    """A probe round of the engines (``fleet.rounds``): the LoRA adapters, and the version and
    capability probes when a minute has passed since the last."""
    from fleet import rounds

    return _round_result(rounds.probe_round(versions=rounds.versions_due()))


@shared_task(ignore_result=True)
def probe_versions() -> dict[str, Any]:
    """A probe round with the version probe of the sidecar and every engine (drift, quarantine
    policy, render capabilities) and what each engine serves (routes, tokenizer, LoRA enabled),
    due or not."""
    from fleet import rounds

    return _round_result(rounds.probe_round(versions=True))


def _round_result(summary: RoundSummary) -> dict[str, Any]:
    lora = summary.lora
    out: dict[str, Any] = {"lora": {"probed": lora.probed, "changed": lora.changed, "errors": lora.errors}}
    if summary.versions is not None:
        out.update(
            capabilities=summary.capabilities,
            render_version=summary.versions.render_version,
            streaming_derender=summary.versions.streaming_derender,
            drifted=summary.versions.drifted,
            quarantined=summary.versions.quarantined,
            errors=summary.versions.errors,
        )
    return out


@shared_task(ignore_result=True)
def prune_probe_results() -> int:
    from fleet import probes

    return probes.prune_probe_results()


@shared_task(ignore_result=True)
def audit_fleet() -> int:
    """Record an ``AuditReport``; return its id."""
    from fleet import probes

    return probes.audit_fleet().id
