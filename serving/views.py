"""The OpenAI-compatible API under /v1: thin async views over the data plane.

Views parse and validate, check the client key and the model name against the fleet snapshot
(unknown model -> 404 before any render call), then hand the request to ``ServingPipeline``.
Every error leaves as an OpenAI error body with the right status, never an HTML page.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET

from serving.pipeline import request_checks
from serving.pipeline.engine.native import NativeStream
from serving.pipeline.errors import (
    ModelNotFound,
    MotorError,
    NotFound,
    RequestError,
    Unauthorized,
    error_body,
    error_headers,
)
from serving.pipeline.flow_control import rate_limit
from serving.pipeline.service import EventStream
from serving.pipeline.snapshot import FleetSnapshot
from serving.runtime import pipeline_for
from serving.snapshots import current_snapshot

logger = logging.getLogger(__name__)


# Closings started by _close_if_abandoned; held here so the loop cannot drop one midway.
_abandoned: set[asyncio.Task[None]] = set()


def _close_if_abandoned(stream: EventStream | NativeStream) -> None:
    """Close ``stream``'s engine streams if the request's task ends before its body started.

    Django's ASGIHandler runs the middleware, the view and ``send_response`` in one task and
    cancels it when the client leaves. A disconnect after the view returned but before the first
    body chunk (the middleware's ``process_response`` hops to a thread and back) drops the
    response unsent, as does a middleware error replacing it: ``frames()`` never ran, so its
    ``finally`` cannot abort the engines or release the load. The task's end is the one event
    every such path shares; once ``frames()`` has started it owns the cleanup and this is a no-op.
    """

    def on_done(task: asyncio.Task[object]) -> None:
        if not stream.started:
            closing = task.get_loop().create_task(stream.aclose())
            _abandoned.add(closing)
            closing.add_done_callback(_abandoned.discard)

    task = asyncio.current_task()
    assert task is not None  # an async view always runs in a task
    task.add_done_callback(on_done)


def _error(exc: BaseException) -> JsonResponse:
    status, body = error_body(exc)
    return JsonResponse(body, status=status, headers=error_headers(exc))


def _check_key(request: HttpRequest, snapshot: FleetSnapshot) -> None:
    """Require a client key: one of the snapshot's hashed keys (no query per request).

    Until the first client key record exists, ``MOTOR_API_KEYS`` (plain keys from the environment)
    is used instead, so a deployment without managed keys keeps working; once any record exists
    (even a revoked one) only records count, so revoking the last key never reopens /v1.
    """
    auth = request.headers.get("Authorization", "")
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    if snapshot.client_keys_managed:
        # A dict lookup by sha256 of the token: the hash hides timing of the stored key bytes.
        digest = hashlib.sha256(token.encode("utf-8")).hexdigest() if token else ""
        key = snapshot.client_keys.get(digest) if digest else None
        if key is not None:
            request_checks.bind_policy(request_checks.KeyPolicy(allow_priority=key.allow_priority))
            # The limit is charged after render, once the token count is known (rate_limit.charge).
            rate_limit.bind(
                rate_limit.KeyLimit(digest, key.name, key.tokens_per_minute) if key.tokens_per_minute else None
            )
            return
        raise Unauthorized("Missing or invalid API key: send `Authorization: Bearer <key>`.")
    keys = settings.MOTOR_API_KEYS
    if not keys:
        return
    if not any(hmac.compare_digest(token, k) for k in keys):
        raise Unauthorized("Missing or invalid API key: send `Authorization: Bearer <key>`.")


def _parse_body(request: HttpRequest) -> dict[str, Any]:
    try:
        raw = request.body
    except RequestDataTooBig:
        raise RequestError("The request body is too large.", status=413) from None
    try:
        body = json.loads(raw or b"")
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"Invalid JSON in request body: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    return body


def _resolve_model(body: dict[str, Any], snapshot: FleetSnapshot) -> None:
    model = body.get("model")
    if model is None and snapshot.models:
        # vLLM serves the first served name when `model` is absent; so does the coordinator.
        body["model"] = next(iter(snapshot.models))
        return
    if not isinstance(model, str) or model not in snapshot.models:
        raise ModelNotFound(str(model))


async def _serve(request: HttpRequest, kind: str) -> HttpResponse:
    start = time.perf_counter()
    request_id = uuid.uuid4().hex
    try:
        if request.method != "POST":
            raise RequestError("Method not allowed; use POST.", status=405)
        snapshot = await current_snapshot()
        _check_key(request, snapshot)
        body = _parse_body(request)
        _resolve_model(body, snapshot)
        pipeline = pipeline_for(snapshot)
        # chat | completions | responses | messages: the last two always take the native path.
        result = await getattr(pipeline, kind)(body, request_id)
    except MotorError as exc:
        logger.info(
            "response request_id=%s kind=%s status=%d error=%s latency_ms=%.1f",
            request_id, kind, exc.status, type(exc).__name__, (time.perf_counter() - start) * 1000,
        )
        return _error(exc)
    except Exception as exc:  # a bug, not the client's fault: log it, answer a clean 500
        logger.exception("response request_id=%s kind=%s status=500", request_id, kind)
        return _error(exc)
    if isinstance(result, (EventStream, NativeStream)):
        _close_if_abandoned(result)  # no await since the streams opened: nothing can slip in before
        response = StreamingHttpResponse(result.frames(), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Request-Id"] = request_id
        return response
    logger.info(
        "response request_id=%s kind=%s status=200 latency_ms=%.1f",
        request_id, kind, (time.perf_counter() - start) * 1000,
    )
    return JsonResponse(result, headers={"X-Request-Id": request_id})


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await _serve(request, "chat")


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    return await _serve(request, "completions")


@csrf_exempt
async def responses(request: HttpRequest) -> HttpResponse:
    return await _serve(request, "responses")


@csrf_exempt
async def messages(request: HttpRequest) -> HttpResponse:
    return await _serve(request, "messages")


async def models(request: HttpRequest) -> HttpResponse:
    snapshot = await current_snapshot()
    try:
        _check_key(request, snapshot)
    except MotorError as exc:
        return _error(exc)
    now = int(time.time())
    data = [
        {
            "id": m.name,
            "object": "model",
            "created": now,
            "owned_by": "motorsite",
            "root": m.model_path,
            "parent": None,
            "max_model_len": m.max_model_len,
            "permission": [],
        }
        for m in snapshot.models.values()
    ]
    return JsonResponse({"object": "list", "data": data})


async def not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    """Unknown paths under /v1 get an OpenAI error body, not Django's HTML 404 page."""
    return _error(NotFound(f"Not found: {request.method} {request.path}"))


@require_GET
async def healthz(request: HttpRequest) -> HttpResponse:
    """Liveness of the coordinator, plus whether the render sidecar answers."""
    from serving.pipeline import http
    from serving.pipeline.render.client import RenderClient

    snapshot = await current_snapshot()
    render = RenderClient(http.shared_client(), snapshot.render.base_url, min(snapshot.render.timeout_s, 1.0))
    render_ok = await render.health()
    return JsonResponse({"status": "ok", "render": "up" if render_ok else "down", "fleet_version": snapshot.version})


@require_GET
async def prometheus_metrics(request: HttpRequest) -> HttpResponse:
    """This process's per-instance request totals, in-flight tokens and router counters, as Prometheus text."""
    from serving import runtime
    from serving.pipeline import metric_names, metrics

    text = metrics.prometheus_text(metrics.snapshot(), runtime.inflight_tokens())
    router = runtime.router_metrics()
    samples = {key: float(n) for key, n in router.get("counters", {}).items()}
    samples[(metric_names.ADMISSION_WAITING.name, ())] = float(router.get("admission_waiting") or 0)
    samples.update(await _process_samples())
    lines = metric_names.exposition(samples)
    return HttpResponse(text + "\n".join(lines) + "\n", content_type="text/plain; version=0.0.4; charset=utf-8")


async def _process_samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The launcher's processes (``make run``): restarts so far and whether each is up.

    One query per scrape, not per request; the launcher writes these rows as its children exit
    and recover (``motorsite.launcher.records``).
    """
    from asgiref.sync import sync_to_async
    from django.db import DatabaseError

    from fleet.models import ManagedProcess
    from serving.pipeline import metric_names

    try:
        rows = await sync_to_async(list)(ManagedProcess.objects.values_list("name", "state", "restarts"))
    except DatabaseError:
        # The request path serves from its snapshot while the database is away; so does /metrics.
        logger.warning("/metrics: launcher processes unavailable (database error)", exc_info=True)
        return {}
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for name, state, restarts in rows:
        label = (("process", name),)
        samples[(metric_names.PROCESS_RESTARTS.name, label)] = float(restarts)
        samples[(metric_names.PROCESS_UP.name, label)] = 1.0 if state == ManagedProcess.State.RUNNING else 0.0
    return samples
