"""Coordinator processes' reports for the fleet dashboard: in the database, or in Redis with ``REDIS_URL``.

Each coordinator process keeps its engine-request buckets in memory (``serving.pipeline.metrics``);
to draw the whole fleet, every process writes its buckets and tokens in flight here a few seconds
after they change (``serving.stream_reports.ReportWriter``), and the dashboard of any process
reads every report and adds them up, so two replicas show the same plots.

Why both stores: Redis, when a deployment has it, is where the live shared state already is
(admission leases, breakers) and expires a dead process's report by itself; the database is
there in every deployment (``make run`` has no Redis by default), and stale rows are deleted by
the next write. A report older than ``STALE_S`` is ignored either way: its buckets would have
left the dashboard's window, and its tokens in flight are no longer true.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from fleet.models import CoordinatorReport

# The dashboard's window (60 buckets of 10 s) plus a minute: a process silent for longer has
# nothing left in the window, so its report is dropped (expired in Redis, deleted in the database).
STALE_S = 11 * 60
REDIS_PREFIX = "motorsite:coordinator-report:"


def this_process() -> tuple[str, int]:
    """The (host, pid) this process reports under (``serving.stream_reports`` uses the same)."""
    return socket.gethostname(), os.getpid()


@dataclass(frozen=True, slots=True)
class Report:
    host: str
    pid: int
    payload: dict[str, Any]


_redis_client: Any = None


def _redis() -> Any:
    global _redis_client
    if _redis_client is None:
        import redis

        # Short timeouts: a dashboard page or a reporter thread waits at most this for Redis.
        _redis_client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    return _redis_client


def report_write(*, host: str, pid: int, payload: dict[str, Any]) -> None:
    """Record what the coordinator process ``host``/``pid`` reports (one report per process)."""
    if settings.REDIS_URL:
        _redis().set(f"{REDIS_PREFIX}{host}:{pid}", json.dumps(payload), ex=STALE_S)
        return
    now = timezone.now()
    CoordinatorReport.objects.update_or_create(host=host, pid=pid, defaults={"payload": payload, "updated": now})
    CoordinatorReport.objects.filter(updated__lt=now - timedelta(seconds=STALE_S)).delete()


def reports_read() -> list[Report]:
    """Every coordinator process's report that is not stale, in no particular order."""
    if settings.REDIS_URL:
        client = _redis()
        keys = sorted(client.scan_iter(match=REDIS_PREFIX + "*", count=100))
        found = []
        for key, raw in zip(keys, client.mget(keys) if keys else [], strict=True):
            if raw is None:  # expired between the scan and the read
                continue
            host, _, pid = key.decode()[len(REDIS_PREFIX):].rpartition(":")
            found.append(Report(host, int(pid), json.loads(raw)))
        return found
    cutoff = timezone.now() - timedelta(seconds=STALE_S)
    return [
        Report(r.host, r.pid, r.payload)
        for r in CoordinatorReport.objects.filter(updated__gte=cutoff).order_by("host", "pid")
    ]
