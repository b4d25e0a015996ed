"""The answers the front door sends instead of reading a body, each in its route's own error shape.

Kept apart from ``motorsite.front_door`` and free of Django's models: uvicorn imports its
protocol class (``motorsite.uvicorn_protocol``, whose header deadline answers a 408 here) before
the application, so before Django is set up.

The shape follows the route: ``/v1`` an OpenAI error, except ``/v1/messages``, whose every error
is Anthropic's (``{"type": "error", "error": {"type", "message"}}``, the type by status as vLLM
0.33's Messages router gives it), so the ``anthropic`` client raises its own exception class;
``/api`` ninja's ``{"detail": ...}``; the metaserver ``serving.views_internal``'s; anything else
plain text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import unquote

import orjson

from serving.edge.asgi import Send
from serving.pipeline.apis.messages import anthropic_error
from serving.pipeline.errors import MotorError, NotFound, RequestError, Unauthorized, error_body
from serving.pipeline.topologies.metaserver import CALLBACK_PATH

TOO_LARGE = "The request body is too large."
HEADERS_TIMED_OUT = "The request headers did not arrive in time."
MESSAGES_PATH = "/v1/messages"  # the Anthropic API: Anthropic's error shape


class Route(enum.Enum):
    V1 = "v1"  # the OpenAI API (serving.edge): client keys
    API = "api"  # the REST API (motorsite.api): admin keys
    METASERVER = "metaserver"  # Trigger callbacks (serving.views_internal): the route's MAC
    SITE = "site"  # the admin and the rest of Django: no key before login


def route_of(path: str) -> Route:
    if path == "/v1" or path.startswith("/v1/"):
        return Route.V1
    if path == "/api" or path.startswith("/api/"):
        return Route.API
    if path.startswith(CALLBACK_PATH):
        return Route.METASERVER
    return Route.SITE


@dataclass(frozen=True, slots=True)
class Refusal:
    """An answer sent instead of reading the body; the connection closes after it."""

    status: int
    body: bytes
    content_type: bytes = b"application/json"

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return [
            (b"content-type", self.content_type),
            (b"content-length", str(len(self.body)).encode()),
            # The unread body would otherwise be parsed as the next request: the connection ends.
            (b"connection", b"close"),
            (b"x-content-type-options", b"nosniff"),
        ]

    def http11(self) -> bytes:
        """The whole response as bytes on the wire (for Twisted and a timed-out head, which
        have no ASGI send)."""
        reason = HTTPStatus(self.status).phrase.encode()
        lines = [b"HTTP/1.1 %d %s" % (self.status, reason)] + [name + b": " + value for name, value in self.headers]
        return b"\r\n".join(lines) + b"\r\n\r\n" + self.body

    async def send(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


def v1_error(path: str, exc: MotorError) -> Refusal:
    """``exc`` as the edge answers it on ``path``: OpenAI's shape, Anthropic's on /v1/messages."""
    code, payload = error_body(exc)
    if path == MESSAGES_PATH:
        payload = anthropic_error(code, payload)
    return Refusal(code, orjson.dumps(payload))


def refusal(route: Route, status: int, message: str, path: str = "") -> Refusal:
    """An answer in the shape the route's own errors have (``path`` picks Anthropic's on /v1)."""
    if route is Route.V1:
        exc: MotorError
        if status == 401:
            exc = Unauthorized(message)
        elif status == 404:
            exc = NotFound(message)
        else:
            exc = RequestError(message, status=status)
        return v1_error(path, exc)
    if route is Route.API:
        return Refusal(status, orjson.dumps({"detail": message}))
    if route is Route.METASERVER:  # serving.views_internal's shape
        error = {"message": message, "type": "MetaserverError", "param": None, "code": status}
        return Refusal(status, orjson.dumps({"error": error}))
    return Refusal(status, message.encode() + b"\n", b"text/plain; charset=utf-8")


def too_large(route: Route, path: str = "") -> Refusal:
    return refusal(route, 413, TOO_LARGE, path)


def path_of(target: bytes) -> str:
    """The path of a request line's target as the servers put it in the scope (undecodable:
    the server answers 400 itself)."""
    raw = target.split(b"?", 1)[0]
    try:
        return unquote(raw.decode("ascii"))
    except UnicodeDecodeError:
        return "/"


def headers_timed_out(target: bytes | None) -> bytes:
    """The 408 for a client cut in the middle of its headers: in its route's shape when its
    request line is complete (``target``, as it came), else empty."""
    if not target:
        return b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    path = path_of(target)
    return refusal(route_of(path), 408, HEADERS_TIMED_OUT, path).http11()
