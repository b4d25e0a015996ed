"""The /v1 endpoints through the whole ASGI application (``v1`` fixture: the edge in front of
Django), with the fleet in the database and the upstreams faked behind
``serving.pipeline.http.shared_client`` (tests/serving/fakes.py)."""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest

from serving import runtime, snapshots
from tests.serving.conftest import create_db_fleet
from tests.serving.fakes import (
    CHAT_PROMPT,
    MODEL,
    FakeUpstreams,
    error_json,
    output_ids,
    parse_frames,
    text_of,
)
from tests.serving.loopback import LoopbackClient

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def fresh_snapshot(settings: Any) -> Iterator[None]:
    settings.MOTOR_API_KEYS = []  # whatever the environment says
    settings.MOTOR_OPEN_ACCESS = True  # open unless a test closes it
    snapshots.invalidate()
    yield
    snapshots.invalidate()
    assert runtime.load.snapshot() == {}  # no request left load behind
    assert runtime.inflight_tokens() == {}  # nor admission tokens


@pytest.fixture
def fleet(transactional_db: None) -> None:
    create_db_fleet()


@pytest.fixture
def upstream(
    fleet: None, upstreams: FakeUpstreams, mock_client: LoopbackClient, monkeypatch: pytest.MonkeyPatch,
) -> FakeUpstreams:
    monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: mock_client)
    return upstreams


def assert_openai_error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status
    assert response.headers["Content-Type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], **extra}


async def post(client: httpx.AsyncClient, path: str, data: Any, **kwargs: Any) -> Any:
    if isinstance(data, str):  # raw text, as a client could send it
        headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
        return await client.post(path, content=data, headers=headers, **kwargs)
    return await client.post(path, json=data, **kwargs)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_malformed_json_is_400(v1: httpx.AsyncClient, upstream: FakeUpstreams, path: str) -> None:
    error = assert_openai_error(await post(v1, path, '{"model": "tiny", '), 400)
    assert error["type"] == "BadRequestError" and "JSON" in error["message"]
    assert upstream.calls == []


@pytest.mark.parametrize("data", ["[1, 2]", '"text"', "null"])
async def test_a_body_that_is_not_an_object_is_400(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, data: str,
) -> None:
    error = assert_openai_error(await post(v1, "/v1/chat/completions", data), 400)
    assert "JSON object" in error["message"]
    assert upstream.calls == []


@pytest.mark.parametrize("model", ["gpt-4o", 42])
async def test_unknown_model_is_404_before_any_render_call(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, model: Any
) -> None:
    error = assert_openai_error(await post(v1, "/v1/chat/completions", chat(model=model)), 404)
    assert error["type"] == "NotFoundError" and error["param"] == "model"
    assert upstream.calls == []


async def test_a_missing_model_means_the_first_served_model(v1: httpx.AsyncClient, upstream: FakeUpstreams) -> None:
    body = chat()
    del body["model"]
    response = await post(v1, "/v1/chat/completions", body)
    assert response.status_code == 200
    assert upstream.calls_of("render")[0].body["model"] == MODEL


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "sk-test", "Basic sk-test", "Bearer "])
async def test_a_missing_or_invalid_key_is_401(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, settings: Any, auth: str | None
) -> None:
    settings.MOTOR_OPEN_ACCESS = False
    settings.MOTOR_API_KEYS = ["sk-test"]
    headers = {"Authorization": auth} if auth is not None else {}
    error = assert_openai_error(await post(v1, "/v1/chat/completions", chat(), headers=headers), 401)
    assert error["type"] == "AuthenticationError"
    assert_openai_error(await v1.get("/v1/models", headers=headers), 401)
    assert upstream.calls == []


async def test_a_valid_key_is_accepted(v1: httpx.AsyncClient, upstream: FakeUpstreams, settings: Any) -> None:
    settings.MOTOR_OPEN_ACCESS = False
    settings.MOTOR_API_KEYS = ["sk-other", "sk-test"]
    headers = {"Authorization": "bearer sk-test"}
    assert (await post(v1, "/v1/chat/completions", chat(), headers=headers)).status_code == 200
    assert (await v1.get("/v1/models", headers=headers)).status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_get_on_a_post_endpoint_is_405(v1: httpx.AsyncClient, upstream: FakeUpstreams, path: str) -> None:
    assert_openai_error(await v1.get(path), 405)
    assert upstream.calls == []


async def test_an_internal_bug_is_a_json_500_not_an_html_page(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(snapshot: Any, model: Any = None) -> Any:
        raise RuntimeError("secret internal state")

    monkeypatch.setattr("serving.edge.openai_api.pipeline_for", broken)
    response = await post(v1, "/v1/chat/completions", chat())
    error = assert_openai_error(response, 500)
    assert error["type"] == "InternalServerError"
    assert b"secret" not in response.content and b"<html" not in response.content.lower()


async def test_models_lists_the_served_model_without_its_path(v1: httpx.AsyncClient, upstream: FakeUpstreams) -> None:
    response = await v1.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["root"], m["max_model_len"]) for m in body["data"]] == [
        (MODEL, "model", MODEL, 2048)
    ]
    assert b"/models/tiny" not in response.content  # the operator's file layout stays private


async def test_non_streaming_chat(v1: httpx.AsyncClient, upstream: FakeUpstreams) -> None:
    response = await post(v1, "/v1/chat/completions", chat(max_completion_tokens=64))

    assert response.status_code == 200
    request_id = response.headers["X-Request-Id"]
    body = response.json()
    assert body["id"] == f"chatcmpl-{request_id}"
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == text_of(output_ids(CHAT_PROMPT, 0))
    assert body["usage"]["prompt_tokens"] == len(CHAT_PROMPT)
    assert [c.kind for c in upstream.calls] == ["render", "generate", "derender"]
    assert upstream.calls_of("render")[0].headers["x-request-id"] == request_id


async def test_non_streaming_completions(v1: httpx.AsyncClient, upstream: FakeUpstreams) -> None:
    response = await post(v1, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]})

    assert response.status_code == 200
    body = response.json()
    assert body["id"] == f"cmpl-{response.headers['X-Request-Id']}"
    assert [c["index"] for c in body["choices"]] == [0, 1]


async def test_an_upstream_400_reaches_the_client_unchanged(v1: httpx.AsyncClient, upstream: FakeUpstreams) -> None:
    vllm = error_json(400, "This model's maximum context length is 2048 tokens.", param="input_tokens")
    upstream.override("render", "render", lambda request, body: httpx.Response(400, json=vllm))

    response = await post(v1, "/v1/chat/completions", chat())

    assert response.status_code == 400 and response.json() == vllm


async def test_render_unreachable_is_503(v1: httpx.AsyncClient, upstream: FakeUpstreams) -> None:
    def refuse(request: httpx.Request, body: Any) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    upstream.override("render", "render", refuse)
    error = assert_openai_error(await post(v1, "/v1/chat/completions", chat()), 503)
    assert error["type"] == "ServiceUnavailableError"


async def test_streaming_chat_is_an_event_stream_ending_with_done(
    v1: httpx.AsyncClient, upstream: FakeUpstreams,
) -> None:
    response = await post(
        v1, "/v1/chat/completions", chat(stream=True, stream_options={"include_usage": True})
    )

    assert response.status_code == 200
    assert response.headers["Content-Type"] == "text/event-stream"
    assert response.headers["Cache-Control"] == "no-cache"
    raw = response.content
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"data: [DONE]") == 1
    frames = parse_frames(raw)
    assert all(f["id"] == f"chatcmpl-{response.headers['X-Request-Id']}" for f in frames[:-1])
    assert "".join(f["choices"][0]["delta"]["content"] or "" for f in frames[:-1] if f["choices"]) == text_of(
        output_ids(CHAT_PROMPT, 0)
    )
    assert frames[-2]["usage"]["completion_tokens"] == 3
    assert upstream.open_streams == set()


async def test_a_stream_that_cannot_start_gets_a_real_status(
    v1: httpx.AsyncClient, upstream: FakeUpstreams,
) -> None:
    for host in ("e1", "e2"):
        upstream.override(host, "generate", lambda request, body: httpx.Response(500, json=error_json(500, "x")))

    error = assert_openai_error(await post(v1, "/v1/chat/completions", chat(stream=True)), 502)
    assert error["type"] == "BadGatewayError"
