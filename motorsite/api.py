"""The REST API under /api/: one NinjaAPI, its auth and its error handlers, set once here.

Every error leaves as ``{"detail": ...}``: 401 missing or unknown key, 403 a client-scope key,
404 unknown object, 409 a state change the current state forbids, 422 an invalid body.
"""

from __future__ import annotations

import logging

from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.security import HttpBearer

from fleet.models import ApiKey
from fleet.services import api_key_lookup
from motorsite.core import ServiceError

logger = logging.getLogger(__name__)


class Forbidden(Exception):
    pass


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


from catalog.api import router as catalog_router  # noqa: E402
from fleet.api import router as fleet_router  # noqa: E402  (after the handlers: they are the API's)

api.add_router("", fleet_router)
api.add_router("", catalog_router)
