"""Endpoints for our own engines, not for clients: the Trigger metaserver callback.

A decode engine in the Trigger topology posts its transfer parameters to the URL the coordinator
handed it (``/internal/metaserver/<token>``). The per-request token is the credential (engines
hold no API key); the registry in ``serving.pipeline.topologies.metaserver`` refuses forged, replayed
and misdirected callbacks, and the request's own task starts the prefill.
"""

from __future__ import annotations

import json
import logging

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from serving.pipeline.topologies.metaserver import CallbackRefused, process_metaserver

logger = logging.getLogger(__name__)


def _refusal(status: int, message: str) -> JsonResponse:
    return JsonResponse({"error": {"message": message, "type": "MetaserverError", "param": None, "code": status}}, status=status)


@csrf_exempt
async def metaserver_callback(request: HttpRequest, token: str) -> JsonResponse:
    if request.method != "POST":
        return _refusal(405, "Method not allowed; use POST.")
    metaserver = process_metaserver()
    try:
        # The token first: a forged or replayed callback is refused before its body is parsed.
        metaserver.check(token)
    except CallbackRefused as exc:
        return _refusal(exc.status, exc.message)
    try:
        body = json.loads(request.body or b"")
    except (ValueError, UnicodeDecodeError):
        return _refusal(400, "callback body must be JSON")
    try:
        reg = metaserver.deliver(token, body)
    except CallbackRefused as exc:
        return _refusal(exc.status, exc.message)
    logger.info("metaserver request_id=%s callback=accepted engine_request_id=%s", reg.request_id, body.get("request_id"))
    return JsonResponse({"status": "accepted"})
