"""The data plane's one error tree, and its mapping to OpenAI error bodies.

MotorError                      carries status, OpenAI ``type`` and ``param``
 +-- RequestError               the client's fault (400/401/404/413/422); never retried
 |    +-- NotFound              404: unknown path
 |         +-- ModelNotFound    404 before any render call
 +-- UpstreamRequestError       render/engine/derender rejected the request itself (4xx):
 |                              its body goes back to the client unchanged
 +-- RenderUnavailable          render unreachable / timed out / lacking the capability / no usable
 |                              token ids (``reason``): the tokenization service falls back locally
 +-- EngineError                an engine failed: retryable, counts against that instance
 |    +-- EngineBusy            the engine's own admission 503: try elsewhere, breaker untouched
 |    +-- EngineLacksCapability route 404 / 501 / 403 "scale-out disabled" on generate: the engine
 |                              cannot do token-only at all; the native path may serve it instead
 +-- DerenderError              derender failed after inference: 502/504, never re-runs inference
 +-- NoCapacity                 no instance can take the request (503)
 +-- ControlDataUnavailable     no snapshot of the fleet yet and the database failed (503)
 |    +-- TriggerMultiPromptStream  placed on Trigger with several prompts, streaming: native path
 +-- RateLimited                429 with ``Retry-After``
 |    +-- QueueFull             admission queue full
 |    +-- TokenRateLimited      a key's tokens per minute (flow_control/rate_limit.py)
 +-- AdmissionTimeout           waited past the admission deadline: 503
      +-- AdmissionUnavailable  admission cannot decide now (shared state unreachable) or would
                                wait on the request's own leases: 503 with ``Retry-After``

Fault domains stay apart (architecture invariant 4), so each layer raises only its own kind.

Messages of engine, render and derender failures name instances, addresses and exception reprs:
they are for the log. Those classes carry a ``public`` text, which is what the client's error
body (``body()``, ``error_body``, error frames) says instead.
"""

from __future__ import annotations

from typing import Any


class MotorError(Exception):
    status: int = 500
    type: str = "InternalServerError"
    # What the client reads when ``message`` names internals; None: the message is fit for the client.
    public: str | None = None

    def __init__(self, message: str, *, param: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status

    def body(self) -> dict[str, Any]:
        message = self.public or self.message
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.status}}


class RequestError(MotorError):
    status = 400
    type = "BadRequestError"


class Unauthorized(RequestError):
    status = 401
    type = "AuthenticationError"


class NotFound(RequestError):
    status = 404
    type = "NotFoundError"


class ModelNotFound(NotFound):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")


class ModelDraining(MotorError):
    """The operator is draining the model: it takes no new requests (those admitted finish)."""

    status = 503
    type = "ServiceUnavailableError"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` is draining and takes no new requests.", param="model")


class UpstreamRequestError(MotorError):
    """A 4xx from render, an engine or derender about the request: passed through verbatim."""

    def __init__(self, status: int, body: dict[str, Any], *, source: str) -> None:
        raw = body.get("error")
        err: dict[str, Any] = raw if isinstance(raw, dict) else {}
        super().__init__(str(err.get("message") or body), param=err.get("param"), status=status)
        self.type = str(err.get("type") or "BadRequestError")
        self.source = source
        self._body = body

    def body(self) -> dict[str, Any]:
        if isinstance(self._body.get("error"), dict):
            return self._body
        return super().body()


class RenderUnavailable(MotorError):
    status = 503
    type = "ServiceUnavailableError"
    public = "The tokenization service is unavailable; retry later."

    # Why render could not be used; also the ``fallback_reason`` of the local tokenizer.
    REASONS = ("unreachable", "timeout", "capability", "no_token_ids", "malformed", "status", "render_down")

    def __init__(self, message: str, *, reason: str = "status", retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s  # error_headers: Retry-After


class EngineError(MotorError):
    status = 502
    type = "BadGatewayError"
    public = "An engine failed while serving this request."

    def __init__(self, message: str, *, instance: str, status: int | None = None) -> None:
        super().__init__(message, status=status)
        self.instance = instance


class EngineBusy(EngineError):
    status = 503
    type = "ServiceUnavailableError"
    public = "The engines for this model are busy; retry later."


class EngineLacksCapability(EngineError):
    """The engine has no token-only generate (route 404, 501, 403 "scale-out disabled")."""


class DerenderError(MotorError):
    status = 502
    type = "BadGatewayError"
    public = "Turning the generated tokens into a response failed."


class NoCapacity(MotorError):
    status = 503
    type = "ServiceUnavailableError"


class TriggerMultiPromptStream(NoCapacity):
    """A multi-prompt streaming request was placed on Trigger: the RFC serves it natively (the
    pipeline runs it on Trigger per prompt instead where the fleet has no native path)."""


class ControlDataUnavailable(MotorError):
    """The process has no snapshot yet and could not read one (the host's ``serving.snapshots``)."""

    status = 503
    type = "ServiceUnavailableError"
    public = "The coordinator cannot read its configuration right now; try again shortly."


class RateLimited(MotorError):
    """A 429 with ``Retry-After`` (``error_headers``): the one shape every rate limit answers with."""

    status = 429
    type = "RateLimitError"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(RateLimited):
    """The admission queue is full."""


class AdmissionTimeout(MotorError):
    status = 503
    type = "ServiceUnavailableError"


class AdmissionUnavailable(AdmissionTimeout):
    """503 with ``Retry-After``: Redis is unreachable, or a request would wait on its own leases."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def error_headers(exc: BaseException) -> dict[str, str]:
    """Extra response headers an error asks for (``Retry-After`` on 429)."""
    retry_after = getattr(exc, "retry_after_s", None)
    return {"Retry-After": str(retry_after)} if retry_after is not None else {}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Map any exception to ``(status, OpenAI error body)``; unknown ones become a plain 500."""
    if isinstance(exc, MotorError):
        return exc.status, exc.body()
    return 500, MotorError("Internal server error").body()
