"""Tokens-per-minute limits per client key: the sliding window (fake clock) and the /v1 view's
grant of the caller's key, charged the way the pipeline charges it after render."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Iterator

import httpx
import pytest

from catalog.models import RenderConfig, ServedModel
from fleet.services import api_key_create
from serving import snapshots
from serving.pipeline.errors import EngineError, RequestError
from serving.pipeline.flow_control import rate_limit
from serving.pipeline.flow_control.rate_limit import KeyCharge, KeyLimit, TokenRateLimited, TokenRateLimiter
from serving.pipeline.request_context import KeyGrant, RequestContext
from serving.pipeline.response import Response, respond


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def limiter(clock: Clock) -> TokenRateLimiter:
    return TokenRateLimiter(clock=clock)


KEY = KeyLimit("a" * 64, "team-a", 100)


def test_charges_up_to_the_limit_then_refuses_with_retry_after(limiter: TokenRateLimiter, clock: Clock) -> None:
    limiter.charge(KEY, 60)
    clock.now += 10
    limiter.charge(KEY, 40)
    assert limiter.used(KEY.key_id) == 100
    with pytest.raises(TokenRateLimited) as exc:
        limiter.charge(KEY, 1)
    assert exc.value.status == 429
    assert exc.value.type == "RateLimitError"
    # The first charge (60 tokens at t=1000) frees room at t=1060; now is t=1010.
    assert exc.value.retry_after_s == 50
    assert limiter.used(KEY.key_id) == 100  # a refused request is not charged


def test_the_window_slides(limiter: TokenRateLimiter, clock: Clock) -> None:
    limiter.charge(KEY, 60)
    clock.now += 30
    limiter.charge(KEY, 40)
    clock.now += 30  # the first charge leaves the window exactly now
    assert limiter.used(KEY.key_id) == 40
    limiter.charge(KEY, 60)
    with pytest.raises(TokenRateLimited) as exc:
        limiter.charge(KEY, 10)
    assert exc.value.retry_after_s == 30  # when the 40-token charge leaves


def test_retry_after_counts_only_what_must_leave(limiter: TokenRateLimiter, clock: Clock) -> None:
    for _ in range(4):
        limiter.charge(KEY, 25)
        clock.now += 5
    # 100 used (charged at +0, +5, +10, +15), now +20: 30 tokens need two charges to leave.
    with pytest.raises(TokenRateLimited) as exc:
        limiter.charge(KEY, 30)
    assert exc.value.retry_after_s == 45


def test_a_request_larger_than_the_limit_can_never_pass(limiter: TokenRateLimiter) -> None:
    with pytest.raises(TokenRateLimited, match="Request too large") as exc:
        limiter.charge(KEY, 101)
    assert exc.value.retry_after_s == 60
    assert limiter.used(KEY.key_id) == 0


def test_keys_are_independent_and_idle_keys_are_forgotten(limiter: TokenRateLimiter, clock: Clock) -> None:
    other = KeyLimit("b" * 64, "team-b", 100)
    limiter.charge(KEY, 100)
    limiter.charge(other, 100)
    assert limiter.used(KEY.key_id) == 100
    clock.now += 60
    assert limiter.used(KEY.key_id) == limiter.used(other.key_id) == 0
    assert limiter._log == {} and limiter._used == {}


async def test_charge_without_a_limit_is_free(limiter: TokenRateLimiter) -> None:
    assert not await KeyCharge(None).charge(10**9, limiter)
    assert limiter._log == {}


@pytest.mark.parametrize("amount", [0, -5])
async def test_a_non_positive_amount_is_refused_never_charged(limiter: TokenRateLimiter, amount: int) -> None:
    with pytest.raises(RequestError):
        limiter.charge(KEY, amount)
    with pytest.raises(RequestError):
        await KeyCharge(KEY).charge(amount, limiter)
    with pytest.raises(RequestError):  # a wrong count is wrong for an unlimited key too
        await KeyCharge(None).charge(amount, limiter)
    assert limiter.used(KEY.key_id) == 0 and limiter._log == {}


async def test_a_request_is_charged_once_whichever_paths_it_takes(limiter: TokenRateLimiter) -> None:
    charge = KeyCharge(KEY)
    assert await charge.charge(30, limiter)  # after render
    assert not await charge.charge(16, limiter)  # then moved to the native path: not again
    assert limiter.used(KEY.key_id) == 30
    await KeyCharge(KEY).charge(30, limiter)  # the next request
    assert limiter.used(KEY.key_id) == 60


async def test_a_keys_limit_holds_per_served_model(limiter: TokenRateLimiter) -> None:
    grant = KeyGrant(limit=KEY)
    await RequestContext.granted("a", grant.for_model("tiny")).charge.charge(90, limiter)
    with pytest.raises(TokenRateLimited):
        await RequestContext.granted("b", grant.for_model("tiny")).charge.charge(20, limiter)
    # another model's window: its own 100 tokens
    await RequestContext.granted("c", grant.for_model("tiny-b")).charge.charge(20, limiter)
    assert limiter.used(f"{KEY.key_id}:tiny") == 90 and limiter.used(f"{KEY.key_id}:tiny-b") == 20


# --------------------------------------------------------------------------- through the view


class ChargingPipeline:
    """Stands in for ServingPipeline: charges ``tokens`` as ``_serve`` does after render."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.served = 0

    async def chat(self, body: dict[str, Any], ctx: RequestContext) -> dict[str, Any] | Response:
        return await respond(ctx, self.serve)

    async def serve(self, response: Response) -> dict[str, Any]:
        await response.charge(self.tokens)
        self.served += 1
        return {"id": response.ctx.request_id, "object": "chat.completion", "choices": []}


@pytest.fixture
def pipeline(transactional_db: None, monkeypatch: pytest.MonkeyPatch, clock: Clock) -> Iterator[ChargingPipeline]:
    ServedModel.objects.create(name="tiny", model_path="/models/tiny", max_model_len=2048, vocab_size=151936)
    RenderConfig.objects.create(host="render.test", port=8100, timeout_ms=5000)
    fake = ChargingPipeline(tokens=40)
    monkeypatch.setattr("serving.edge.openai_api.pipeline_for", lambda snapshot, model=None: fake)
    monkeypatch.setattr(rate_limit, "LIMITER", TokenRateLimiter(clock=clock))
    snapshots.invalidate()
    yield fake
    snapshots.invalidate()


async def post_chat(client: httpx.AsyncClient, key: str) -> Any:
    return await client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {key}"},
    )


@pytest.mark.django_db(transaction=True)
async def test_a_key_over_its_limit_gets_429_with_retry_after(
    v1: httpx.AsyncClient, pipeline: ChargingPipeline, clock: Clock
) -> None:
    from asgiref.sync import sync_to_async

    _, limited = await sync_to_async(api_key_create)(name="limited", scope="client", tokens_per_minute=100)
    _, free = await sync_to_async(api_key_create)(name="free", scope="client")
    snapshots.invalidate()
    assert (await post_chat(v1, limited)).status_code == 200
    assert (await post_chat(v1, limited)).status_code == 200
    response = await post_chat(v1, limited)  # 120 > 100
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "60"
    error = response.json()["error"]
    assert error["type"] == "RateLimitError" and error["code"] == 429
    assert "limited" in error["message"] and "100 tokens per minute" in error["message"]
    # A key without a limit is not held back by another key's window.
    for _ in range(5):
        assert (await post_chat(v1, free)).status_code == 200
    clock.now += 60
    assert (await post_chat(v1, limited)).status_code == 200
    assert pipeline.served == 8


# --------------------------------------------------------------------------- through the real pipeline


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stream", [False, True])
async def test_the_pipeline_charges_after_render_and_refuses_before_any_engine(
    v1: httpx.AsyncClient, upstreams: Any, mock_client: Any, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    from asgiref.sync import sync_to_async

    from tests.serving.conftest import create_db_fleet
    from tests.serving.fakes import MODEL

    await sync_to_async(create_db_fleet)()
    monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: mock_client)
    monkeypatch.setattr(rate_limit, "LIMITER", TokenRateLimiter())
    _, tiny = await sync_to_async(api_key_create)(name="tiny", scope="client", tokens_per_minute=10)
    _, big = await sync_to_async(api_key_create)(name="big", scope="client", tokens_per_minute=10**6)
    snapshots.invalidate()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 20, "stream": stream}
    try:
        ok = await v1.post(
            "/v1/chat/completions", json=body,
            headers={"Authorization": f"Bearer {big}"},
        )
        assert ok.status_code == 200
        if stream:
            assert ok.content.endswith(b"data: [DONE]\n\n")
        generated = len(upstreams.calls_of("generate"))
        refused = await v1.post(
            "/v1/chat/completions", json=body,
            headers={"Authorization": f"Bearer {tiny}"},
        )
        assert refused.status_code == 429  # 20 output tokens alone exceed 10 per minute
        assert refused.headers["Retry-After"] == "60"
        assert refused.json()["error"]["type"] == "RateLimitError"
        assert len(upstreams.calls_of("render")) == 2  # charged after render ...
        assert len(upstreams.calls_of("generate")) == generated  # ... and before any engine
        assert rate_limit.LIMITER.used(hashlib.sha256(tiny.encode()).hexdigest()) == 0
    finally:
        snapshots.invalidate()


# --------------------------------------------------------------------------- refunds


def test_a_refund_takes_exactly_its_charge_out_of_the_window(limiter: TokenRateLimiter) -> None:
    limiter.charge(KEY, 30, "a")
    limiter.charge(KEY, 50, "b")
    limiter.refund(KEY, "a")
    assert limiter.used(KEY.key_id) == 50
    limiter.refund(KEY, "a")  # twice, or a charge that expired: nothing to do
    limiter.refund(KEY, "unknown")
    assert limiter.used(KEY.key_id) == 50
    limiter.charge(KEY, 50, "c")  # the room the refund freed: 100 of 100
    with pytest.raises(TokenRateLimited):
        limiter.charge(KEY, 1, "d")


class FailingPipeline(ChargingPipeline):
    """Charges as ``_serve`` does after render, then fails (an engine fault), waits forever (for a
    client that leaves) or answers."""

    def __init__(self, tokens: int, mode: str) -> None:
        super().__init__(tokens)
        self.mode = mode
        self.charged = asyncio.Event()

    async def serve(self, response: Response) -> dict[str, Any]:
        if self.mode == "answer":
            return await super().serve(response)
        await response.charge(self.tokens)
        self.charged.set()
        if self.mode == "fail":
            raise EngineError("engine e1 answered 500", instance="e1")
        await asyncio.Event().wait()  # the client leaves first
        raise AssertionError("unreachable")


@pytest.fixture
def failing(pipeline: ChargingPipeline, monkeypatch: pytest.MonkeyPatch) -> FailingPipeline:
    fake = FailingPipeline(tokens=90, mode="fail")
    monkeypatch.setattr("serving.edge.openai_api.pipeline_for", lambda snapshot, model=None: fake)
    return fake


@pytest.mark.django_db(transaction=True)
async def test_a_request_that_fails_after_its_charge_is_refunded(v1: httpx.AsyncClient, failing: FailingPipeline) -> None:
    from asgiref.sync import sync_to_async

    _, limited = await sync_to_async(api_key_create)(name="limited", scope="client", tokens_per_minute=100)
    snapshots.invalidate()
    for _ in range(3):  # 90 of 100 a request: without the refund the second is 429
        response = await post_chat(v1, limited)
        assert response.status_code == 502, response.text
    assert rate_limit.LIMITER.used(f"{hashlib.sha256(limited.encode()).hexdigest()}:tiny") == 0
    failing.mode = "answer"  # a request answered keeps its charge ...
    assert (await post_chat(v1, limited)).status_code == 200
    assert rate_limit.LIMITER.used(f"{hashlib.sha256(limited.encode()).hexdigest()}:tiny") == 90
    assert (await post_chat(v1, limited)).status_code == 429  # ... and the window is full again


@pytest.mark.django_db(transaction=True)
async def test_a_client_that_leaves_before_its_answer_is_refunded(failing: FailingPipeline) -> None:
    from asgiref.sync import sync_to_async
    from channels.testing import ApplicationCommunicator

    from motorsite.asgi import application

    failing.mode = "hang"
    _, limited = await sync_to_async(api_key_create)(name="limited", scope="client", tokens_per_minute=100)
    snapshots.invalidate()
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}'
    communicator = ApplicationCommunicator(application, {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                    (b"authorization", f"Bearer {limited}".encode()), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
    })
    await communicator.send_input({"type": "http.request", "body": body, "more_body": False})
    await asyncio.wait_for(failing.charged.wait(), 10)
    window = f"{hashlib.sha256(limited.encode()).hexdigest()}:tiny"
    assert rate_limit.LIMITER.used(window) == 90
    await communicator.send_input({"type": "http.disconnect"})
    await communicator.wait(timeout=10)
    assert rate_limit.LIMITER.used(window) == 0
