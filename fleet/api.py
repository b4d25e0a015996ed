"""REST endpoints for engine instances, breakers, probes and the fleet's status (mounted by ``motorsite.api``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from django.http import HttpRequest
from ninja import Field, Query, Router, Schema
from ninja.responses import Status

from fleet import services
from fleet.engine_capabilities import instance_traffic
from fleet.models import BreakerState, EngineInstance, ProbeResult
from fleet.presenters import ObfuscationStatus, inflight_tokens
from motorsite.core import (
    MAX_ID,
    BodySchema,
    Detail,
    NotFoundError,
    optional,
    request_actor,
)

router = Router(tags=["fleet"])

Role = Literal["union", "prefill", "decode"]
Connector = Literal["", "NixlConnector", "MooncakeConnector", "MooncakeLayerwiseConnector", "ExampleConnector"]
Transfer = Literal["", "pull", "push"]
Hardware = Literal["cpu", "cuda", "A2", "A3", "A5", "310P"]  # EngineInstance.Hardware
# What URLField's validator accepts, narrowed to http(s) and to what a pattern can say exactly:
# every string this matches passes the model's validation, so the document never promises a
# URL the service then refuses.
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
URL_PATTERN = (
    rf"^https?://(localhost|{_OCTET}(\.{_OCTET}){{3}}|([A-Za-z0-9]([A-Za-z0-9-]{{0,61}}[A-Za-z0-9])?\.)+[A-Za-z]{{2,63}})"
    r"(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?$"
)
MAX_INT = 2**31 - 1


class InstanceIn(BodySchema):
    name: str = Field(min_length=1, max_length=100)
    url: str = Field(max_length=200, pattern=URL_PATTERN, description="Base URL, e.g. http://127.0.0.1:8201")
    role: Role = "union"
    served_model_id: int = Field(ge=1, le=MAX_ID)
    weight: int = Field(1, ge=0, le=MAX_INT)
    token_capacity: int = Field(65536, ge=1, le=MAX_INT)
    max_model_len: int | None = Field(None, ge=1, le=MAX_INT)
    cap_token_generate: bool = True
    cap_native_openai: bool = False
    cap_tokenizer: bool = False
    kind: Literal["vllm", "sim"] = "vllm"
    hardware_kind: Hardware = Field("cpu", description="Hardware generation; P and D of one served model share it.")
    kv_connector: Connector = ""
    kv_transfer: Transfer = ""
    kv_port: int | None = Field(None, ge=1, le=65535)
    kv_events_endpoint: str = Field("", max_length=200)
    tp: int = Field(1, ge=1, le=MAX_INT)
    dp: int = Field(1, ge=1, le=MAX_INT)
    ep: int = Field(1, ge=1, le=MAX_INT)
    model_dir: str = Field("", max_length=500)
    obfuscation_key_id: str = Field("", max_length=100)


class InstancePatch(BodySchema):
    """Every field optional; only the fields sent change. Null clears the fields that may be blank."""

    name: str = optional(min_length=1, max_length=100)
    url: str = optional(max_length=200, pattern=URL_PATTERN)
    role: Role = optional()
    served_model_id: int = optional(ge=1, le=MAX_ID)
    weight: int = optional(ge=0, le=MAX_INT)
    token_capacity: int = optional(ge=1, le=MAX_INT)
    max_model_len: int | None = Field(None, ge=1, le=MAX_INT)
    cap_token_generate: bool = optional()
    cap_native_openai: bool = optional()
    cap_tokenizer: bool = optional()
    kind: Literal["vllm", "sim"] = optional()
    hardware_kind: Hardware = optional()
    kv_connector: Connector | None = None
    kv_transfer: Transfer | None = None
    kv_port: int | None = Field(None, ge=1, le=65535)
    kv_events_endpoint: str | None = Field(None, max_length=200)
    tp: int = optional(ge=1, le=MAX_INT)
    dp: int = optional(ge=1, le=MAX_INT)
    ep: int = optional(ge=1, le=MAX_INT)
    model_dir: str | None = Field(None, max_length=500)
    obfuscation_key_id: str | None = Field(None, max_length=100)


class BreakerOut(Schema):
    state: str
    consecutive_failures: int
    open_until: datetime | None
    open_seconds: float
    epoch: int


class InstanceOut(Schema):
    id: int
    name: str
    url: str
    role: str
    served_model: str
    served_model_id: int
    state: str
    breaker_state: str
    breaker: BreakerOut | None
    inflight_tokens: int | None = Field(description="Tokens in flight on this process; null when unknown.")
    health: str
    last_probe_at: datetime | None
    last_probe_ok: bool | None
    version_drift: bool
    drift_reason: str
    weight: int
    token_capacity: int
    max_model_len: int | None
    cap_token_generate: bool
    cap_native_openai: bool
    cap_tokenizer: bool
    kind: str
    hardware_kind: str
    kv_connector: str
    kv_transfer: str
    kv_port: int | None
    kv_events_endpoint: str
    tp: int
    dp: int
    ep: int
    model_dir: str
    reported_version: str
    capabilities: dict[str, Any] = Field(
        description="What the engine's capability probe found it serves: vLLM version, token_in (the 0.23 floor "
        "and /inference/v1/generate), routes, tokenizer_loaded, lora (enabled); empty: not probed yet."
    )
    lora_adapters: list[str] = Field(
        description="The LoRA adapters the engine holds (its /v1/models, read by the LoRA probe every probe "
        "interval): placement sends an adapter's requests only to engines that list it."
    )
    traffic: str = Field(description="Which paths the record and the probed capabilities leave this engine, and its LoRA adapters.")
    obfuscation_excluded_reason: str | None = Field(
        description="Why this instance takes no traffic under the render config's obfuscation setting; null when eligible."
    )


class ProbeOut(Schema):
    id: int
    kind: str
    ok: bool
    latency_ms: float | None
    error: str
    detail: dict[str, Any]
    created: datetime


class FleetStatusOut(Schema):
    control_version: int
    instances: int
    by_state: dict[str, int]
    breaker_open: int
    probe_failing: int
    version_drift: int
    render_health: str
    render_restart_required: bool


def instance_out(
    i: EngineInstance, inflight: dict[str, int] | None = None, obfuscated: ObfuscationStatus | None = None
) -> dict[str, Any]:
    try:
        breaker: BreakerState | None = i.breaker
    except BreakerState.DoesNotExist:
        breaker = None
    data = {f: getattr(i, f) for f in InstanceOut.model_fields if hasattr(i, f) and f not in ("breaker", "served_model")}
    data.update(
        served_model=i.served_model.name,
        breaker=breaker,
        breaker_state=breaker.state if breaker else "closed",
        inflight_tokens=inflight.get(i.name, 0) if inflight is not None else None,
        obfuscation_excluded_reason=(obfuscated or ObfuscationStatus.current()).excluded_reason(i),
        traffic=instance_traffic(i),
    )
    return data


def _instances() -> Any:
    return EngineInstance.objects.select_related("served_model", "breaker")


def _one(instance_id: int) -> dict[str, Any]:
    if not 0 < instance_id < MAX_ID:
        raise NotFoundError(f"No engine instance with id {instance_id}.")
    i = _instances().filter(id=instance_id).first()
    if i is None:
        raise NotFoundError(f"No engine instance with id {instance_id}.")
    return instance_out(i, inflight_tokens(), ObfuscationStatus.current())


@router.get("/instances", response=list[InstanceOut], summary="List engine instances")
def list_instances(request: HttpRequest) -> list[dict[str, Any]]:
    inflight = inflight_tokens()
    obfuscated = ObfuscationStatus.current()
    return [instance_out(i, inflight, obfuscated) for i in _instances()]


@router.post("/instances", response={201: InstanceOut, 404: Detail, 409: Detail}, summary="Register an instance")
def create_instance(request: HttpRequest, body: InstanceIn) -> Status[dict[str, Any]]:
    instance = services.instance_create(actor=request_actor(request), **body.model_dump())
    return Status(201, _one(instance.id))


@router.get("/instances/{instance_id}", response={200: InstanceOut, 404: Detail})
def get_instance(request: HttpRequest, instance_id: int) -> dict[str, Any]:
    return _one(instance_id)


@router.patch("/instances/{instance_id}", response={200: InstanceOut, 404: Detail, 409: Detail})
def patch_instance(request: HttpRequest, instance_id: int, body: InstancePatch) -> dict[str, Any]:
    _one(instance_id)
    changes = body.model_dump(exclude_unset=True)  # the schema refuses null where a field cannot be blank
    for blankable in ("kv_connector", "kv_transfer", "kv_events_endpoint", "model_dir", "obfuscation_key_id"):
        if blankable in changes and changes[blankable] is None:
            changes[blankable] = ""
    services.instance_update(instance_id=instance_id, actor=request_actor(request), **changes)
    return _one(instance_id)


class AscendLaunchOut(Schema):
    command_line: str = Field(description="What to run on the engine's host (shell-quoted).")
    argv: list[str]
    env: dict[str, str]
    kv_transfer_config: dict[str, Any] | None


@router.get(
    "/instances/{instance_id}/ascend-launch", response={200: AscendLaunchOut, 404: Detail},
    summary="vllm-ascend launch arguments",
)
def ascend_launch(request: HttpRequest, instance_id: int) -> dict[str, Any]:
    """The vllm-ascend command for this instance; 422 names every DFX rule it breaks (a fleet rule, as on create)."""
    launch = services.instance_ascend_launch(instance=services.instance_get(instance_id=instance_id))
    return {"command_line": launch.command_line(), "argv": launch.argv, "env": launch.env,
            "kv_transfer_config": launch.kv_transfer_config}


@router.delete("/instances/{instance_id}", response={204: None, 404: Detail})
def delete_instance(request: HttpRequest, instance_id: int) -> Status[None]:
    _one(instance_id)
    services.instance_delete(instance_id=instance_id, actor=request_actor(request))
    return Status(204, None)


class QuarantineIn(BodySchema):
    reason: str = Field("", max_length=500)


def _state_action(request: HttpRequest, instance_id: int, action: str, reason: str = "") -> dict[str, Any]:
    _one(instance_id)
    services.instance_set_state(instance_id=instance_id, action=action, actor=request_actor(request), reason=reason)
    return _one(instance_id)


STATE_RESPONSES = {200: InstanceOut, 404: Detail, 409: Detail}


@router.post("/instances/{instance_id}/drain", response=STATE_RESPONSES, summary="Stop sending new requests")
def drain(request: HttpRequest, instance_id: int) -> dict[str, Any]:
    return _state_action(request, instance_id, "drain")


@router.post("/instances/{instance_id}/undrain", response=STATE_RESPONSES, summary="Take new requests again")
def undrain(request: HttpRequest, instance_id: int) -> dict[str, Any]:
    return _state_action(request, instance_id, "undrain")


@router.post("/instances/{instance_id}/quarantine", response=STATE_RESPONSES)
def quarantine(request: HttpRequest, instance_id: int, body: QuarantineIn | None = None) -> dict[str, Any]:
    return _state_action(request, instance_id, "quarantine", body.reason if body else "")


@router.post("/instances/{instance_id}/breaker/reset", response={200: InstanceOut, 404: Detail})
def breaker_reset(request: HttpRequest, instance_id: int) -> dict[str, Any]:
    _one(instance_id)
    services.breaker_reset(instance_id=instance_id, actor=request_actor(request))
    return _one(instance_id)


@router.post("/instances/{instance_id}/breaker/open", response={200: InstanceOut, 404: Detail})
def breaker_open(
    request: HttpRequest, instance_id: int, seconds: float = Query(60.0, gt=0, le=86400),
) -> dict[str, Any]:
    _one(instance_id)
    services.breaker_force_open(instance_id=instance_id, actor=request_actor(request), seconds=seconds)
    return _one(instance_id)


@router.get("/instances/{instance_id}/probes", response={200: list[ProbeOut], 404: Detail}, summary="Probe history")
def instance_probes(request: HttpRequest, instance_id: int, limit: int = Query(50, ge=1, le=500)) -> Any:
    _one(instance_id)
    return list(ProbeResult.objects.filter(instance_id=instance_id)[:limit])


@router.post("/probes/run", response={202: Detail, 503: Detail}, summary="Probe every instance now")
def run_probes(request: HttpRequest) -> Status[dict[str, str]]:
    queued = services.probes_enqueue(instance_ids=list(EngineInstance.objects.values_list("id", flat=True)))
    if queued is None:
        return Status(503, {"detail": "Probes are unavailable: the Celery broker refused the message."})
    return Status(202, {"detail": f"Queued probes of {queued} instance(s)."})


@router.get("/fleet/status", response=FleetStatusOut, summary="Fleet at a glance")
def fleet_status(request: HttpRequest) -> dict[str, Any]:
    return services.fleet_status()


