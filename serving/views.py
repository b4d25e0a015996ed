"""Django views of the serving app that are not the OpenAI API: liveness and Prometheus text.

The OpenAI API under /v1 is served by the edge (``serving/edge``), in front of Django.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from serving.snapshots import current_snapshot

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)


@require_GET
async def healthz(request: HttpRequest) -> HttpResponse:
    """Liveness of the coordinator, plus whether each served model's render pool answers.

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
    # Every model that takes requests has a pool of its own: each is "up" while any of its members
    # answers (each call picks a member that does); "render" is "up" only when every one is.
    # Without served models yet, the one render config in force stands for them.
    serving = [name for name, m in snapshot.models.items() if m.serves_requests]
    views = {name: snapshot.render_of(name) for name in serving} or {"": snapshot.render}
    checked = {name: view for name, view in views.items() if view.enable or name == ""}
    answers = await asyncio.gather(*(
        RenderPool(http.shared_client(), replace(view, timeout_s=min(view.timeout_s, 1.0))).health()
        for view in checked.values()
    ))
    pools = {name: "up" if ok else "down" for name, ok in zip(checked, answers, strict=True)}
    body = {"status": "ok", "render": "up" if all(answers) else "down", "fleet_version": snapshot.version}
    if serving:
        body["models"] = {name: pools.get(name, "disabled") for name in serving}
    return JsonResponse(body)


@require_GET
async def prometheus_metrics(request: HttpRequest) -> HttpResponse:
    """This process's metrics as Prometheus text (docs/metrics.md): what the request path recorded
    (engine requests, router counters, phase histograms) and what is read now (in-flight tokens,
    queues, KV events, the launcher's processes, this process's identity)."""
    from serving import runtime
    from serving.pipeline import exporter, metrics

    scraped = exporter.Families([*_runtime_families(), *await _process_families(), *_coordinator_families()])
    text = exporter.exposition(
        metrics.REGISTRY.prometheus, runtime.counters.registry, runtime.phase_histograms.registry, scraped
    )
    return HttpResponse(text, content_type=exporter.CONTENT_TYPE)


def _runtime_families() -> list[Metric]:
    """The data plane's state now: tokens in flight, the admission queue, the KV affinity index
    and the KV event subscribers of the running loop."""
    from serving import runtime
    from serving.pipeline import metric_names as names
    from serving.pipeline.exporter import scraped

    hub = runtime.kv_event_hub()
    subscribers = hub.subscribers if hub is not None else {}
    return [
        scraped(names.ENGINE_IN_FLIGHT_TOKENS, (({"instance": k}, v) for k, v in runtime.inflight_tokens().items())),
        scraped(names.ADMISSION_WAITING, [({}, runtime.admission.waiting())]),
        scraped(names.AFFINITY_INDEX_BLOCKS, [({}, len(runtime.affinity))]),
        scraped(names.KV_EVENT_BATCHES, (({"instance": k}, s.batches) for k, s in subscribers.items())),
        scraped(names.KV_EVENT_ERRORS, (({"instance": k}, s.errors) for k, s in subscribers.items())),
    ]


def _coordinator_families() -> list[Metric]:
    """This process's identity (``motor_coordinator_info``) and the Trigger callbacks it forwarded
    to the replica that owned them, every result from zero (no result is missing before its first)."""
    import os
    import socket

    from django.conf import settings

    from serving.pipeline import metric_names as names
    from serving.pipeline.exporter import scraped
    from serving.pipeline.topologies.metaserver import process_metaserver

    identity = {"replica": settings.MOTOR_REPLICA, "host": socket.gethostname(), "pid": str(os.getpid())}
    forwarded = process_metaserver().forward_results
    return [
        scraped(names.COORDINATOR_INFO, [(identity, 1)]),
        scraped(names.TRIGGER_CALLBACKS,
                [({"result": result}, forwarded[result]) for result in sorted(names.TRIGGER_CALLBACK_RESULTS)]),
    ]


async def _process_families() -> list[Metric]:
    """The launcher's processes (``make run``): restarts so far and whether each is up.

    One query per scrape, not per request; the launcher writes these rows as its children exit
    and recover (``motorsite.launcher.records``).
    """
    from asgiref.sync import sync_to_async
    from django.db import DatabaseError

    from fleet.models import ManagedProcess
    from serving.pipeline import metric_names as names
    from serving.pipeline.exporter import scraped

    try:
        rows = await sync_to_async(list)(ManagedProcess.objects.values_list("name", "state", "restarts"))
    except DatabaseError:
        # The request path serves from its snapshot while the database is away; so does /metrics.
        logger.warning("/metrics: launcher processes unavailable (database error)", exc_info=True)
        return []
    return [
        scraped(names.PROCESS_RESTARTS, [({"process": name}, restarts) for name, _, restarts in rows]),
        scraped(names.PROCESS_UP,
                [({"process": name}, int(state == ManagedProcess.State.RUNNING)) for name, state, _ in rows]),
    ]
