"""What the launcher tells the control plane about the processes it supervises.

``manage.py runstack`` calls these from its supervisor's event hook (``motorsite.supervisor``
stays Django-free): one ``ManagedProcess`` row per child, and, for an engine, an
``InstanceEvent`` in the instance's history on each exit and recovery, so an operator reading
the admin sees "engine-1 killed by SIGKILL, restarted" next to the probe and breaker history.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from django.db import transaction
from django.utils import timezone

from catalog.models import Health
from fleet.models import EngineInstance, InstanceEvent, ManagedProcess
from motorsite.core import bump_control_version

ACTOR = "launcher"


def _port(url: str) -> int | None:
    try:
        return urlsplit(url).port
    except ValueError:
        return None


def processes_started(*, children: Iterable[tuple[str, int, str]]) -> None:
    """Record a fresh start of the stack: ``(name, pid, engine base URL or "")`` per child.

    Restart counts begin again (they describe this run); each engine is linked to the instance
    whose URL has its port on this host.
    """
    instances = {
        _port(i.url): i for i in EngineInstance.objects.all() if urlsplit(i.url).hostname in ("127.0.0.1", "localhost")
    }
    with transaction.atomic():
        for name, pid, url in children:
            instance = instances.get(_port(url)) if url else None
            if instance is not None:
                # One process per instance: a stale row of another name must let go first.
                ManagedProcess.objects.filter(instance=instance).exclude(name=name).update(instance=None)
            ManagedProcess.objects.update_or_create(
                name=name,
                defaults={
                    "instance": instance, "state": ManagedProcess.State.RUNNING, "pid": pid,
                    "restarts": 0, "last_exit_reason": "", "last_exit_at": None,
                },
            )


def process_changed(*, name: str, state: str, pid: int, restarts: int, reason: str = "") -> ManagedProcess | None:
    """Record one supervisor event for child ``name``; None when the launcher never registered it."""
    process = ManagedProcess.objects.select_related("instance").filter(name=name).first()
    if process is None:
        return None
    old = process.state
    process.state, process.pid, process.restarts = state, pid, restarts
    fields = ["state", "pid", "restarts", "updated"]
    if reason:
        process.last_exit_reason, process.last_exit_at = reason[:500], timezone.now()
        fields += ["last_exit_reason", "last_exit_at"]
    with transaction.atomic():
        process.save(update_fields=fields)
        if process.instance is not None and old != state:
            InstanceEvent.objects.create(
                instance=process.instance, kind="process", old=old, new=state, actor=ACTOR,
                reason=(f"{name} {reason}" if reason else f"{name} pid {pid}")[:500],
            )
            if state in (ManagedProcess.State.BACKOFF, ManagedProcess.State.FAILED):
                _mark_failing(process.instance, f"process {name} {reason}")
    return process


def _mark_failing(instance: EngineInstance, reason: str) -> None:
    """Take a dead engine out of traffic now instead of after MOTOR_PROBE_FALL failed probes.

    The launcher saw the process exit, which is a stronger signal than a probe timing out; the
    probes then take it back after MOTOR_PROBE_RISE successes in a row, as any failing instance.
    """
    written = EngineInstance.objects.filter(id=instance.id).exclude(health=Health.FAILING).update(
        health=Health.FAILING, consecutive_successes=0
    )
    if written:
        InstanceEvent.objects.create(
            instance=instance, kind="health", old=instance.health, new=Health.FAILING, actor=ACTOR, reason=reason[:500]
        )
        bump_control_version()


def processes_stopped() -> int:
    """Mark every registered process stopped (the launcher is going away); return how many."""
    return ManagedProcess.objects.exclude(state=ManagedProcess.State.STOPPED).update(
        state=ManagedProcess.State.STOPPED, pid=None
    )
