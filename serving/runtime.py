"""Process-wide data-plane objects: the shared HTTP client's settings and live load counters."""

from __future__ import annotations

from django.conf import settings

from serving.pipeline import http
from serving.pipeline.render.client import RenderClient
from serving.pipeline.router.engine_client import EngineClient
from serving.pipeline.router.scheduler import LoadTracker, Scheduler
from serving.pipeline.service import ServingPipeline
from serving.pipeline.snapshot import FleetSnapshot

http.configure(
    http.HttpSettings(
        connect_timeout_s=settings.MOTOR_CONNECT_TIMEOUT_S,
        read_timeout_s=settings.MOTOR_ENGINE_READ_TIMEOUT_S,
        max_connections=settings.MOTOR_MAX_CONNECTIONS,
    )
)

load = LoadTracker()
scheduler = Scheduler(load)


def pipeline_for(snapshot: FleetSnapshot) -> ServingPipeline:
    client = http.shared_client()
    render = RenderClient(client, snapshot.render.base_url, snapshot.render.timeout_s)
    return ServingPipeline(snapshot, render, EngineClient(client), scheduler)
