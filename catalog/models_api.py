"""REST endpoints for served models (mounted by ``motorsite.api``): list, add, weigh placement's
scorers, drain, retire, activate."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Field, Router, Schema
from ninja.responses import Status

from catalog import served_models, services
from catalog.api import RenderConfigImport
from catalog.models import SCORER_WEIGHT_MAX, ServedModel
from motorsite.core import BodySchema, Detail, optional, request_actor

router = Router(tags=["models"])


class ServedModelOut(Schema):
    id: int
    name: str
    model_path: str
    max_model_len: int
    vocab_size: int | None
    state: str = Field(description="active: served; draining: no new requests (503); retired: unknown to clients (404).")
    render_config: str | None = Field(
        description="The name of the model's own render config; null: it uses the default one (linked to no model)."
    )
    prefix_weight: float = Field(description="Placement: weight of KV-cache prefix affinity (docs/request-path.md, Placement).")
    queue_weight: float = Field(description="Placement: weight of requests in flight per engine weight.")
    tokens_weight: float = Field(description="Placement: weight of admitted tokens in flight per token capacity.")
    base: str | None = Field(
        description="For a LoRA adapter: the served model it adapts, whose render config renders it and whose "
        "engines that load it (--lora-modules) run it; null for a model."
    )

    @staticmethod
    def resolve_base(obj: ServedModel) -> str | None:
        return obj.base.name if obj.base else None

    @staticmethod
    def resolve_render_config(obj: ServedModel) -> str | None:
        try:
            return obj.render_config.name
        except ServedModel.render_config.RelatedObjectDoesNotExist:
            return None


class ServedModelIn(BodySchema):
    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    model_path: str = Field(min_length=1, max_length=500)
    max_model_len: int = Field(2048, ge=1, le=2**31 - 1)
    render_config: RenderConfigImport = optional(
        description="The model's own render sidecar, in the RFC's render_config shape (named after the model "
        "unless it says otherwise). Left out: the model uses the default render config."
    )
    base: str = optional(
        description="Makes the model a LoRA adapter of this served model (its name is the adapter's "
        "--lora-modules name, model_path its directory); it takes no render_config of its own (422 with one)."
    )


def _weight(description: str) -> Any:
    return optional(ge=0, le=SCORER_WEIGHT_MAX, allow_inf_nan=False, description=description)


class ServedModelPatch(BodySchema):
    """Placement's scorer weights; only the weights sent change. Each scorer scores every candidate
    engine in [0, 1] and the highest weighted sum wins (ties: the least loaded)."""

    prefix_weight: float = _weight("KV-cache prefix affinity: the share of the prompt an engine caches.")
    queue_weight: float = _weight("Requests in flight per engine weight: the least loaded scores 1.")
    tokens_weight: float = _weight("Admitted tokens in flight per token capacity: the least loaded scores 1.")


@router.get("/models", response=list[ServedModelOut])
def list_models(request: HttpRequest) -> Any:
    return list(ServedModel.objects.select_related("render_config", "base").order_by("id"))


@router.post("/models", response={201: ServedModelOut, 409: Detail}, summary="Add a served model")
def add_model(request: HttpRequest, body: ServedModelIn) -> Any:
    render = None
    if body.render_config is not None:
        render = services.parse_render_config(body.render_config.model_dump(exclude_unset=True))  # 422
    return Status(201, served_models.served_model_add(
        name=body.name, model_path=body.model_path, max_model_len=body.max_model_len, render=render,
        actor=request_actor(request), base=body.base,
    ))


@router.get("/models/{name}", response={200: ServedModelOut, 404: Detail})
def get_model(request: HttpRequest, name: str) -> Any:
    return served_models.served_model_get(name=name)


@router.patch("/models/{name}", response={200: ServedModelOut, 404: Detail}, summary="Weigh placement's scorers")
def patch_model(request: HttpRequest, name: str, body: ServedModelPatch) -> Any:
    return served_models.served_model_set_weights(
        name=name, weights=body.model_dump(exclude_unset=True), actor=request_actor(request)
    )


def _state(request: HttpRequest, name: str, state: str) -> Any:
    return served_models.served_model_set_state(name=name, state=state, actor=request_actor(request))


@router.post("/models/{name}/drain", response={200: ServedModelOut, 404: Detail}, summary="Take no new requests")
def drain_model(request: HttpRequest, name: str) -> Any:
    return _state(request, name, ServedModel.State.DRAINING)


@router.post("/models/{name}/retire", response={200: ServedModelOut, 404: Detail}, summary="Stop serving the model")
def retire_model(request: HttpRequest, name: str) -> Any:
    return _state(request, name, ServedModel.State.RETIRED)


@router.post("/models/{name}/activate", response={200: ServedModelOut, 404: Detail}, summary="Serve the model again")
def activate_model(request: HttpRequest, name: str) -> Any:
    return _state(request, name, ServedModel.State.ACTIVE)
