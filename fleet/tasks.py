"""Celery tasks of the fleet: health checks, version probes, retention and the audit.

Tasks take ids, re-fetch what they act on, are idempotent (running one twice records two probes
and changes a verdict at most once), and call one function of ``fleet.probes``. The fan-out task
enqueues one health check per instance so a slow engine delays only its own probe.

Django models are imported inside the task bodies: ``motorsite.celery`` reads ``BEAT_SCHEDULE``
from here before Django is set up.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from celery import shared_task

# MOTOR_PROBE_INTERVAL_MS, as settings.MOTOR_PROBE_INTERVAL_S reads it: beat builds its schedule
# from this module before Django is set up, so it reads the environment itself.
PROBE_INTERVAL_S = int(os.environ.get("MOTOR_PROBE_INTERVAL_MS", "15000")) / 1000

BEAT_SCHEDULE: dict[str, dict[str, Any]] = {
    # Health: with FALL=3 a dead engine is out of the snapshot within about 45 s (at once when the
    # launcher saw it exit), while a probe (one 1-token request) every 15 s costs a CPU engine well
    # under 1% of its time.
    "probe-health": {"task": "fleet.tasks.probe_health", "schedule": timedelta(seconds=PROBE_INTERVAL_S)},
    # LoRA adapters can be loaded and unloaded at runtime: which engine holds which is read as
    # often as health (one small GET per engine), so placement follows within a probe interval.
    "probe-lora": {"task": "fleet.tasks.probe_lora", "schedule": timedelta(seconds=PROBE_INTERVAL_S)},
    # Versions change only when someone redeploys a tier: once a minute catches a mismatched
    # rollout quickly, and reading four model files and a few small endpoints per engine
    # (version, models, OpenAPI document, one /tokenize) is cheap.
    "probe-versions": {"task": "fleet.tasks.probe_versions", "schedule": timedelta(minutes=1)},
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
def probe_versions() -> dict[str, Any]:
    """Version probe of the sidecar and every engine (drift, quarantine policy, render capabilities),
    then what each engine serves (``fleet.engine_probes``: routes, tokenizer, LoRA enabled; the
    adapters it holds are ``probe_lora``'s, read more often)."""
    from fleet import engine_probes, probes

    summary = probes.probe_versions()
    capabilities = engine_probes.probe_engine_capabilities()
    return {
        "capabilities": capabilities,
        "render_version": summary.render_version,
        "streaming_derender": summary.streaming_derender,
        "drifted": summary.drifted,
        "quarantined": summary.quarantined,
        "errors": summary.errors,
    }


@shared_task(ignore_result=True)
def probe_lora() -> dict[str, Any]:
    """Which LoRA adapters each engine has loaded (``fleet.lora_probes``)."""
    from fleet import lora_probes

    summary = lora_probes.probe_lora_adapters()
    return {"probed": summary.probed, "changed": summary.changed, "errors": summary.errors}


@shared_task(ignore_result=True)
def prune_probe_results() -> int:
    from fleet import probes

    return probes.prune_probe_results()


@shared_task(ignore_result=True)
def audit_fleet() -> int:
    """Record an ``AuditReport``; return its id."""
    from fleet import probes

    return probes.audit_fleet().id
