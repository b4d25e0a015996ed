"""Endpoints for our own engines, not for clients: the Trigger metaserver callback.

A decode engine in the Trigger topology posts its transfer parameters to the URL the coordinator
handed it (``/internal/metaserver/<token>``). The per-request token is the credential (engines
hold no API key); the registry in ``serving.pipeline.topologies.metaserver`` refuses forged and
replayed callbacks, and the request's own task starts the prefill. A genuine callback that reached
another replica than the one that started the request (a load balancer in front) is forwarded
to its owner over HTTP, once, and the owner's answer is returned as it is.
"""

from __future__ import annotations

import json
import logging

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from serving.pipeline import http
from serving.pipeline.topologies.metaserver import (
    FORWARDED_HEADER,
    CallbackElsewhere,
    CallbackRefused,
    process_metaserver,
)

logger = logging.getLogger(__name__)


def _refusal(status: int, message: str) -> JsonResponse:
    return JsonResponse({"error": {"message": message, "type": "MetaserverError", "param": None, "code": status}}, status=status)


@csrf_exempt
async def metaserver_callback(request: HttpRequest, token: str) -> HttpResponse:
    if request.method != "POST":
        return _refusal(405, "Method not allowed; use POST.")
    metaserver = process_metaserver()
    forwarded = request.headers.get(FORWARDED_HEADER) == "1"
    try:
        # The token first: a forged or replayed callback is refused before its body is parsed,
        # and a forged one is never forwarded.
        metaserver.check(token, forwarded=forwarded)
    except CallbackElsewhere as elsewhere:
        return await _forward(elsewhere, token, request.body)
    except CallbackRefused as exc:
        return _refusal(exc.status, exc.message)
    try:
        body = json.loads(request.body or b"")
    except (ValueError, UnicodeDecodeError):
        return _refusal(400, "callback body must be JSON")
    try:
        reg = metaserver.deliver(token, body, forwarded=forwarded)
    except CallbackRefused as exc:
        return _refusal(exc.status, exc.message)
    logger.info("metaserver request_id=%s callback=accepted engine_request_id=%s", reg.request_id, body.get("request_id"))
    return JsonResponse({"status": "accepted"})


async def _forward(elsewhere: CallbackElsewhere, token: str, body: bytes) -> HttpResponse:
    """The owner's answer to a callback another replica received, status and body unchanged."""
    try:
        answer = await process_metaserver().forward(elsewhere, token, body, http.shared_client())
    except CallbackRefused as exc:
        return _refusal(exc.status, exc.message)
    return HttpResponse(answer.content, status=answer.status_code, content_type=answer.headers.get("content-type", "application/json"))
