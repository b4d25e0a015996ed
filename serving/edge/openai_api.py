"""The OpenAI-compatible API under /v1, served by the edge without Django's handler.

Each request: method, client key and the model name are checked against the fleet snapshot
(unknown model -> 404 before any render call), a body not declared ``application/json`` is
refused as vLLM refuses it, the body is read under the size cap and parsed
strictly, then ``ServingPipeline`` serves it while ``DisconnectWatch`` cancels the request's task
if the client leaves. Every error leaves as an OpenAI error body with the right status; the
text of errors that name engines or addresses is logged, not returned (``MotorError.public``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from django.conf import settings

from serving.edge.asgi import (
    BodyTooLarge,
    ClientGone,
    ClientStalled,
    DisconnectWatch,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    send_json,
    send_stream,
)
from serving.edge.bodies import parse_object
from serving.edge.keys import authenticate
from serving.pipeline import metric_names, tracing
from serving.pipeline.apis.messages import anthropic_error
from serving.pipeline.errors import (
    ModelDraining,
    ModelNotFound,
    MotorError,
    NotFound,
    RequestError,
    error_body,
    error_headers,
)
from serving.pipeline.phases import Phases
from serving.pipeline.request_checks import RESPONSE_CONTROLS
from serving.pipeline.request_context import KeyGrant, RequestContext
from serving.pipeline.response import Response
from serving.pipeline.snapshot import FleetSnapshot
from serving.pipeline.sse import FieldScrub
from serving.runtime import phase_histograms, pipeline_for, tracer
from serving.snapshots import current_snapshot

logger = logging.getLogger(__name__)

Endpoint = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, exc: BaseException, request_id: str | None = None, kind: str = "") -> None:
    status, body = error_body(exc)
    if kind == "messages":  # the Anthropic API answers in Anthropic's error shape, as vLLM's does
        body = anthropic_error(status, body)
    extra = [(name.lower().encode(), value.encode()) for name, value in error_headers(exc).items()]
    if request_id is not None:
        extra.append((b"x-request-id", request_id.encode()))
    await send_json(send, status, body, extra)


def _check_key(scope: Scope, snapshot: FleetSnapshot) -> KeyGrant:
    return authenticate(scope, snapshot, env_keys=settings.MOTOR_API_KEYS, open_access=settings.MOTOR_OPEN_ACCESS)


def _check_media_type(scope: Scope) -> None:
    """Refuse a body that is not declared JSON, as vLLM's own routes do (``validate_json_request``).

    Same status and words as vLLM (400, not 415), checked before a byte of the body is read.
    """
    value = header(scope, b"content-type") or b""
    if value.split(b";", 1)[0].strip().lower() != b"application/json":
        raise RequestError("Unsupported Media Type: Only 'application/json' is allowed.")


def _resolve_model(body: dict[str, Any], snapshot: FleetSnapshot) -> str:
    """The served model the request names (set into ``body`` when absent), else the client's error.

    A retired model is unknown to clients; a draining one refuses new requests with 503 while
    those already admitted finish. Both decided here, before any render call.
    """
    model = body.get("model")
    if model is None:
        # vLLM serves the first served name when `model` is absent; so does the coordinator.
        model = next((m.name for m in snapshot.models.values() if m.serves_requests), None)
        if model is None:
            raise ModelNotFound("None")
        body["model"] = model
        return model
    view = snapshot.models.get(model) if isinstance(model, str) else None
    if view is None or view.state == "retired":
        raise ModelNotFound(str(model))
    if not view.serves_requests:
        raise ModelDraining(model)
    return model


def _log_error(request_id: str, kind: str, exc: BaseException, start: float) -> None:
    latency_ms = (time.perf_counter() - start) * 1000
    if not isinstance(exc, MotorError):  # a bug, not the client's fault: log it, answer a clean 500
        logger.error("response request_id=%s kind=%s status=500", request_id, kind, exc_info=exc)
        return
    # The full message (engine names, addresses) stays in the log when the client gets the public one.
    detail = f" detail={exc.message!r}" if exc.public is not None else ""
    logger.info(
        "response request_id=%s kind=%s status=%d error=%s latency_ms=%.1f%s",
        request_id, kind, exc.status, type(exc).__name__, latency_ms, detail,
    )


def serve(kind: str) -> Endpoint:
    """The endpoint that hands a request to ``ServingPipeline.<kind>``.

    chat | completions | responses | messages: Responses and Messages take the chat token path
    when render can render them (``apis/responses.py``, ``apis/messages.py``).
    """

    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        start = time.perf_counter()
        arrived = phase_histograms.clock()
        request_id = uuid.uuid4().hex
        rid = request_id.encode()
        try:
            if scope["method"] != "POST":
                raise RequestError("Method not allowed; use POST.", status=405)
            snapshot = await current_snapshot()
            # The key before the body: a client without one cannot make this process read a byte.
            grant = _check_key(scope, snapshot)
            _check_media_type(scope)
            try:
                raw = await read_body(scope, receive, settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
            except BodyTooLarge:
                raise RequestError("The request body is too large.", status=413) from None
            body = parse_object(raw, max_depth=settings.MOTOR_MAX_JSON_DEPTH)
            model = _resolve_model(body, snapshot)
        except ClientGone:
            return
        except Exception as exc:
            _log_error(request_id, kind, exc, start)
            await send_error(send, exc, request_id, kind)
            return
        parent = tracing.incoming(scope["headers"])
        phases = Phases.begin(phase_histograms, kind, body, arrived, tracer=tracer, request_id=request_id,
                              parent=parent, model=model)
        # What the sidecar and the engines get: the root span's context when tracing, else the
        # client's own trace headers unchanged, so the engines' traces still join the client's.
        carried = phases.trace.headers if phases.trace is not None else parent
        ctx = RequestContext.granted(request_id, grant.for_model(model), phases, carried or tracing.NO_TRACE)
        try:
            await _serve(kind, body, ctx, rid, snapshot, model, start, receive, send)
        except BaseException as exc:
            phases.close(exc)
            raise
        phases.close()  # a no-op once the end-to-end phase ended the trace; else it ends it here

    return endpoint


async def _serve(
    kind: str, body: dict[str, Any], ctx: RequestContext, rid: bytes, snapshot: FleetSnapshot, model: str,
    start: float, receive: Receive, send: Send,
) -> None:
    """Run the pipeline's ``kind`` on a parsed request and send its answer (a stream or JSON).

    What the request holds (its charge, render count, engine streams) is its ``Response``'s to
    let go (``serving/pipeline/response.py``), whichever way it ends: the edge only sends.
    """
    request_id, phases = ctx.request_id, ctx.phases
    async with DisconnectWatch(receive) as watch:
        try:
            # Over the model's own view of the fleet: its render config and its engines only.
            pipeline = pipeline_for(snapshot, model)
            result = await getattr(pipeline, kind)(body, ctx)
        except Exception as exc:
            watch.complete = True
            _log_error(request_id, kind, exc, start)
            await send_error(send, exc, request_id, kind)
            phases.close(exc)
            return
        if isinstance(result, Response):
            async with result:  # closed however sending ends, also before its first frame
                try:
                    # Native streams are the engine's bytes relayed: its engine-internal fields are
                    # nulled here, as ``scrub_response`` does for JSON answers.
                    scrub = FieldScrub(RESPONSE_CONTROLS)
                    await send_stream(send, result.frames(), ((b"x-request-id", rid),), watch, scrub,
                                      stall_s=settings.MOTOR_CLIENT_STALL_S)
                except ClientStalled:
                    # The stream is closed (engines aborted, lease released) and the connection dropped.
                    logger.info(
                        "response request_id=%s kind=%s status=200 outcome=client_stalled stall_s=%d "
                        "latency_ms=%.1f", request_id, kind, settings.MOTOR_CLIENT_STALL_S,
                        (time.perf_counter() - start) * 1000,
                    )
                    return
            phases.observe(metric_names.PHASE_END_TO_END, phases.start)  # the last frame was sent
            return
        watch.complete = True
        logger.info(
            "response request_id=%s kind=%s status=200 latency_ms=%.1f",
            request_id, kind, (time.perf_counter() - start) * 1000,
        )
        await send_json(send, 200, result, ((b"x-request-id", rid),))
        phases.observe(metric_names.PHASE_END_TO_END, phases.start)


async def models(scope: Scope, receive: Receive, send: Send) -> None:
    try:
        if scope["method"] != "GET":
            raise RequestError("Method not allowed; use GET.", status=405)
        snapshot = await current_snapshot()
        _check_key(scope, snapshot)
    except MotorError as exc:
        await send_error(send, exc)
        return
    now = int(time.time())
    data: list[dict[str, Any]] = [
        {
            "id": m.name,
            "object": "model",
            "created": now,
            "owned_by": "motorsite",
            # vLLM puts the model's path here; the path is the operator's business, not the client's.
            "root": m.name,
            # A LoRA adapter's card names its base model as vLLM's does, and no max_model_len.
            "parent": m.base or None,
            "max_model_len": None if m.base else m.max_model_len,
            "permission": [],
        }
        for m in snapshot.models.values()
        if m.serves_requests
    ]
    await send_json(send, 200, {"object": "list", "data": data})


ROUTES: dict[str, Endpoint] = {
    "/v1/models": models,
    "/v1/chat/completions": serve("chat"),
    "/v1/completions": serve("completions"),
    "/v1/responses": serve("responses"),
    "/v1/messages": serve("messages"),
}


# The method each route takes: the front door (motorsite/front_door.py) answers an unknown path or
# method from the head, in the order the endpoints do (route, method, key), before any body is read.
METHODS: dict[str, str] = {path: "GET" if path == "/v1/models" else "POST" for path in ROUTES}


async def application(scope: Scope, receive: Receive, send: Send) -> None:
    """The /v1 ASGI app (HTTP only; ``motorsite/asgi.py`` mounts it)."""
    endpoint = ROUTES.get(scope["path"])
    if endpoint is None:
        # Unknown paths under /v1 get an OpenAI error body, not Django's HTML 404 page.
        await send_error(send, NotFound(f"Not found: {scope['method']} {scope['path']}"))
        return
    await endpoint(scope, receive, send)
