"""The control plane's small core: the service-error tree, the control version, the current render config.

Every control-plane module (catalog, fleet, launcher, API) may import this; it imports only the
two apps' models, never their services, API or tasks, so nothing here can close an import cycle.

Exceptions (raised by the apps' ``services`` with a message meant for the operator; the API maps
``status`` to the response code):

    ServiceError         - 400
    ├── NotFoundError    - 404: the object named does not exist
    ├── ConflictError    - 409: the object's state forbids the action
    └── InvalidError     - 422: the input breaks a rule
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F
from django.http import HttpRequest
from ninja import Field, Schema
from pydantic import BaseModel, ConfigDict, model_validator

from catalog.models import RenderConfig, ServedModel
from fleet.models import ApiKey, ControlVersion


class ServiceError(Exception):
    status = 400


class NotFoundError(ServiceError):
    status = 404


class ConflictError(ServiceError):
    status = 409


class InvalidError(ServiceError):
    status = 422


# -- control version ----------------------------------------------------------------------------


def bump_control_version() -> int:
    """Increment the control version; return the new value.

    Every change of control data calls this inside its own transaction: it is how coordinator
    processes learn that their snapshot is stale.
    """
    with transaction.atomic():
        if not ControlVersion.objects.filter(id=1).update(value=F("value") + 1):
            ControlVersion.objects.get_or_create(id=1, defaults={"value": 1})
        return ControlVersion.objects.values_list("value", flat=True).get(id=1)


def read_control_version() -> int:
    """The current control version; 0 before the first change."""
    return ControlVersion.objects.filter(id=1).values_list("value", flat=True).first() or 0


# -- the render config --------------------------------------------------------------------------


def current_render_config() -> RenderConfig | None:
    """The render config in force: the oldest row (None when there is none yet).

    The coordinators' snapshot, the probes, the launcher, the admin and the API all read this
    one row, so they can never disagree about which sidecar is meant.
    """
    return RenderConfig.objects.order_by("id").first()


def render_configs_by_model(models: list[ServedModel]) -> dict[int, RenderConfig | None]:
    """Each model's render config, by model id, in one query.

    A model's own row (``RenderConfig.served_model``) if it has one, else the default (the oldest
    row linked to no model). None when neither exists: with no row at all the caller uses
    ``RenderConfig()``'s defaults, as a fresh single-model deployment always has; with rows that
    all belong to other models, that model has no sidecar and must never be sent to another's.
    """
    rows = list(RenderConfig.objects.order_by("id"))
    own = {cfg.served_model_id: cfg for cfg in rows if cfg.served_model_id is not None}
    default = next((cfg for cfg in rows if cfg.served_model_id is None), None)
    if not rows:
        return {m.id: RenderConfig() for m in models}
    return {m.id: own.get(m.id, default) for m in models}


# -- what every API router shares ---------------------------------------------------------------

MAX_ID = 2**62  # beyond any row id; keeps nonsense ids out of the database driver


class Detail(Schema):
    detail: str


class BodySchema(BaseModel):
    """A request body that takes exactly what the OpenAPI document says: JSON types, no unknown keys.

    Strict, because lax pydantic takes ``"3"`` for an integer and ``1`` for a boolean, which the
    document calls invalid; but 3.0 is an integer to JSON Schema, so whole floats become ints.
    A plain pydantic model, not ninja's ``Schema``: that one validates a second time through its
    ORM getter, which this validator cannot see into, and a body has no ORM object to read.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _whole_floats_are_integers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in data.items()}
        return data


def _absent_unless_sent(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


def optional(**constraints: Any) -> Any:
    """A body field that may be left out but is never null: left out means unchanged.

    The document shows no ``"default": null`` (which would invite a null the field refuses).
    """
    return Field(None, json_schema_extra=_absent_unless_sent, **constraints)


def request_actor(request: HttpRequest) -> str:
    """Who an API call acts as, for history rows: ``api:<key name>``."""
    key = getattr(request, "auth", None)
    return f"api:{key.name}" if isinstance(key, ApiKey) else "api"
