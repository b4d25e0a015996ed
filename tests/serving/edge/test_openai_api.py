"""The /v1 edge against hostile input and missing keys, through the whole ASGI application.

Upstreams are faked behind ``serving.pipeline.http.shared_client`` (tests/serving/fakes.py); every
test ends with no load, no admission tokens and no task of a request left behind.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import httpx
import pytest
from asgiref.sync import sync_to_async

from fleet import services
from fleet.models import ApiKey
from motorsite.asgi import application
from serving import runtime, snapshots
from tests.serving.fakes import ENGINE_URLS, MODEL, FakeUpstreams, error_json
from tests.serving.loopback import LoopbackClient

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3}


@pytest.fixture(autouse=True)
async def closed(settings: Any) -> AsyncIterator[None]:
    """/v1 as deployed: closed, no key from the environment, a small body cap."""
    settings.MOTOR_OPEN_ACCESS = False
    settings.MOTOR_API_KEYS = []
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4096
    settings.MOTOR_MAX_JSON_DEPTH = 16
    snapshots.invalidate()
    tasks_before = asyncio.all_tasks()
    yield
    snapshots.invalidate()
    assert runtime.load.snapshot() == {}  # no request left load behind
    assert runtime.inflight_tokens() == {}  # nor admission tokens
    assert asyncio.all_tasks() - {asyncio.current_task()} <= tasks_before  # nor a task


@pytest.fixture
def upstream(db_upstreams: FakeUpstreams) -> FakeUpstreams:
    return db_upstreams


@pytest.fixture
def open_access(settings: Any) -> None:
    settings.MOTOR_OPEN_ACCESS = True


async def client_key(**kwargs: Any) -> str:
    _, key = await sync_to_async(services.api_key_create)(name="app", scope="client", **kwargs)
    snapshots.invalidate()
    return key


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    return body["error"]


def raw_post(v1: httpx.AsyncClient, text: bytes | str, **headers: str) -> Any:
    return v1.post("/v1/chat/completions", content=text, headers={"Content-Type": "application/json", **headers})


# --------------------------------------------------------------------------- closed unless opened


async def test_it_is_closed_when_no_key_is_configured(v1: httpx.AsyncClient, upstream: FakeUpstreams) -> None:
    error = assert_openai_error(await v1.post("/v1/chat/completions", json=CHAT), 401)
    assert error["type"] == "AuthenticationError"
    assert_openai_error(await v1.get("/v1/models"), 401)
    assert upstream.calls == []


async def test_it_is_open_to_anyone_only_with_open_access(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, open_access: None
) -> None:
    assert (await v1.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert (await v1.get("/v1/models")).status_code == 200


async def test_deleting_the_last_client_key_keeps_it_closed(v1: httpx.AsyncClient, upstream: FakeUpstreams) -> None:
    key = await client_key()
    auth = {"Authorization": f"Bearer {key}"}
    assert (await v1.post("/v1/chat/completions", json=CHAT, headers=auth)).status_code == 200

    await sync_to_async(ApiKey.objects.all().delete)()
    snapshots.invalidate()
    assert_openai_error(await v1.post("/v1/chat/completions", json=CHAT, headers=auth), 401)
    assert_openai_error(await v1.post("/v1/chat/completions", json=CHAT), 401)
    assert len(upstream.calls_of("generate")) == 1


async def test_x_api_key_opens_it_as_the_anthropic_client_sends_the_key(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, settings: Any
) -> None:
    """``anthropic.Anthropic(api_key=...)`` sends ``x-api-key``: a client key there opens /v1
    (the edge's check for a request without a body, the front door's and the edge's with one);
    a Bearer token, when sent, is the key."""
    key = await client_key()
    assert (await v1.get("/v1/models", headers={"x-api-key": key})).status_code == 200
    assert (await v1.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": key})).status_code == 200
    assert_openai_error(await v1.get("/v1/models", headers={"x-api-key": "sk-nope"}), 401)
    both = {"x-api-key": key, "Authorization": "Bearer sk-nope"}
    assert_openai_error(await v1.post("/v1/chat/completions", json=CHAT, headers=both), 401)
    settings.MOTOR_API_KEYS = ["sk-env-test-key"]  # before any key record: the plain keys, as with Bearer
    await sync_to_async(ApiKey.objects.all().delete)()
    snapshots.invalidate()
    assert (await v1.get("/v1/models", headers={"x-api-key": "sk-env-test-key"})).status_code == 200
    assert len(upstream.calls_of("generate")) == 1


async def test_admin_keys_alone_keep_it_closed(v1: httpx.AsyncClient, upstream: FakeUpstreams) -> None:
    _, admin = await sync_to_async(services.api_key_create)(name="ops", scope="admin")
    snapshots.invalidate()
    assert_openai_error(await v1.post("/v1/chat/completions", json=CHAT), 401)
    assert_openai_error(await v1.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {admin}"}), 401)
    assert upstream.calls == []


@pytest.mark.parametrize("managed", [True, False], ids=["key records", "MOTOR_API_KEYS"])
async def test_a_non_ascii_bearer_token_is_401(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, settings: Any, managed: bool
) -> None:
    if managed:
        await client_key()
    else:
        settings.MOTOR_API_KEYS = ["sk-test"]
    # Latin-1 bytes on the wire, as a client sends them; not a key, never an encoding error.
    headers = [(b"content-type", b"application/json"), (b"authorization", "Bearer sk-tést".encode("latin-1"))]
    request = v1.build_request("POST", "/v1/chat/completions", content=json.dumps(CHAT).encode())
    request.headers = httpx.Headers(headers)
    error = assert_openai_error(await v1.send(request), 401)
    assert error["type"] == "AuthenticationError"
    assert upstream.calls == []


# --------------------------------------------------------------------------- bodies nothing downstream can encode


@pytest.mark.parametrize(
    "text",
    [
        '{"model": "tiny", "messages": [], "temperature": NaN}',
        '{"model": "tiny", "messages": [], "temperature": Infinity}',
        '{"model": "tiny", "messages": [], "temperature": -Infinity}',
        '{"model": "tiny", "messages": [], "max_tokens": 1e400}',
        '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
        '{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00 lone low"}]}',
    ],
    ids=["nan", "infinity", "-infinity", "overflow", "lone-high-surrogate", "lone-low-surrogate"],
)
async def test_json_that_cannot_be_encoded_again_is_400(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, open_access: None, text: str
) -> None:
    error = assert_openai_error(await raw_post(v1, text), 400)
    assert error["type"] == "BadRequestError" and "Invalid JSON" in error["message"]
    assert upstream.calls == []


async def test_invalid_utf8_is_400(v1: httpx.AsyncClient, upstream: FakeUpstreams, open_access: None) -> None:
    assert_openai_error(await raw_post(v1, b'{"model": "tiny", "messages": "\xff\xfe"}'), 400)
    assert upstream.calls == []


async def test_a_paired_surrogate_is_a_character_not_an_error(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, open_access: None
) -> None:
    text = '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 3}'
    assert (await raw_post(v1, text)).status_code == 200
    assert upstream.calls_of("render")[0].body["messages"][0]["content"] == "\U0001f600"


@pytest.mark.parametrize("depth", [17, 100, 100_000])
async def test_nesting_deeper_than_the_bound_is_400(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, settings: Any, open_access: None, depth: int
) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1 << 20
    # ``depth`` levels counting the body itself: {"messages": [...], "x": [[[...]]]}.
    text = '{"model": "tiny", "messages": [], "x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"
    error = assert_openai_error(await raw_post(v1, text), 400)
    assert "nests deeper" in error["message"] or "Invalid JSON" in error["message"]
    assert upstream.calls == []


async def test_nesting_up_to_the_bound_and_many_brackets_pass(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, open_access: None
) -> None:
    # 16 levels deep (the bound), and more brackets than the bound side by side (tools, messages).
    deep = {"model": MODEL, "messages": CHAT["messages"], "max_tokens": 3, "x": [[[[[[[[[[[[[[[]]]]]]]]]]]]]]]}
    wide = {**CHAT, "x": [[] for _ in range(40)]}
    assert (await v1.post("/v1/chat/completions", json=deep)).status_code == 200
    assert (await v1.post("/v1/chat/completions", json=wide)).status_code == 200


# --------------------------------------------------------------------------- the body's media type, as vLLM checks it


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonl"],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_a_body_not_declared_json_is_400_as_vllm_answers_it(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, open_access: None, path: str, content_type: str | None
) -> None:
    # Valid JSON whatever the label: vLLM's routes refuse it for the label alone (validate_json_request).
    request = v1.build_request("POST", path, content=json.dumps(CHAT).encode())  # bytes: no Content-Type
    if content_type is not None:
        request.headers["content-type"] = content_type
    error = assert_openai_error(await v1.send(request), 400)
    assert error["message"] == "Unsupported Media Type: Only 'application/json' is allowed."
    assert upstream.calls == []


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON", "application/json ;x=1"])
async def test_json_with_parameters_or_in_capitals_is_json(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, open_access: None, content_type: str
) -> None:
    response = await raw_post(v1, json.dumps(CHAT), **{"Content-Type": content_type})
    assert response.status_code == 200, response.text


async def test_the_media_type_is_checked_before_the_body_is_read(upstream: FakeUpstreams, open_access: None) -> None:
    scope = post_scope([])
    scope["headers"] = [(k, b"text/plain" if k == b"content-type" else v) for k, v in scope["headers"]]
    sent, read = await call(scope, [json.dumps(CHAT).encode()])
    assert read == 0 and sent[0]["status"] == 400


# --------------------------------------------------------------------------- the size cap, before the body is held


def post_scope(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 50000), "server": ("testserver", 80),
    }


async def call(scope: dict[str, Any], chunks: list[bytes]) -> tuple[list[dict[str, Any]], int]:
    """Run the application on ``chunks`` of body; returns what it sent and how many chunks it read."""
    read = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        if read < len(chunks):
            read += 1
            return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}
        await asyncio.Event().wait()  # the client waits for its answer
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async with asyncio.timeout(5):
        await application(scope, receive, send)
    return sent, read


async def test_a_declared_length_over_the_cap_is_413_before_any_byte_is_read(
    upstream: FakeUpstreams, open_access: None
) -> None:
    sent, read = await call(post_scope([(b"content-length", b"5000")]), [b"x" * 1000] * 5)
    assert read == 0
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == 413
    assert upstream.calls == []


async def test_an_undeclared_body_over_the_cap_is_refused_as_it_passes_the_cap(
    upstream: FakeUpstreams, open_access: None
) -> None:
    # Chunked (no Content-Length), or a Content-Length that lies: counted while reading.
    for headers in ([], [(b"content-length", b"10")]):
        sent, read = await call(post_scope(headers), [b"x" * 1000] * 10)
        assert read == 5  # 5000 bytes > 4096: nothing after that chunk was read
        assert sent[0]["status"] == 413
    assert upstream.calls == []


async def test_a_client_without_a_key_gets_401_before_its_body_is_read(upstream: FakeUpstreams) -> None:
    sent, read = await call(post_scope([]), [json.dumps(CHAT).encode()])
    assert read == 0 and sent[0]["status"] == 401


# --------------------------------------------------------------------------- what the edge does not say


async def test_an_engine_failure_reaches_the_client_without_engine_names_or_addresses(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, open_access: None, caplog: pytest.LogCaptureFixture,
    mock_client: LoopbackClient,
) -> None:
    # Nothing listens where the engines are: the production client's ConnectError names the address.
    addresses = [mock_client.refuse(host) for host in ENGINE_URLS]
    for stream in (False, True):
        response = await v1.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        error = assert_openai_error(response, 502)
        assert not any(a in response.text for a in addresses) and "127.0.0.1" not in response.text
        assert "e1" not in response.text and "e2" not in response.text
        assert error["message"] == "An engine failed while serving this request."
    assert any(a in caplog.text for a in addresses)  # logged for the operator


async def test_an_engines_request_error_still_reaches_the_client_unchanged(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, open_access: None
) -> None:
    vllm = error_json(400, "This model's maximum context length is 2048 tokens.", param="input_tokens")
    upstream.override("render", "render", lambda request, body: httpx.Response(400, json=vllm))
    response = await v1.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 400 and response.json() == vllm


# --------------------------------------------------------------------------- the mount


@pytest.mark.parametrize("path", ["/v1", "/v1/", "/v1/embeddings", "/v1/chat/completions/"])
async def test_unknown_paths_under_v1_are_openai_404s(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, path: str
) -> None:
    assert assert_openai_error(await v1.post(path, json=CHAT), 404)["type"] == "NotFoundError"
    assert upstream.calls == []


async def test_everything_else_is_still_django(v1: httpx.AsyncClient, upstream: FakeUpstreams) -> None:
    assert (await v1.get("/admin/login/")).status_code == 200
    assert (await v1.get("/api/instances")).status_code == 401  # ninja's own auth
    metrics = await v1.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert (await v1.get("/v1x")).headers["content-type"].startswith("text/html")  # Django's 404 page


async def test_it_times_every_answered_request_from_arrival_to_its_last_byte(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, open_access: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from serving.edge import openai_api
    from serving.pipeline.metric_names import PHASE_END_TO_END, PHASE_RENDER
    from serving.pipeline.phases import Histograms

    now = [10.0]
    phases = Histograms(clock=lambda: now[0])
    monkeypatch.setattr(openai_api, "phase_histograms", phases)

    def render(request: httpx.Request, body: Any) -> httpx.Response:
        now[0] += 0.5  # render alone moves the clock: the whole request takes that long
        return upstream._render(request, body)

    upstream.override("render", "render", render)
    assert (await v1.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert (await v1.post("/v1/chat/completions", json={**CHAT, "stream": True})).status_code == 200
    assert (await v1.post("/v1/chat/completions", json={**CHAT, "max_tokens": 0})).status_code == 400  # not timed
    samples = phases.samples()
    for mode in ("json", "stream"):
        # The model label is the served model the edge resolved the request to.
        labels = (("api", "chat"), ("mode", mode), ("model", CHAT["model"]), ("topology", "union"))
        assert samples[(PHASE_END_TO_END.name + "_sum", labels)] == 0.5
        assert samples[(PHASE_END_TO_END.name + "_count", labels)] == 1.0
        render_labels = (("api", "chat"), ("mode", mode), ("model", CHAT["model"]), ("source", "render"))
        assert samples[(PHASE_RENDER.name + "_sum", render_labels)] == 0.5
    assert sum(v for (name, _), v in samples.items() if name == PHASE_END_TO_END.name + "_count") == 2.0
