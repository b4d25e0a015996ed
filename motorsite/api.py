"""The REST API under /api/: one NinjaAPI, its auth, its error handlers and its error schemas, set once here.

Every error leaves as ``{"detail": ...}``:

    400  the body is not JSON                                  (``Detail``)
    401  missing or unknown key                                (``Detail``)
    403  a client-scope key                                    (``Detail``)
    404  unknown object                                        (``Detail``, declared by the operation)
    409  a state change the current state forbids              (``Detail``, declared by the operation)
    422  the input fails its schema: ``detail`` is ninja's list of field errors;
         the input passes its schema but breaks a rule: ``detail`` is one sentence  (``Unprocessable``)

The statuses every operation shares (400 for a body, 401/403 for the key, 422 for any input) are
added to each operation's declared responses by ``declare_shared_errors`` below, so the OpenAPI
document says what the handlers here really send and no endpoint can forget one.
"""

from __future__ import annotations

import logging
from typing import Any

from django.http import HttpRequest, HttpResponse
from ninja import Field, NinjaAPI, Router, Schema
from ninja.constants import NOT_SET
from ninja.params.models import BodyModel
from ninja.security import HttpBearer

from fleet.models import ApiKey
from fleet.services import api_key_lookup
from motorsite.core import Detail, ServiceError

logger = logging.getLogger(__name__)


class Forbidden(Exception):
    pass


class FieldError(Schema):
    """One item of ninja's validation error list (pydantic's error without the rejected input)."""

    type: str
    loc: list[str | int]
    msg: str
    ctx: dict[str, Any] | None = None


class Unprocessable(Schema):
    detail: list[FieldError] | str = Field(
        description="Ninja's field errors when the input fails its schema; one sentence when it breaks a rule."
    )


class AdminKeyAuth(HttpBearer):
    """``Authorization: Bearer <admin key>``; the key is looked up by its sha256, never stored."""

    def authenticate(self, request: HttpRequest, token: str) -> ApiKey | None:
        key = api_key_lookup(token) if token else None
        if key is None:
            return None  # -> 401
        if key.scope != ApiKey.Scope.ADMIN:
            raise Forbidden("This key is a client key (for /v1); the REST API needs an admin-scope key.")
        return key


api = NinjaAPI(
    title="motorsite control plane",
    version="1",
    description="Engine instances, breakers, probes and render configs of a motorsite fleet.",
    auth=AdminKeyAuth(),
    urls_namespace="api",
)


@api.exception_handler(ServiceError)
def service_error(request: HttpRequest, exc: ServiceError) -> HttpResponse:
    return api.create_response(request, {"detail": str(exc)}, status=exc.status)


@api.exception_handler(Forbidden)
def forbidden(request: HttpRequest, exc: Forbidden) -> HttpResponse:
    return api.create_response(request, {"detail": str(exc)}, status=403)


def declare_shared_errors(router: Router) -> None:
    """Add the statuses this module's auth and handlers send to every operation of ``router``.

    Runs on the router templates before ``api.urls`` binds (and copies) their operations. A
    status an operation declares itself is kept, except 422: its body is always ``Unprocessable``,
    because ninja's own validation errors can answer any operation that takes input.
    """
    for path_view in router.path_operations.values():
        for operation in path_view.operations:
            shared: dict[int, type[Schema]] = {}
            if operation.auth_param is NOT_SET or operation.auth_param:  # the API's key auth applies
                shared[401] = shared[403] = Detail
            if any(issubclass(model, BodyModel) for model in operation.models):
                shared[400] = Detail  # ninja: "Cannot parse request body"
            if operation.models:
                shared[422] = Unprocessable
            operation.response_models.pop(422, None)
            for status, schema in shared.items():
                operation.response_models.setdefault(status, operation._create_response_model(schema))


from catalog.api import router as catalog_router  # noqa: E402
from catalog.models_api import router as models_router  # noqa: E402
from fleet.api import router as fleet_router  # noqa: E402  (after the handlers: they are the API's)

for _router in (fleet_router, catalog_router, models_router):
    declare_shared_errors(_router)
    api.add_router("", _router)
