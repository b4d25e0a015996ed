"""A non-streaming generate's deadline scales with its output budget (``ReplyDeadline``).

Against a real simulator on 127.0.0.1 that is slow but alive (a fixed time per output token):
a long generation that outlasts the flat read timeout is waited for on the first engine, not
counted as a breaker failure and not run again on the second one. With the flat timeout alone
(the old behaviour, ``deadline=None``) the same request fails on both engines.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import httpx
import pytest

from enginesim import SimConfig
from enginesim.testing import LiveServer, eventually
from serving.pipeline.engine.client import EngineClient, ReplyDeadline
from serving.pipeline.errors import EngineError
from serving.pipeline.http11 import Http11Client
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Scheduler
from serving.pipeline.render.tokenization import TokenizedPrompt, TokenizedRequest
from serving.pipeline.resilience.breaker import BreakerBoard
from serving.pipeline.service import ServingPipeline
from serving.pipeline.snapshot import FleetSnapshot, InstanceView, ModelView, RenderView
from serving.pipeline.tracing import NO_TRACE

MODEL = "tiny"
PROMPT = list(range(10, 40))
MAX_TOKENS = 24
TPOT_MS = 25.0  # 24 tokens take about 0.6 s: well past the flat read timeout below
READ_TIMEOUT_S = 0.25
WATCHDOG_S = 20.0


@pytest.fixture(scope="module")
def slow_engines() -> Iterator[tuple[LiveServer, LiveServer]]:
    config = SimConfig(tpot_ms=TPOT_MS)
    with LiveServer(config) as a, LiveServer(config) as b:
        yield a, b


def inst(n: int, server: LiveServer) -> InstanceView:
    return InstanceView(
        id=n, name=f"e{n}", url=server.url, role="union", model=MODEL, weight=1, token_capacity=65536,
        max_model_len=2048, token_generate=True, native_openai=False, tokenizer=False, state="active", kind="sim",
    )


@pytest.fixture
async def http() -> AsyncIterator[Http11Client]:
    # The production client, its read timeout the shared one's role here.
    async with contextlib.aclosing(Http11Client(httpx.Timeout(READ_TIMEOUT_S, connect=2.0))) as client:
        yield client


async def generate(
    http: Http11Client, servers: tuple[LiveServer, LiveServer], deadline: ReplyDeadline | None
) -> tuple[dict[str, Any] | EngineError, Scheduler, list[str]]:
    instances = (inst(1, servers[0]), inst(2, servers[1]))
    snapshot = FleetSnapshot(
        version=1, models={MODEL: ModelView(MODEL, "/m", 2048)}, render=RenderView(True, "http://r", 5.0),
        instances=instances,
    )
    scheduler = Scheduler(LoadTracker(), breakers=BreakerBoard(threshold=5))
    sent: list[str] = []

    class Recording(EngineClient):
        async def generate(
            self, instance: InstanceView, request: dict[str, Any], *, trace: Mapping[str, str] = NO_TRACE
        ) -> dict[str, Any]:
            sent.append(instance.name)
            return await super().generate(instance, request, trace=trace)

    engines = Recording(http, deadline=deadline)
    pipeline = ServingPipeline(snapshot, None, engines, scheduler)  # type: ignore[arg-type]  # no render needed
    request = {"request_id": "cmpl-d1-0", "model": MODEL, "token_ids": PROMPT, "stream": False,
               "sampling_params": {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}}
    tokenized = TokenizedRequest("completions", MODEL, (TokenizedPrompt(PROMPT, request),), "render")
    async with asyncio.timeout(WATCHDOG_S):
        try:
            result: dict[str, Any] | EngineError = await pipeline.attempts("d1").run(tokenized, 0, False)
        except EngineError as exc:
            result = exc
    return result, scheduler, sent


async def assert_released(http: Http11Client, scheduler: Scheduler, servers: tuple[LiveServer, ...]) -> None:
    assert scheduler.load.snapshot() == {}
    assert not any(scheduler.admission.inflight_tokens().values())

    async def idle() -> bool:
        stats = [(await http.get(s.url + "/sim/stats", timeout=5.0)).json() for s in servers]
        return all(s["running"] == 0 for s in stats)

    await eventually(idle)  # a request given up on was aborted on its engine


async def test_it_waits_for_a_long_generation_on_a_slow_but_alive_engine(
    http: Http11Client, slow_engines: tuple[LiveServer, LiveServer]
) -> None:
    tasks = asyncio.all_tasks()
    deadline = ReplyDeadline(base_s=READ_TIMEOUT_S, per_token_s=0.2)  # 0.25 + 24 x 0.2 = 5.05 s
    result, scheduler, sent = await generate(http, slow_engines, deadline)

    assert isinstance(result, dict), result
    assert len(result["choices"][0]["token_ids"]) == MAX_TOKENS
    assert sent == ["e1"]  # not run again on e2
    assert {b.failures for b in scheduler.breakers._breakers.values()} <= {0}  # no breaker heard a failure
    await assert_released(http, scheduler, slow_engines)
    assert asyncio.all_tasks() == tasks


async def test_a_flat_read_timeout_fails_the_same_generation_on_both_engines(
    http: Http11Client, slow_engines: tuple[LiveServer, LiveServer]
) -> None:
    tasks = asyncio.all_tasks()
    result, scheduler, sent = await generate(http, slow_engines, None)

    assert isinstance(result, EngineError), result
    assert sent == ["e1", "e2"]
    # Each attempt reached its engine under its own engine request id as X-Request-Id.
    seen = [(await http.get(s.url + "/sim/stats")).json()["x_request_ids"][-1] for s in slow_engines]
    assert seen == ["cmpl-d1-0", "cmpl-d1-0-a1"]
    assert sorted(b.failures for b in scheduler.breakers._breakers.values()) == [1, 1]
    await assert_released(http, scheduler, slow_engines)
    assert asyncio.all_tasks() == tasks


def test_the_deadline_grows_with_max_tokens_only() -> None:
    d = ReplyDeadline(base_s=60.0, per_token_s=0.1)
    assert d.seconds({"sampling_params": {"max_tokens": 1}}) == pytest.approx(60.1)
    assert d.seconds({"sampling_params": {"max_tokens": 4000, "n": 4}}) == pytest.approx(460.0)
    assert d.seconds({"sampling_params": {}}) == 60.0
