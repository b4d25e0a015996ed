"""Django views of the serving app that are not the OpenAI API: liveness and Prometheus text.

The OpenAI API under /v1 is served by the edge (``serving/edge``), in front of Django.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from serving.snapshots import current_snapshot

logger = logging.getLogger(__name__)


@require_GET
async def healthz(request: HttpRequest) -> HttpResponse:
    """Liveness of the coordinator, plus whether the render sidecar answers.

    A process that never had a snapshot and cannot read the database is up but cannot serve:
    503 with the reason, so a load balancer or readiness probe keeps traffic away until the
    database is back (the last snapshot keeps serving otherwise: ``serving.snapshots``).
    """
    from serving.pipeline import http
    from serving.pipeline.errors import ControlDataUnavailable
    from serving.pipeline.render.pool import RenderPool

    try:
        snapshot = await current_snapshot()
    except ControlDataUnavailable as exc:
        # The exception's message names the database error: for the log, not the probe.
        logger.warning("/healthz: %s", exc.message)
        return JsonResponse({"status": "unavailable", "reason": exc.public}, status=503)
    # "up" while any member of the render pool answers (each call picks a member that does).
    view = replace(snapshot.render, timeout_s=min(snapshot.render.timeout_s, 1.0))
    render_ok = await RenderPool(http.shared_client(), view).health()
    return JsonResponse({"status": "ok", "render": "up" if render_ok else "down", "fleet_version": snapshot.version})


@require_GET
async def prometheus_metrics(request: HttpRequest) -> HttpResponse:
    """This process's per-instance request totals, in-flight tokens, router counters and phase
    histograms, as Prometheus text."""
    from serving import runtime
    from serving.pipeline import metric_names, metrics

    text = metrics.prometheus_text(metrics.snapshot(), runtime.inflight_tokens())
    router = runtime.router_metrics()
    samples = {key: float(n) for key, n in router.get("counters", {}).items()}
    samples[(metric_names.ADMISSION_WAITING.name, ())] = float(router.get("admission_waiting") or 0)
    samples.update(runtime.phase_histograms.samples())
    samples.update(await _process_samples())
    samples.update(_coordinator_samples())
    # The phase histograms are declared even before a request came (idle is not missing).
    lines = metric_names.exposition(samples, declare=metric_names.PHASES)
    return HttpResponse(text + "\n".join(lines) + "\n", content_type="text/plain; version=0.0.4; charset=utf-8")


def _coordinator_samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """This process's identity (``motor_coordinator_info``) and the Trigger callbacks it forwarded
    to the replica that owned them, every result from zero (no result is missing before its first)."""
    import os
    import socket

    from django.conf import settings

    from serving.pipeline import metric_names
    from serving.pipeline.topologies.metaserver import process_metaserver

    identity = (("host", socket.gethostname()), ("pid", str(os.getpid())), ("replica", settings.MOTOR_REPLICA))
    samples = {(metric_names.COORDINATOR_INFO.name, identity): 1.0}
    forwarded = process_metaserver().forward_results
    for result in sorted(metric_names.TRIGGER_CALLBACK_RESULTS):
        samples[(metric_names.TRIGGER_CALLBACKS.name, (("result", result),))] = float(forwarded[result])
    return samples


async def _process_samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The launcher's processes (``make run``): restarts so far and whether each is up.

    One query per scrape, not per request; the launcher writes these rows as its children exit
    and recover (``motorsite.launcher.records``).
    """
    from asgiref.sync import sync_to_async
    from django.db import DatabaseError

    from fleet.models import ManagedProcess
    from serving.pipeline import metric_names

    try:
        rows = await sync_to_async(list)(ManagedProcess.objects.values_list("name", "state", "restarts"))
    except DatabaseError:
        # The request path serves from its snapshot while the database is away; so does /metrics.
        logger.warning("/metrics: launcher processes unavailable (database error)", exc_info=True)
        return {}
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for name, state, restarts in rows:
        label = (("process", name),)
        samples[(metric_names.PROCESS_RESTARTS.name, label)] = float(restarts)
        samples[(metric_names.PROCESS_UP.name, label)] = 1.0 if state == ManagedProcess.State.RUNNING else 0.0
    return samples
