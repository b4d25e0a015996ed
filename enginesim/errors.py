"""Errors the simulator answers with, in vLLM's ``ErrorResponse`` shape.

``SimError`` is the one exception type handlers raise; :func:`from_validation_error`
builds it from a pydantic failure the way vLLM's request-validation handler does
(status 400, type ``"Bad Request"``, a cleaned ``param``).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from enginesim.protocol import ErrorInfo, ErrorResponse, ParameterError

# vLLM's error ``type`` per status for errors the engine raises itself; other statuses use
# the HTTP phrase, like vLLM's HTTPException handler.
_ENGINE_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
_MAX_REPORTED_ERRORS = 10


class SimError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self, message: str, *, status: int = 400, type: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or _ENGINE_TYPES.get(status) or HTTPStatus(status).phrase
        self.param = param

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)

    def sse_json(self) -> str:
        return self.body().model_dump_json()


def bad_request(message: str, param: str | None = None) -> SimError:
    """A ``BadRequestError`` (vLLM's handler-built or VLLMValidationError errors)."""
    return SimError(message, status=400, param=param)


def schema_error(message: str, param: str | None = None) -> SimError:
    """A ``Bad Request`` error (vLLM's pydantic/FastAPI request-validation handler)."""
    return SimError(message, status=400, type=HTTPStatus.BAD_REQUEST.phrase, param=param)


def _summarize(value: Any) -> Any:
    if isinstance(value, (list, tuple, dict, set)):
        return f"<{type(value).__name__} of {len(value)} items>"
    return value


def from_validation_error(exc: ValidationError, prefix: str = "body") -> SimError:
    """The 400 that vLLM's validation handler gives for the same pydantic failure."""
    errors = exc.errors(include_url=False)
    param: str | None = None
    for error in errors:
        ctx_error = (error.get("ctx") or {}).get("error")
        if isinstance(ctx_error, ParameterError):
            param = ctx_error.parameter
            break
    entries: list[str] = []
    for error in errors[:_MAX_REPORTED_ERRORS]:
        loc = ".".join(str(p) for p in (prefix, *error["loc"]))
        if param is None:
            param = loc
        entry = {"type": error["type"], "loc": loc, "msg": error["msg"]}
        if "input" in error:
            entry["input"] = _summarize(error["input"])
        entries.append(f"  {entry}\n")
    count = len(errors)
    label = "error" if count == 1 else "errors"
    message = f"{count} validation {label}:\n" + "".join(entries)
    if count > len(entries):
        message += f"  ...and {count - len(entries)} more {label}\n"
    return schema_error(message.rstrip(), param)


def json_body_error(exc: json.JSONDecodeError) -> SimError:
    entry = {"type": "json_invalid", "loc": f"body.{exc.pos}", "msg": "JSON decode error"}
    return schema_error(f"1 validation error:\n  {entry}", "body")
