"""Unit tests of the error tree and its OpenAI error bodies (serving.pipeline.errors)."""

from __future__ import annotations

import pytest

from serving.pipeline.errors import (
    DerenderError,
    EngineBusy,
    EngineError,
    EngineLacksCapability,
    ModelNotFound,
    MotorError,
    NoCapacity,
    RenderUnavailable,
    RequestError,
    Unauthorized,
    UpstreamRequestError,
    error_body,
)


def _shape_ok(body: dict) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("exc", "status", "type_", "param"),
    [
        (RequestError("bad", param="messages"), 400, "BadRequestError", "messages"),
        (RequestError("Method not allowed", status=405), 405, "BadRequestError", None),
        (Unauthorized("no key"), 401, "AuthenticationError", None),
        (ModelNotFound("nope"), 404, "NotFoundError", "model"),
        (RenderUnavailable("render down"), 503, "ServiceUnavailableError", None),
        (EngineError("e1 died", instance="e1"), 502, "BadGatewayError", None),
        (EngineBusy("e1 busy", instance="e1"), 503, "ServiceUnavailableError", None),
        (DerenderError("derender failed"), 502, "BadGatewayError", None),
        (DerenderError("derender timed out", status=504), 504, "BadGatewayError", None),
        (NoCapacity("no engine"), 503, "ServiceUnavailableError", None),
        (MotorError("bug"), 500, "InternalServerError", None),
    ],
)
def test_error_body_for_every_class(
    exc: MotorError, status: int, type_: str, param: str | None
) -> None:
    got_status, body = error_body(exc)
    _shape_ok(body)
    assert got_status == status
    # Failures of engines, render and derender say their public text; the rest their message.
    message = exc.public if exc.public is not None else exc.message
    assert body["error"] == {"message": message, "type": type_, "param": param, "code": status}


def test_status_override_does_not_leak_into_the_class() -> None:
    DerenderError("slow", status=504)
    assert DerenderError("fast").status == 502
    assert DerenderError.status == 502


def test_model_not_found_names_the_model() -> None:
    assert "`gpt-x`" in ModelNotFound("gpt-x").message


def test_engine_busy_is_an_engine_error_and_keeps_the_instance() -> None:
    exc = EngineBusy("busy", instance="e2")
    assert isinstance(exc, EngineError)
    assert exc.instance == "e2"


def test_upstream_request_error_passes_a_vllm_body_through_unchanged() -> None:
    vllm = {
        "error": {
            "message": "This model's maximum context length is 2048 tokens.",
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
    }
    exc = UpstreamRequestError(400, vllm, source="render")
    status, body = error_body(exc)
    assert status == 400
    assert body == vllm
    assert exc.message == vllm["error"]["message"]
    assert exc.param == "input_tokens"
    assert exc.type == "BadRequestError"
    assert exc.source == "render"


@pytest.mark.parametrize("status", [404, 422])
def test_upstream_request_error_keeps_status_and_vllm_type(status: int) -> None:
    vllm = {"error": {"message": "m", "type": "UnprocessableEntityError", "param": "image_url", "code": status}}
    got_status, body = error_body(UpstreamRequestError(status, vllm, source="engine"))
    assert got_status == status and body == vllm


@pytest.mark.parametrize("raw", [{"error": "Unauthorized"}, {"detail": "Not Found"}])
def test_upstream_request_error_wraps_non_vllm_bodies_in_the_openai_shape(raw: dict) -> None:
    status, body = error_body(UpstreamRequestError(401, raw, source="engine"))
    _shape_ok(body)
    assert status == 401
    assert body["error"]["code"] == 401
    assert body["error"]["type"] == "BadRequestError"
    assert str(raw) == body["error"]["message"]


def test_unknown_exceptions_become_a_plain_500_without_internals() -> None:
    status, body = error_body(KeyError("secret internal detail"))
    _shape_ok(body)
    assert status == 500
    assert body["error"]["type"] == "InternalServerError"
    assert body["error"]["code"] == 500
    assert "secret" not in body["error"]["message"]


@pytest.mark.parametrize(
    "exc",
    [
        EngineError("e1 unreachable: ConnectError('[Errno 111] 10.0.0.7:8201')", instance="e1"),
        EngineBusy("e1 is busy", instance="e1"),
        EngineLacksCapability("e1 has no native OpenAI API (404)", instance="e1"),
        DerenderError("derender timed out: ReadTimeout('http://10.0.0.9:8100')", status=504),
        RenderUnavailable("render unreachable: ConnectError('10.0.0.9:8100')", reason="unreachable"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_engine_render_and_derender_failures_reach_the_client_without_names_or_addresses(exc: MotorError) -> None:
    status, body = error_body(exc)
    _shape_ok(body)
    assert status == exc.status and body["error"]["type"] == exc.type
    assert body["error"]["message"] == exc.public
    for internal in ("e1", "10.0.0", ":8", "Error("):
        assert internal not in body["error"]["message"]
    assert "e1" in exc.message or "10.0.0" in exc.message  # the log keeps the whole story
