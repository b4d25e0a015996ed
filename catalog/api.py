"""REST endpoints for render configs (mounted by ``motorsite.api``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from ninja import Body, Field, Router, Schema

from catalog import services
from catalog.models import RenderConfig
from motorsite.core import MAX_ID, Detail, NotFoundError, request_actor

router = Router(tags=["render"])


class RenderConfigOut(Schema):
    id: int
    name: str
    enable: bool
    image_name: str
    host: str
    port: int
    timeout_ms: int
    renderer_num_workers: int
    context_budget: bool
    obfuscation: bool
    obfuscation_key_ref: str
    obfuscation_key_id: str
    sidecar_version: str
    streaming_derender: bool
    health: str
    last_probe_at: datetime | None
    last_probe_error: str
    restart_required: bool


class RenderConfigPatch(Schema):
    """The fields to change; unknown fields are a 422, never ignored."""

    enable: bool | None = None
    image_name: str | None = Field(None, max_length=200)
    host: str | None = Field(None, min_length=1, max_length=200)
    port: int | None = Field(None, ge=1, le=65535)
    timeout_ms: int | None = Field(None, ge=1, le=2**31 - 1)
    renderer_num_workers: int | None = Field(None, ge=1, le=1024)
    context_budget: bool | None = None
    obfuscation: bool | None = None
    obfuscation_key_ref: str | None = Field(None, max_length=300)
    obfuscation_key_id: str | None = Field(None, max_length=100)

    model_config = {"extra": "forbid"}


class PublishOut(Schema):
    config: RenderConfigOut
    changed: list[str]
    restart_required: bool = Field(description="The managed render sidecar must restart for the change to apply.")


def _publish_out(result: services.PublishResult) -> dict[str, Any]:
    return {"config": result.config, "changed": list(result.changed), "restart_required": result.restart_required}


def _get(config_id: int) -> RenderConfig:
    if not 0 < config_id < MAX_ID:
        raise NotFoundError(f"No render config with id {config_id}.")
    return services.render_config_get(config_id=config_id)


@router.get("/render-configs", response=list[RenderConfigOut])
def list_render_configs(request: HttpRequest) -> Any:
    return list(RenderConfig.objects.order_by("id"))


# Registered before /render-configs/{config_id}: the path converter would take "import" as an id.
@router.post("/render-configs/import", response={200: PublishOut, 422: Detail}, summary="Import the RFC's render_config")
def import_render_config(request: HttpRequest, body: Body[dict[str, Any]]) -> dict[str, Any]:
    return _publish_out(services.render_config_import(data=body, actor=request_actor(request)))


@router.get("/render-configs/{config_id}", response={200: RenderConfigOut, 404: Detail})
def get_render_config(request: HttpRequest, config_id: int) -> Any:
    return _get(config_id)


@router.post("/render-configs/{config_id}/publish", response={200: PublishOut, 404: Detail, 422: Detail})
def publish_render_config(request: HttpRequest, config_id: int, body: RenderConfigPatch) -> dict[str, Any]:
    config = _get(config_id)
    changes = {k: v for k, v in body.model_dump(exclude_unset=True).items() if v is not None}
    return _publish_out(services.render_config_publish(changes=changes, actor=request_actor(request), name=config.name))
