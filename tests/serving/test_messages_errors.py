"""Every refusal on ``/v1/messages``, at every layer, in Anthropic's error shape, read by the
official ``anthropic`` client through a real server (Daphne and uvicorn on a 127.0.0.1 socket).

The front door before the body (a wrong key, in ``Authorization: Bearer`` or in the client's
default ``x-api-key``; a wrong method), the edge (an unknown model), the pipeline (render's
verdicts, the admission queue, the engines): each answer is ``{"type": "error", "error":
{"type", "message"}}`` with the status kept and the type vLLM 0.33's Messages router gives that
status, and the client raises the exception class of that status. What the front door refuses
before reading a byte of a large body (401, 413, the header deadline's 408) is measured on a
server process of its own in tests/motorsite/test_front_door.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import pytest

from catalog.models import RenderConfig, ServedModel
from fleet.models import EngineInstance
from serving import runtime, snapshots
from serving.pipeline.errors import AdmissionUnavailable, QueueFull
from tests.serving.fakes import ENGINE_URLS, MODEL, FakeUpstreams, error_json
from tests.serving.loopback import LoopbackClient
from tests.serving.router_fakes import model_dir, respond

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "sk-messages-errors-" + "0123456789abcdef"
MESSAGE = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi"}]}


@pytest.fixture
def fleet(
    transactional_db: None, upstreams: FakeUpstreams, mock_client: LoopbackClient, monkeypatch: pytest.MonkeyPatch,
    settings: Any,
) -> Iterator[FakeUpstreams]:
    """The fakes' render sidecar and two engines, /v1 closed but to ``KEY``."""
    settings.MOTOR_OPEN_ACCESS = False
    settings.MOTOR_API_KEYS = [KEY]
    model = ServedModel.objects.create(name=MODEL, model_path=model_dir(), max_model_len=2048, vocab_size=151936)
    RenderConfig.objects.create(host="render.test", port=8100, timeout_ms=5000)
    for name, url in ENGINE_URLS.items():
        EngineInstance.objects.create(name=name, url=url, served_model=model)
    monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: mock_client)
    snapshots.invalidate()
    yield upstreams
    snapshots.invalidate()
    assert runtime.load.snapshot() == {} and runtime.inflight_tokens() == {}


def _raise(exc: Exception) -> Callable[..., Any]:
    async def acquire(*_: Any, **__: Any) -> Any:
        raise exc

    return acquire


Fault = Callable[[FakeUpstreams, pytest.MonkeyPatch], None]


def nothing(upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch) -> None:
    pass


def render_refuses(status: int) -> Fault:
    def fault(upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch) -> None:
        upstreams.override("render", "render", respond(status, error_json(status, "render said no")))

    return fault


def admission_raises(exc: Exception) -> Fault:
    def fault(upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(runtime.admission, "acquire", _raise(exc))

    return fault


def engines_fail(status: int) -> Fault:
    def fault(upstreams: FakeUpstreams, monkeypatch: pytest.MonkeyPatch) -> None:
        for host in ENGINE_URLS:
            upstreams.override(host, "generate", respond(status, error_json(status, "engine trouble", "InternalServerError")))

    return fault


# (id, the client's credentials, what goes wrong, the body's changes, status, the client's class, error.type)
CASES: list[tuple[str, dict[str, Any], Fault, dict[str, Any], int, type[anthropic.APIStatusError], str]] = [
    ("front-door-wrong-x-api-key", {"api_key": "sk-wrong-key-000000000000"}, nothing, {}, 401,
     anthropic.AuthenticationError, "authentication_error"),
    ("front-door-wrong-bearer", {"auth_token": "sk-wrong-key-000000000000"}, nothing, {}, 401,
     anthropic.AuthenticationError, "authentication_error"),
    ("edge-unknown-model", {"api_key": KEY}, nothing, {"model": "nope"}, 404, anthropic.NotFoundError,
     "not_found_error"),
    ("render-400", {"api_key": KEY}, render_refuses(400), {}, 400, anthropic.BadRequestError, "invalid_request_error"),
    ("render-413", {"api_key": KEY}, render_refuses(413), {}, 413, anthropic.ContentTooLargeError, "request_too_large"),
    ("admission-429", {"api_key": KEY}, admission_raises(QueueFull("queue full", retry_after_s=2)), {}, 429,
     anthropic.RateLimitError, "rate_limit_error"),
    ("admission-503", {"api_key": KEY}, admission_raises(AdmissionUnavailable("redis away", retry_after_s=3)), {},
     503, anthropic.ServiceUnavailableError, "overloaded_error"),
    ("engines-5xx", {"auth_token": KEY}, engines_fail(500), {}, 502, anthropic.InternalServerError, "api_error"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("name", "credentials", "fault", "changes", "status", "raised", "kind"), CASES,
                         ids=[c[0] for c in CASES])
async def test_every_refusal_is_anthropics_error_and_the_client_raises_its_class(
    served: str, fleet: FakeUpstreams, monkeypatch: pytest.MonkeyPatch, stream: bool, name: str,
    credentials: dict[str, Any], fault: Fault, changes: dict[str, Any], status: int,
    raised: type[anthropic.APIStatusError], kind: str,
) -> None:
    fault(fleet, monkeypatch)
    async with anthropic.AsyncAnthropic(base_url=served, max_retries=0, timeout=30.0, **credentials) as client:
        with pytest.raises(anthropic.APIStatusError) as caught:
            if stream:
                async with client.messages.stream(**{**MESSAGE, **changes}) as events:
                    async for _ in events:
                        pass
            else:
                await client.messages.create(**{**MESSAGE, **changes})
    error = caught.value
    assert type(error) is raised and error.status_code == status, (type(error), error)
    assert error.response.headers["content-type"] == "application/json"
    assert error.body == {"type": "error", "error": {"type": kind, "message": error.body["error"]["message"]}}  # type: ignore[index]
    assert error.body["error"]["message"]  # type: ignore[index]
    if status in (429, 503):
        assert error.response.headers["retry-after"] in ("2", "3")
    assert fleet.calls_of("generate") == [] or name == "engines-5xx"


async def test_a_wrong_method_is_anthropics_405(served: str, fleet: FakeUpstreams) -> None:
    """With a body the front door answers it before reading the body; without one, the edge."""
    async with anthropic.AsyncAnthropic(base_url=served, api_key=KEY, max_retries=0, timeout=30.0) as client:
        for call in (client.put("/v1/messages", body=MESSAGE, cast_to=object),
                     client.get("/v1/messages", cast_to=object)):
            with pytest.raises(anthropic.APIStatusError) as caught:
                await call
            assert type(caught.value) is anthropic.APIStatusError and caught.value.status_code == 405
            assert caught.value.body["type"] == "error"  # type: ignore[index]
            assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert fleet.calls == []


async def test_the_clients_default_x_api_key_is_served(served: str, fleet: FakeUpstreams) -> None:
    """``anthropic.Anthropic(api_key=...)``, its default: the key in ``x-api-key``, no Bearer."""
    async with anthropic.AsyncAnthropic(base_url=served, api_key=KEY, max_retries=0, timeout=30.0) as client:
        message = await client.messages.create(**MESSAGE)
        async with client.messages.stream(**MESSAGE) as events:
            streamed = await events.get_final_message()
    assert message.type == "message" and message.stop_reason == "end_turn"
    assert [b.model_dump(include={"type", "text"}) for b in streamed.content] == [
        b.model_dump(include={"type", "text"}) for b in message.content]
    assert streamed.usage == message.usage
    assert [c.path for c in fleet.calls_of("render")] == ["/v1/messages/render"] * 2
