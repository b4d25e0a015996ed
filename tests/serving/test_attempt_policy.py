"""One fault table through the non-streaming and the streaming path: the same retry decisions.

The topology registry is the pipeline's seam (``TopologyRegistry``): each attempt's opener (the
one primitive of both modes) looks up what the table says for that attempt. A fault is raised inside the guard's
breaker scope of the instance it names (as a real leg would raise it), so the breakers hear it as
they would; a success runs the real guarded leg on the decode (or union) instance against the
fake engines. Both modes must place the same attempts, exclude the same instances, leave the
breakers in the same state and end with the same outcome.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

import pytest

from serving.pipeline.engine.client import EngineClient
from serving.pipeline.engine.leg import EngineGuard, GenerateContext, Opened
from serving.pipeline.errors import (
    EngineBusy,
    EngineError,
    EngineLacksCapability,
    MotorError,
    UpstreamRequestError,
)
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Placement, Scheduler
from serving.pipeline.render.client import RenderClient
from serving.pipeline.resilience.breaker import BreakerBoard
from serving.pipeline.response import Response
from serving.pipeline.service import ServingPipeline
from serving.pipeline.snapshot import FleetSnapshot, InstanceView, ModelView, RenderView
from serving.pipeline.streaming.event_stream import EventStream
from serving.pipeline.topologies.hybrid import PDPolicy, pd_topology_policy
from serving.pipeline.topologies.registry import TopologyRegistry
from tests.serving.fakes import MODEL, RENDER_URL, FakeUpstreams, error_json, parse_frames
from tests.serving.loopback import LoopbackClient

WATCHDOG_S = 10.0


def inst(name: str, role: str, transfer: str = "") -> InstanceView:
    return InstanceView(
        id=int(name[1:]) + {"union": 0, "prefill": 10, "decode": 20}[role], name=f"{role[0]}{name[1:]}",
        url=f"http://{role[0]}{name[1:]}.test:9000", role=role, model=MODEL, weight=1, token_capacity=65536,
        max_model_len=2048, token_generate=True, native_openai=False, tokenizer=False, state="active",
        kv_transfer=transfer, kv_connector="NixlConnector" if transfer else "",
    )


# Two P/D pairs and a union instance: the scheduler prefers P/D (PDPolicy(min_prompt_tokens=1)),
# least loaded then by name, so attempt 0 is p1+d1.
FLEET = (inst("u1", "union"), inst("p1", "prefill", "pull"), inst("p2", "prefill", "pull"),
         inst("d1", "decode", "pull"), inst("d2", "decode", "pull"))


@dataclass(frozen=True)
class Fault:
    """What one attempt does: ``ok``, or raise ``error`` naming ``culprit`` ("prefill" | "decode" | "")."""

    error: str = "ok"  # ok | failed | busy | lacks | request
    culprit: str = "decode"

    def exception(self, name: str) -> MotorError:
        if self.error == "busy":
            return EngineBusy(f"{name} is busy", instance=name)
        if self.error == "lacks":
            return EngineLacksCapability(f"{name} lacks token-only generate", instance=name)
        if self.error == "request":
            return UpstreamRequestError(400, error_json(400, "bad request"), source="engine")
        return EngineError(f"{name} failed", instance=name)


OK = Fault()
# (name, the attempts' faults, max attempts,
#  expected placements per attempt, expected breaker failures, expected outcome)
TABLE: list[tuple[str, list[Fault], int, list[str], dict[str, int], str]] = [
    ("decode fails, retry elsewhere", [Fault("failed", "decode"), OK], 2,
     ["p1,d1", "p2,d2"], {"d1": 1}, "ok"),
    ("prefill fails, retry elsewhere", [Fault("failed", "prefill"), OK], 2,
     ["p1,d1", "p2,d2"], {"p1": 1}, "ok"),
    ("a failure naming no instance", [Fault("failed", ""), OK], 2,
     ["p1,d1", "p2,d2"], {}, "ok"),
    ("decode busy: retry, breaker untouched", [Fault("busy", "decode"), OK], 2,
     ["p1,d1", "p2,d2"], {}, "ok"),
    ("two pairs fail, union serves", [Fault("failed", "decode"), Fault("failed", "prefill"), OK], 3,
     ["p1,d1", "p2,d2", "u1"], {"d1": 1, "p2": 1}, "ok"),
    ("the budget runs out", [Fault("failed", "decode"), Fault("failed", "decode")], 2,
     ["p1,d1", "p2,d2"], {"d1": 1, "d2": 1}, "EngineError"),
    ("a request error is not retried", [Fault("request", "decode")], 2,
     ["p1,d1"], {}, "UpstreamRequestError"),
    # No native instance in the fleet: the whole request moves to the native path, which has none.
    ("a missing capability moves the request, not the attempt", [Fault("lacks", "decode")], 2,
     ["p1,d1"], {}, "NoCapacity"),
]


@asynccontextmanager
async def through_breaker(guard: EngineGuard, instance: InstanceView) -> AsyncIterator[None]:
    """A call through ``instance``'s breaker as a leg makes it: its slot taken, then told the outcome."""
    await guard._admit(instance)
    async with guard._outcome(instance):
        yield


class Scripted:
    """An opener that follows the fault table, attempt by attempt."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults
        self.placed: list[str] = []

    async def _fault(self, ctx: GenerateContext, placement: Placement) -> InstanceView:
        self.placed.append(placement.names)
        fault = self.faults[ctx.attempt]
        target = placement.instances[-1]
        if fault.error == "ok":
            return target
        if fault.culprit == "":
            raise fault.exception("")
        named = placement.instances[0] if fault.culprit == "prefill" else target
        async with through_breaker(ctx.guard, named):
            raise fault.exception(named.name)

    async def open(
        self, ctx: GenerateContext, placement: Placement, engine_req: dict[str, Any], stack: AsyncExitStack
    ) -> Opened:
        target = await self._fault(ctx, placement)
        return await ctx.open_leg(target, engine_req, phase="decode", stack=stack)

    def registry(self) -> TopologyRegistry:
        return TopologyRegistry(openers={"union": self.open, "handoff": self.open})


@pytest.fixture
async def client(upstreams: FakeUpstreams) -> AsyncIterator[LoopbackClient]:
    async with LoopbackClient(upstreams.handler) as c:  # the production client, the fakes on 127.0.0.1
        yield c


async def serve(client: LoopbackClient, faults: list[Fault], attempts: int, *, stream: bool) -> tuple[
    list[str], dict[str, int], str, Scheduler
]:
    scheduler = Scheduler(LoadTracker(), breakers=BreakerBoard(threshold=5))
    scheduler.topology_policy = pd_topology_policy(
        lambda i: scheduler.load.inflight(i.name) / max(i.weight, 1), policy=PDPolicy(min_prompt_tokens=1),
    )
    scripted = Scripted(faults)
    snapshot = FleetSnapshot(
        version=1, models={MODEL: ModelView(MODEL, "/models/tiny", 2048, 151936)},
        render=RenderView(enable=True, base_url=RENDER_URL, timeout_s=5.0), instances=FLEET,
    )
    pipeline = ServingPipeline(
        snapshot, RenderClient(client, RENDER_URL, 5.0), EngineClient(client), scheduler,
        max_attempts=attempts, topologies=scripted.registry(),
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream}
    outcome = "ok"
    try:
        async with asyncio.timeout(WATCHDOG_S):
            result = await pipeline.chat(body, "t1")
            if stream:
                assert isinstance(result, Response) and isinstance(result.body, EventStream)
                raw = b"".join([f async for f in result.frames()])
                assert parse_frames(raw)[-1] == "[DONE]"
                assert not any(isinstance(f, dict) and "error" in f for f in parse_frames(raw)), raw
            else:
                assert isinstance(result, dict) and result["choices"], result
    except MotorError as exc:
        outcome = type(exc).__name__
    counted = scheduler.breakers._breakers  # consecutive failures per instance id
    failures = {i.name: counted[i.id].failures for i in FLEET if i.id in counted and counted[i.id].failures}
    return scripted.placed, failures, outcome, scheduler


@pytest.mark.parametrize(("name", "faults", "attempts", "placed", "failures", "outcome"), TABLE, ids=[r[0] for r in TABLE])
async def test_it_takes_the_same_retry_decisions_streaming_or_not(
    client: LoopbackClient, name: str, faults: list[Fault], attempts: int, placed: list[str],
    failures: dict[str, int], outcome: str,
) -> None:
    decisions = {}
    for stream in (False, True):
        got_placed, got_failures, got_outcome, scheduler = await serve(client, faults, attempts, stream=stream)
        decisions[stream] = (got_placed, got_failures, got_outcome)
        # Nothing held once the request is over, whichever way it ended.
        assert scheduler.load.snapshot() == {}
        assert not any(scheduler.admission.inflight_tokens().values())
    assert decisions[False] == decisions[True] == (placed, failures, outcome)
