"""REST endpoints for render configs (mounted by ``motorsite.api``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from ninja import Field, Router, Schema
from ninja.responses import Status

from catalog import services
from catalog.key_refs import key_ref_pattern
from catalog.models import STREAM_INTERVAL_MAX, STREAM_INTERVAL_MS_MAX, RenderConfig, RenderSidecar
from catalog.render_versions import member_traffic
from motorsite.core import (
    MAX_ID,
    BodySchema,
    ConflictError,
    Detail,
    InvalidError,
    NotFoundError,
    optional,
    request_actor,
)

router = Router(tags=["render"])


class RenderSidecarOut(Schema):
    id: int
    host: str = Field(description="A host name or address, or `unix:/path/to.sock` for a sidecar on a unix socket.")
    port: int = Field(description="The TCP port; 0 for a unix socket.")
    address: str = Field(description="`host:port`, or `unix:/path/to.sock`.")
    base_url: str = Field(description="What the coordinator calls: `http://host:port`, or `http+unix://` and the "
                          "socket's path percent-encoded.")
    sidecar_version: str
    capabilities: dict[str, Any] = Field(
        description="What the probe found: version, routes served, token_in, derender, streaming_derender."
    )
    traffic: str = Field(description="What the version floors and its routes leave this sidecar to serve.")
    health: str
    last_probe_at: datetime | None
    last_probe_error: str

    @staticmethod
    def resolve_traffic(obj: RenderSidecar) -> str:
        return member_traffic(obj.sidecar_version, obj.capabilities)


class RenderConfigOut(Schema):
    id: int
    name: str
    served_model_id: int | None = Field(description="The served model this sidecar renders for; null: the default config.")
    enable: bool
    image_name: str
    host: str
    port: int
    timeout_ms: int
    renderer_num_workers: int
    context_budget: bool
    derender_coalesce: bool
    stream_interval: int
    stream_interval_ms: int = Field(
        description="Milliseconds between a choice's derender calls after its first token; 0: off."
    )
    local_stream_detokenize: bool = Field(
        description="Plain streams derendered in the coordinator instead of the sidecar (docs/local-detokenize.md)."
    )
    obfuscation: bool
    obfuscation_key_ref: str
    obfuscation_key_id: str
    sidecar_version: str
    streaming_derender: bool
    model_mismatch: str = Field(
        description="How the served models' records differ from what the sidecar reports (empty: they match)."
    )
    health: str
    last_probe_at: datetime | None
    last_probe_error: str
    restart_required: bool
    pool_size: int = Field(description="Sidecars `make run` starts for this config.")
    sidecars: list[RenderSidecarOut] = Field(description="The pool: each call goes to the member with the fewest outstanding calls.")

    @staticmethod
    def resolve_sidecars(obj: RenderConfig) -> list[RenderSidecar]:
        return list(obj.sidecars.all())


class RenderSidecarIn(BodySchema):
    host: str = Field(min_length=1, max_length=200, description=(
        "A host name or address (with `port`), or a unix socket on the coordinators' own machine: "
        "`unix:` and an absolute path of at most 107 bytes (`vllm launch render --uds PATH`), without `port`."))
    port: int | None = Field(None, ge=1, le=65535, description="The TCP port; required with a host name, absent "
                             "for a unix socket (422 otherwise, with the reason in `detail`).")


class RenderConfigPatch(BodySchema):
    """The fields to change; unknown fields are a 422, never ignored."""

    enable: bool | None = None
    image_name: str | None = Field(None, max_length=200)
    host: str | None = Field(None, min_length=1, max_length=200)
    port: int | None = Field(None, ge=1, le=65535)
    timeout_ms: int | None = Field(None, ge=1, le=2**31 - 1)
    renderer_num_workers: int | None = Field(None, ge=1, le=1024)
    context_budget: bool | None = None
    derender_coalesce: bool | None = None
    stream_interval: int | None = Field(None, ge=1, le=STREAM_INTERVAL_MAX)
    stream_interval_ms: int | None = Field(None, ge=0, le=STREAM_INTERVAL_MS_MAX)
    local_stream_detokenize: bool | None = None
    obfuscation: bool | None = None
    obfuscation_key_ref: str | None = Field(None, max_length=300, pattern=key_ref_pattern())
    obfuscation_key_id: str | None = Field(None, max_length=100)


class PublishOut(Schema):
    config: RenderConfigOut
    changed: list[str]
    restart_required: bool = Field(description="The managed render sidecar must restart for the change to apply.")


class RenderEndpointIn(BodySchema):
    host: str = optional(min_length=1, max_length=200)
    port: int = optional(ge=1, le=65535)


class RenderConfigImport(BodySchema):
    """The RFC's ``render_config`` object plus this project's keys: every key optional, none null, none unknown.

    The same rules as ``catalog.services.parse_render_config`` (which still checks them: the
    admin and the management command import through it too), written down for the document.
    """

    name: str = optional(min_length=1, max_length=100)
    enable: bool = optional()
    image_name: str = optional(max_length=200)
    endpoint: RenderEndpointIn = optional()
    timeout_ms: int = optional(ge=1, le=2**31 - 1)
    renderer_num_workers: int = optional(ge=1, le=1024)
    context_budget: bool = optional()
    derender_coalesce: bool = optional()
    stream_interval: int = optional(ge=1, le=STREAM_INTERVAL_MAX)
    stream_interval_ms: int = optional(ge=0, le=STREAM_INTERVAL_MS_MAX)
    local_stream_detokenize: bool = optional()
    obfuscation: bool = optional(
        description="true needs obfuscation_key_ref and obfuscation_key_id (422 otherwise)."
    )
    # Only what exists to hold an obfuscation key (catalog.key_refs); the key directory is this deployment's.
    obfuscation_key_ref: str = optional(max_length=300, pattern=key_ref_pattern())
    obfuscation_key_id: str = optional(max_length=100)

    # parse_render_config's one rule across keys, as JSON Schema says it (it answers 422 itself).
    model_config = {"json_schema_extra": {
        "if": {"properties": {"obfuscation": {"const": True}}, "required": ["obfuscation"]},
        "then": {"required": ["obfuscation_key_ref", "obfuscation_key_id"], "properties": {
            "obfuscation_key_ref": {"minLength": 1}, "obfuscation_key_id": {"minLength": 1}}},
    }}


class RenderConfigImportIn(BodySchema):
    """``{"render_config": {...}}``, the RFC's wrapping."""

    render_config: RenderConfigImport


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
@router.post("/render-configs/import", response={200: PublishOut, 409: Detail}, summary="Import the RFC's render_config")
def import_render_config(request: HttpRequest, body: RenderConfigImportIn) -> dict[str, Any]:
    changes = services.parse_render_config(body.render_config.model_dump(exclude_unset=True))  # 422: the body's own rules
    return _publish(changes, request, name=None)


@router.get("/render-configs/{config_id}", response={200: RenderConfigOut, 404: Detail})
def get_render_config(request: HttpRequest, config_id: int) -> Any:
    return _get(config_id)


@router.post("/render-configs/{config_id}/publish", response={200: PublishOut, 404: Detail, 409: Detail})
def publish_render_config(request: HttpRequest, config_id: int, body: RenderConfigPatch) -> dict[str, Any]:
    config = _get(config_id)
    changes = {k: v for k, v in body.model_dump(exclude_unset=True).items() if v is not None}
    if changes.get("obfuscation_key_ref"):
        services.key_ref_check(changes["obfuscation_key_ref"])  # 422: the body's own value
    return _publish(changes, request, name=config.name)


def _publish(changes: dict[str, Any], request: HttpRequest, name: str | None) -> dict[str, Any]:
    """Publish schema-valid ``changes``; 409 when the config they would make breaks a rule.

    Whether it does depends on the stored config as well as the body (``{"obfuscation": true}``
    is fine on a config that has a key), so it is a conflict with the current state, not a 422.
    """
    try:
        result = services.render_config_publish(changes=changes, actor=request_actor(request), name=name)
    except InvalidError as exc:
        raise ConflictError(str(exc)) from None
    return _publish_out(result)


@router.get("/render-configs/{config_id}/sidecars", response={200: list[RenderSidecarOut], 404: Detail})
def list_render_sidecars(request: HttpRequest, config_id: int) -> Any:
    return list(_get(config_id).sidecars.all())


@router.post("/render-configs/{config_id}/sidecars", response={201: RenderSidecarOut, 404: Detail, 409: Detail},
             summary="Add a sidecar to the render pool")
def add_render_sidecar(request: HttpRequest, config_id: int, body: RenderSidecarIn) -> Any:
    _get(config_id)
    return Status(201, services.render_member_add(config_id=config_id, host=body.host, port=body.port,
                                                  actor=request_actor(request)))


@router.delete("/render-configs/{config_id}/sidecars/{member_id}", response={204: None, 404: Detail, 409: Detail},
               summary="Remove a sidecar from the render pool")
def remove_render_sidecar(request: HttpRequest, config_id: int, member_id: int) -> Any:
    _get(config_id)
    if not 0 < member_id < MAX_ID:
        raise NotFoundError(f"No sidecar {member_id} in render config {config_id}.")
    services.render_member_remove(config_id=config_id, member_id=member_id, actor=request_actor(request))
    return Status(204, None)
