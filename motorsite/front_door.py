"""The front door: a request's key and declared size are checked before a byte of its body is read.

Without it, a client with no key could make this process take in any body: Daphne's Twisted
request reads the whole body (to a temporary file past 100 kB) before the application starts,
and Django's handler spools it before the view, under any server. Here each request that carries
a body (a Content-Length above zero, or chunked) is judged from its head alone:

    /v1/...                        a route and method of the edge (404, 405), then a client key
                                   (``serving.edge.keys``: Bearer, else ``x-api-key``; from the
                                   fleet snapshot), body up to
                                   ``MOTOR_MAX_BODY_BYTES``
    /api/...                       an admin key (the snapshot's ``admin_keys``): 401, a client
                                   key 403, body up to ``MOTOR_CONTROL_MAX_BODY_BYTES``
    /internal/metaserver/<token>   the route MAC and registration (``MetaServer.check``), 404/409;
                                   body up to the control cap
    anything else (/admin, ...)    no key exists before login: body up to the control cap

A refusal is an answer with ``Connection: close`` in its route's error shape
(``motorsite.refusals``: Anthropic's on ``/v1/messages``): the body is never read, and the
connection ends with it. A body without a declared length is counted as it arrives and refused (413) as
soon as it passes its cap. A request without a body passes untouched (its route's own
authentication answers it; nothing here costs it anything).

``check_head`` is pure apart from the metaserver's registry lookup; two places call it:
``FrontDoor`` (ASGI, in front of every application: uvicorn calls the application once the
headers are complete and pauses reading at 64 KiB until ``receive()``), and, under Daphne,
``motorsite.daphne_requests``, whose Twisted hook runs when the headers are complete.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from motorsite.refusals import Refusal, Route, refusal, route_of, too_large, v1_error
from serving.edge.asgi import ASGIApp, Message, Receive, Scope, Send
from serving.edge.keys import INVALID_KEY, chosen_key, is_client_key
from serving.edge.openai_api import METHODS
from serving.pipeline.errors import MotorError
from serving.pipeline.snapshot import FleetSnapshot
from serving.pipeline.topologies.metaserver import (
    CALLBACK_PATH,
    FORWARDED_HEADER,
    CallbackElsewhere,
    CallbackRefused,
    process_metaserver,
)
from serving.snapshots import current_snapshot

logger = logging.getLogger(__name__)

_FORWARDED = FORWARDED_HEADER.lower().encode()


@dataclass(frozen=True, slots=True)
class Limits:
    v1_max_body: int
    control_max_body: int
    env_keys: tuple[str, ...] = ()
    open_access: bool = False

    @classmethod
    def from_settings(cls) -> Limits:
        return cls(
            v1_max_body=settings.DATA_UPLOAD_MAX_MEMORY_SIZE,
            control_max_body=settings.MOTOR_CONTROL_MAX_BODY_BYTES,
            env_keys=tuple(settings.MOTOR_API_KEYS),
            open_access=settings.MOTOR_OPEN_ACCESS,
        )

    def cap(self, route: Route) -> int:
        return self.v1_max_body if route is Route.V1 else self.control_max_body


@dataclass(slots=True)  # not frozen: built on every request with a body, and frozen costs a microsecond
class Head:
    """What the front door reads of a request: its route and the headers that decide it."""

    route: Route
    method: str
    path: str
    has_body: bool
    declared: int | None  # Content-Length; None when the body must be counted (chunked)
    bearer: bytes  # the token of ``Authorization: Bearer <token>``, or b""
    client_key: bytes  # the key /v1 reads: that token, else ``x-api-key`` (``keys.chosen_key``)
    forwarded: bool  # a metaserver callback another replica forwarded

    @classmethod
    def parse(cls, method: str, path: str, headers: Iterable[tuple[bytes, bytes]]) -> Head:
        """``headers`` as ASGI gives them: names in lower case."""
        declared: int | None = None
        lengths = 0
        chunked = False
        authorization: bytes | None = None
        api_key: bytes | None = None
        forwarded = False
        for name, value in headers:
            if name == b"content-length":
                value = value.strip()
                length = int(value) if value.isdigit() else -1  # unparseable: the server refuses it
                declared = length if declared is None else max(declared, length)
                lengths += 1
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"authorization":
                if authorization is None:  # the first, as the edge reads it (serving.edge.asgi.header)
                    authorization = value
            elif name == b"x-api-key":
                if api_key is None:
                    api_key = value
            elif name == _FORWARDED:
                forwarded = value == b"1"
        has_body = chunked or bool(declared)
        # Both servers refuse two lengths, or a length beside chunked; if one ever took such a
        # request, its body is counted as it arrives rather than trusted.
        if chunked or lengths > 1 or declared == -1:
            declared = None
        bearer = b""
        if authorization is not None and authorization[:7].lower() == b"bearer ":
            bearer = authorization[7:].strip()
        client_key = chosen_key(authorization, api_key)
        return cls(route_of(path), method, path, has_body, declared, bearer, client_key, forwarded)

    @property
    def needs_snapshot(self) -> bool:
        return self.has_body and self.route in (Route.V1, Route.API)


_limits: Limits | None = None


def current_limits() -> Limits:
    """The limits in the settings, read once (again after a test changes a setting)."""
    global _limits
    if _limits is None:
        _limits = Limits.from_settings()
    return _limits


@receiver(setting_changed)
def _settings_changed(**kwargs: object) -> None:
    global _limits
    _limits = None


def unavailable(head: Head, exc: MotorError) -> Refusal:
    """No snapshot to check a key against (the database is down and never answered): 503."""
    if head.route is Route.V1:
        return v1_error(head.path, exc)
    return refusal(head.route, 503, "The control data is unavailable; try again later.")


def check_head(head: Head, snapshot: FleetSnapshot | None, limits: Limits) -> Refusal | None:
    """The answer to send instead of reading the body, or None to read it (under its cap).

    ``snapshot`` is needed when ``head.needs_snapshot`` (a key to check); the key comes before
    the size, so a client without one learns nothing about the caps.
    """
    if not head.has_body:
        return None
    route = head.route
    if route is Route.V1:
        # The edge's own order: the path, the method, then the key (serving.edge.openai_api).
        method = METHODS.get(head.path)
        if method is None:
            return refusal(route, 404, f"Not found: {head.method} {head.path}")
        if head.method != method:
            return refusal(route, 405, f"Method not allowed; use {method}.", head.path)
        if not limits.open_access and (snapshot is None or not is_client_key(head.client_key, snapshot, env_keys=limits.env_keys)):
            return refusal(route, 401, INVALID_KEY, head.path)
    elif route is Route.API:
        digest = _sha256(head.bearer)
        if snapshot is None or digest not in snapshot.admin_keys:
            if snapshot is not None and digest in snapshot.client_keys:
                # motorsite.api's own answer to a client key, given before the body instead of after.
                return refusal(route, 403, "This key is a client key (for /v1); the REST API needs an admin-scope key.")
            return refusal(route, 401, "Unauthorized")
    elif route is Route.METASERVER:
        token = head.path[len(CALLBACK_PATH):]
        try:
            process_metaserver().check(token, forwarded=head.forwarded)
        except CallbackElsewhere:
            pass  # signed by a replica: the view forwards it (with its body) to the owner
        except CallbackRefused as exc:
            return refusal(route, exc.status, exc.message)
        except (TypeError, ValueError):  # a token no replica could have signed (not ASCII, ...)
            return refusal(route, 404, "unknown or expired callback token")
    if head.declared is not None and head.declared > limits.cap(route):
        return too_large(route, head.path)
    return None


def _sha256(token: bytes) -> str:
    return hashlib.sha256(token).hexdigest() if token and token.isascii() else ""


def log_refusal(head: Head, answer: Refusal, server: str) -> None:
    logger.info("front door refused status=%d route=%s path=%r server=%s", answer.status, head.route.value, head.path[:200], server)


class FrontDoor:
    """ASGI: ``check_head`` before the application reads a body, and a cap on what it reads.

    Under uvicorn this is the front door itself (the application is called once the headers are
    complete). Under Daphne the Twisted hook has already judged the head and counted the body
    (``motorsite.daphne_requests``); the checks here then pass and cost a few microseconds.
    """

    def __init__(self, app: ASGIApp, limits: Limits | None = None) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = Head.parse(scope["method"], scope["path"], scope["headers"])
        if not head.has_body:
            await self.app(scope, receive, send)
            return
        limits = self.limits or current_limits()
        snapshot = None
        answer: Refusal | None
        try:
            if head.needs_snapshot:
                snapshot = await current_snapshot()
            answer = check_head(head, snapshot, limits)
        except MotorError as exc:
            answer = unavailable(head, exc)
        if answer is not None:
            log_refusal(head, answer, "asgi")
            await answer.send(send)
            return
        if head.declared is not None:
            # The server delivers no more than the declared length: nothing to count.
            await self.app(scope, receive, send)
            return
        await self.app(scope, _counted(receive, send, limits.cap(head.route), head), send)


def _counted(receive: Receive, send: Send, cap: int, head: Head) -> Receive:
    """``receive`` that answers 413 itself once the body passes ``cap``, and then tells the
    application the client left (Django's handler and the edge then return without answering)."""
    size = 0
    refused = False

    async def counted_receive() -> Message:
        nonlocal size, refused
        if refused:
            return {"type": "http.disconnect"}
        message = await receive()
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if size > cap:
                refused = True
                answer = too_large(head.route, head.path)
                log_refusal(head, answer, "asgi")
                await answer.send(send)
                return {"type": "http.disconnect"}
        return message

    return counted_receive
