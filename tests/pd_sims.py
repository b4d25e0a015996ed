"""The simulated engines of the P/D tests: a union, a prefill and a decode, pull and push, in-process.

One definition for the simulator's own P/D tests (tests/enginesim/test_pd.py) and the
coordinator's (tests/serving/test_topologies.py, tests/serving/test_pd_streaming.py). Each module
passes its ``SimConfig`` (vocabulary and served name differ) and how long its push decode waits
for a push, and binds the fixtures under their usual names::

    union, prefill, decode, push_prefill, push_decode = pd_sim_fixtures(CONFIG, push_timeout_s=1.0)

and, for upstream vLLM's MooncakeConnector (the router supplies both legs' params)::

    mooncake_prefill, mooncake_decode = mooncake_sim_fixtures(CONFIG)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any, Iterator

import httpx
import pytest

from enginesim import EngineRole, SimConfig
from enginesim.testing import LiveServer
from serving.pipeline.engine.client import EngineClient
from serving.pipeline.engine.leg import EngineGuard, GenerateContext
from serving.pipeline.engine.native import NativeClient
from serving.pipeline.http11 import Http11Client
from serving.pipeline.obfuscation.boundary import EngineBoundary
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Scheduler
from serving.pipeline.render.tokenization import TokenizedPrompt
from serving.pipeline.snapshot import FleetSnapshot, InstanceView, ModelView, RenderView
from serving.pipeline.topologies.pd import PDContext, PDPlacement, pd_context
from serving.pipeline.tracing import NO_TRACE


def sim_server(config: SimConfig, **changes: Any) -> Iterator[LiveServer]:
    """A live simulator on ``config`` with ``changes``, for a fixture to ``yield from``."""
    with LiveServer(dataclasses.replace(config, **changes)) as server:
        yield server


def pd_sim_fixtures(config: SimConfig, *, push_timeout_s: float) -> tuple[Any, Any, Any, Any, Any]:
    """Module-scoped fixtures ``union``, ``prefill``, ``decode``, ``push_prefill``, ``push_decode``."""

    @pytest.fixture(scope="module", name="union")
    def union() -> Iterator[LiveServer]:
        yield from sim_server(config)

    @pytest.fixture(scope="module", name="prefill")
    def prefill() -> Iterator[LiveServer]:
        yield from sim_server(config, role=EngineRole.PREFILL)

    @pytest.fixture(scope="module", name="decode")
    def decode() -> Iterator[LiveServer]:
        yield from sim_server(config, role=EngineRole.DECODE)

    @pytest.fixture(scope="module", name="push_prefill")
    def push_prefill() -> Iterator[LiveServer]:
        yield from sim_server(config, role=EngineRole.PREFILL, kv_transfer="push")

    @pytest.fixture(scope="module", name="push_decode")
    def push_decode() -> Iterator[LiveServer]:
        yield from sim_server(config, role=EngineRole.DECODE, kv_transfer="push", kv_push_timeout_seconds=push_timeout_s)

    return union, prefill, decode, push_prefill, push_decode


# The engine id of ``mooncake_prefill``: what its --kv-transfer-config's engine_id would say. The
# coordinator names an upstream Mooncake P by its instance name, so views of it use this name.
MOONCAKE_PREFILL_ENGINE_ID = "mooncake-prefill"


def mooncake_sim_fixtures(config: SimConfig) -> tuple[Any, Any]:
    """Module-scoped fixtures ``mooncake_prefill``, ``mooncake_decode``: pull roles speaking
    upstream vLLM's MooncakeConnector contract (``--kv-pull-params router``, enginesim.pd)."""

    @pytest.fixture(scope="module", name="mooncake_prefill")
    def mooncake_prefill() -> Iterator[LiveServer]:
        yield from sim_server(
            config, role=EngineRole.PREFILL, kv_pull_params="router", kv_engine_id=MOONCAKE_PREFILL_ENGINE_ID,
            kv_connector="MooncakeConnector",
        )

    @pytest.fixture(scope="module", name="mooncake_decode")
    def mooncake_decode() -> Iterator[LiveServer]:
        yield from sim_server(config, role=EngineRole.DECODE, kv_pull_params="router", kv_connector="MooncakeConnector")

    return mooncake_prefill, mooncake_decode


# -- what the topology tests drive P/D with ---------------------------------------------------


@dataclasses.dataclass
class Placed:
    """A placement as the scheduler makes it: ``instances == (prefill, decode)``."""

    prefill: InstanceView
    decode: InstanceView

    @property
    def instances(self) -> tuple[InstanceView, ...]:
        return (self.prefill, self.decode)


def router_pd_context(
    engines: EngineClient, request_id: str, placement: PDPlacement, *, load: LoadTracker | None = None,
    tokens: int = 100, callback_timeout_s: float = 30.0, trace: Mapping[str, str] = NO_TRACE,
) -> PDContext:
    """A ``PDContext`` built as the router builds one (``pd_context``): every leg through the guarded
    leg (breaker, token admission, the load hold on ``load``) over ``engines``, the metaserver the
    process's (the Trigger tests' fixture installs theirs); ``tokens``: D's admission tokens;
    ``trace``: the request's trace headers (``RequestContext.trace``)."""
    instances = tuple(placement.instances)
    model = instances[0].model
    snapshot = FleetSnapshot(
        version=1, models={model: ModelView(model, "/m", max(i.max_model_len for i in instances))},
        render=RenderView(True, "http://render.invalid", 5.0), instances=instances,
    )
    scheduler = Scheduler(load if load is not None else LoadTracker())
    guard = EngineGuard(scheduler, engines, EngineBoundary(), NativeClient(engines._client))
    prompt = TokenizedPrompt([], {"request_id": request_id})
    ctx = GenerateContext(guard, snapshot, request_id, prompt, 0, 0, tokens, trace=trace)
    return pd_context(ctx, placement, callback_timeout_s=callback_timeout_s)


class RecordingEngines(EngineClient):
    """The real client, recording every request object it sends, every response and every abort;
    ``canned`` answers a prefill leg instead of the engine (a body recorded from a connector's
    source, where no engine of it can run here)."""

    def __init__(self, client: Http11Client, canned: dict[str, Any] | None = None) -> None:
        super().__init__(client)
        self.canned = canned
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.answers: list[dict[str, Any]] = []
        self.aborted: list[tuple[str, list[str]]] = []

    async def generate(
        self, instance: InstanceView, request: dict[str, Any], *, trace: Mapping[str, str] = NO_TRACE
    ) -> dict[str, Any]:
        self.sent.append((instance.name, request))
        if self.canned is not None and instance.role == "prefill":
            response = self.canned
        else:
            response = await super().generate(instance, request, trace=trace)
        self.answers.append(response)
        return response

    async def abort(self, instance: InstanceView, request_ids: list[str]) -> None:
        self.aborted.append((instance.name, request_ids))
        await super().abort(instance, request_ids)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        yield client


@pytest.fixture
async def engine_http() -> AsyncIterator[Http11Client]:
    """The production upstream client, for the pipeline's calls to the simulators (``http`` is the
    tests' own, for their /sim controls and reference calls)."""
    async with contextlib.aclosing(Http11Client(httpx.Timeout(10.0, connect=2.0))) as client:
        yield client


@pytest.fixture
def load() -> Iterator[LoadTracker]:
    tracker = LoadTracker()
    yield tracker
    assert tracker.snapshot() == {}, "a leg's hold leaked"
