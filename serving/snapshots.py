"""Builds the data plane's ``FleetSnapshot`` from the database and keeps it fresh.

Requests never query the database: they read the current snapshot, which is rebuilt in a
worker thread at most once per ``MOTOR_SNAPSHOT_TTL_S`` (so an admin edit reaches every
process within about that long).
"""

from __future__ import annotations

import time

from asgiref.sync import sync_to_async
from django.conf import settings

from fleet.models import EngineInstance
from serving.models import RenderConfig, ServedModel
from serving.pipeline.snapshot import FleetSnapshot, InstanceView, ModelView, RenderView

_current: FleetSnapshot | None = None
_built_at = 0.0
_version = 0


def build_snapshot(version: int = 0) -> FleetSnapshot:
    models = {m.name: ModelView(m.name, m.model_path, m.max_model_len) for m in ServedModel.objects.all()}
    cfg = RenderConfig.objects.order_by("id").first() or RenderConfig()
    render = RenderView(enable=cfg.enable, base_url=cfg.base_url, timeout_s=cfg.timeout_ms / 1000)
    instances = tuple(
        InstanceView(
            id=i.id,
            name=i.name,
            url=i.url.rstrip("/"),
            role=i.role,
            model=i.served_model.name,
            weight=i.weight,
            token_capacity=i.token_capacity,
            max_model_len=i.max_model_len or i.served_model.max_model_len,
            token_generate=i.cap_token_generate,
            native_openai=i.cap_native_openai,
            tokenizer=i.cap_tokenizer,
            state=i.state,
        )
        for i in EngineInstance.objects.select_related("served_model")
    )
    return FleetSnapshot(version=version, models=models, render=render, instances=instances)


async def current_snapshot() -> FleetSnapshot:
    global _current, _built_at, _version
    if _current is not None and time.monotonic() - _built_at < settings.MOTOR_SNAPSHOT_TTL_S:
        return _current
    # Two requests may rebuild at once after expiry; both get a correct snapshot, so no lock
    # (an asyncio.Lock would also tie this module to one event loop).
    _version += 1
    _current = await sync_to_async(build_snapshot, thread_sensitive=False)(_version)
    _built_at = time.monotonic()
    return _current


def invalidate() -> None:
    """Forget the cached snapshot (tests, and commands that just changed the fleet)."""
    global _current
    _current = None
