"""Topologies: the PD Hybrid choice (pure, table-driven) and Handoff / Trigger against the simulator.

The runners are driven directly against simulator instances in threads (pull-mode P/D for
Handoff, push-mode P/D for Trigger) and, for Trigger, the real Django metaserver view served by
uvicorn on the test's own loop, as Daphne serves it in production. Every test ends with no load
held, no metaserver registration left and no engine request left waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest
import uvicorn
from django.core.asgi import get_asgi_application

from enginesim import EngineRole, SimConfig
from enginesim.testing import LiveServer, eventually
from serving.pipeline.engine.client import EngineClient
from serving.pipeline.engine.leg import BreakerOpen, GenerateContext, Opened
from serving.pipeline.engine.requests import decode_request, leg_ids, prefill_request
from serving.pipeline.errors import AdmissionTimeout, EngineError, NoCapacity
from serving.pipeline.flow_control.admission import AdmissionSettings, TokenAdmission
from serving.pipeline.http11 import Http11Client
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Scheduler
from serving.pipeline.render.tokenization import TokenizedPrompt
from serving.pipeline.resilience.breaker import BreakerBoard
from serving.pipeline.service import ServingPipeline
from serving.pipeline.snapshot import FleetSnapshot, InstanceView, ModelView, RenderView
from serving.pipeline.topologies import metaserver as metaserver_module
from serving.pipeline.topologies.handoff import open_handoff
from serving.pipeline.topologies.hybrid import (
    TRANSFER_TOPOLOGY,
    PDPolicy,
    Topology,
    choose_topology,
    pd_ineligible,
    pd_instances,
    pd_topology_policy,
)
from serving.pipeline.topologies.metaserver import MetaServer
from serving.pipeline.topologies.pd import PDContext, PDPlacement, _settle
from serving.pipeline.topologies.registry import TopologyRegistry
from serving.pipeline.topologies.trigger import open_trigger, push_prefill_params
from tests.pd_sims import Placed, RecordingEngines, pd_sim_fixtures, router_pd_context, sim_server

MODEL = "tiny"


async def whole(
    opener: Callable[[PDContext, PDPlacement, dict[str, Any], AsyncExitStack], Awaitable[Opened]],
    ctx: PDContext, placement: PDPlacement, engine_request: dict[str, Any],
) -> dict[str, Any]:
    """A non-streaming run: the opener's whole answer (``ctx.stream`` is off)."""
    async with AsyncExitStack() as stack:
        opened = await opener(ctx, placement, engine_request, stack)
    assert opened.events is None and opened.response is not None
    return opened.response


def inst(name: str, role: str = "union", *, transfer: str = "", url: str = "http://127.0.0.1:9", **kw: Any) -> InstanceView:
    return InstanceView(
        id=abs(hash(name)) % 10_000, name=name, url=url, role=role, model=MODEL, weight=1, token_capacity=65536,
        max_model_len=4096, token_generate=True, native_openai=False, tokenizer=False, state="active",
        kind="sim", kv_transfer=transfer, kv_connector="NixlConnector" if transfer else "", **kw,
    )


# -- choosing (pure) ----------------------------------------------------------------------

U1, U2 = inst("u1"), inst("u2")
P1, P2, D1 = inst("p1", "prefill", transfer="pull"), inst("p2", "prefill", transfer="pull"), inst("d1", "decode", transfer="pull")
PP, PD = inst("pp", "prefill", transfer="push"), inst("pd", "decode", transfer="push")
LONG = 1000


def flat(_: InstanceView) -> float:
    return 0.0


@pytest.mark.parametrize(
    ("kw", "topology", "reason"),
    [
        pytest.param(dict(prefills=[], decodes=[D1]), Topology.UNION, "no prefill instance", id="no-P"),
        pytest.param(dict(prefills=[P1], decodes=[]), Topology.UNION, "no decode instance", id="no-D"),
        pytest.param(dict(prefills=[P1], decodes=[PD]), Topology.UNION, "no matching prefill/decode pair", id="mode-mismatch"),
        pytest.param(dict(prompt_tokens=100), Topology.UNION, "short prompt (100 < 256 tokens)", id="short"),
        pytest.param(dict(cached_tokens={"u2": 600}), Topology.UNION, "prefix cached on a union instance (600 tokens)", id="union-cache"),
        pytest.param(dict(load=lambda i: 0.9 if i.role != "union" else 0.1), Topology.UNION, "prefill/decode busier (0.90 vs 0.10)", id="pd-busy"),
        pytest.param(dict(ineligible="prompt_logprobs"), Topology.UNION, "prompt_logprobs", id="ineligible"),
        pytest.param({}, Topology.HANDOFF, "long prompt", id="handoff"),
        pytest.param(dict(prefills=[PP], decodes=[PD]), Topology.TRIGGER, "long prompt", id="trigger"),
        pytest.param(dict(unions=[], prompt_tokens=10), Topology.HANDOFF, "only prefill/decode instances", id="pd-only-fleet"),
        pytest.param(dict(cached_tokens={"u1": 400}), Topology.HANDOFF, "long prompt", id="union-cache-too-small"),
    ],
)
def test_it_chooses_the_topology(kw: dict[str, Any], topology: Topology, reason: str) -> None:
    args: dict[str, Any] = dict(prompt_tokens=LONG, unions=[U1, U2], prefills=[P1], decodes=[D1], load=flat)
    args.update(kw)
    choice = choose_topology(**args)
    assert (choice.topology, choice.reason) == (topology, reason)
    if topology is Topology.UNION:
        assert choice.prefill is None and choice.decode is None
    else:
        assert choice.prefill is not None and choice.decode is not None


def test_it_prefers_the_prefill_instance_that_caches_the_prompt_then_the_least_loaded() -> None:
    loads = {"p1": 0.1, "p2": 0.5}
    choice = choose_topology(
        prompt_tokens=LONG, unions=[], prefills=[P1, P2], decodes=[D1], load=lambda i: loads.get(i.name, 0.0)
    )
    assert choice.prefill == P1 and choice.prefill_candidates == (P1, P2)
    choice = choose_topology(
        prompt_tokens=LONG, unions=[], prefills=[P1, P2], decodes=[D1], load=lambda i: loads.get(i.name, 0.0),
        cached_tokens={"p2": 512},
    )
    assert choice.prefill == P2


def test_it_raises_no_capacity_only_when_nothing_can_serve() -> None:
    with pytest.raises(NoCapacity):
        choose_topology(prompt_tokens=LONG, unions=[], prefills=[P1], decodes=[], load=flat)
    with pytest.raises(NoCapacity):
        choose_topology(prompt_tokens=LONG, unions=[], prefills=[P1], decodes=[D1], load=flat, ineligible="n>1")


def test_a_custom_policy_moves_the_thresholds() -> None:
    choice = choose_topology(
        prompt_tokens=100, unions=[U1], prefills=[P1], decodes=[D1], load=flat, policy=PDPolicy(min_prompt_tokens=64)
    )
    assert choice.topology is Topology.HANDOFF


def test_pd_instances_skips_what_cannot_take_a_leg() -> None:
    snapshot = FleetSnapshot(
        version=1, models={MODEL: ModelView(MODEL, "/m", 4096, 151936)}, render=RenderView(True, "http://r", 5.0),
        instances=(
            U1, P1, D1,
            dataclasses.replace(P2, breaker_state="open"),
            inst("p3", "prefill", transfer="pull", healthy=False),
            dataclasses.replace(inst("p4", "prefill", transfer="pull"), state="draining"),
            inst("p5", "prefill"),  # no KV transfer configured
            dataclasses.replace(inst("p6", "prefill", transfer="pull"), model="other"),
        ),
    )
    # The live verdict (probe health, the breaker board that adopts p2's open breaker) is the scheduler's.
    live = Scheduler(LoadTracker()).eligible
    assert pd_instances(snapshot, MODEL, "prefill", live=live) == [P1]
    assert pd_instances(snapshot, MODEL, "prefill", live=live, exclude={"p1"}) == []
    assert pd_instances(snapshot, MODEL, "decode", live=live) == [D1]


def test_a_prefill_instance_whose_breaker_opened_gets_its_half_open_trial_like_union() -> None:
    """P/D and union place from one eligibility set: the breaker board decides, not the snapshot.

    The drift this pins: P/D candidates used to be filtered by the snapshot's breaker_state too.
    The board's own open transition is written back there, and only the half-open trial (which
    a request claims) writes the next state, so a P/D instance whose breaker opened on the
    request path never got its trial and stayed out until an operator reset it; union did not.
    """
    now = [100.0]
    breakers = BreakerBoard(threshold=1, base_open_s=5.0, clock=lambda: now[0])
    scheduler = Scheduler(LoadTracker(), breakers=breakers)
    scheduler.topology_policy = pd_topology_policy(lambda _i: 0.0, policy=PDPolicy(min_prompt_tokens=1))
    p1 = dataclasses.replace(P1, id=11)
    fleet = (dataclasses.replace(U1, id=1), p1, dataclasses.replace(D1, id=21))
    snapshot = FleetSnapshot(version=1, models={MODEL: ModelView(MODEL, "/m", 4096, 151936)},
                             render=RenderView(True, "http://r", 5.0), instances=fleet)
    assert scheduler.place(snapshot, MODEL, list(range(LONG))).names == "p1,d1"
    breakers.failure(p1, "prefill leg failed")
    # The write-back reached the database and the next snapshot: p1's breaker is open there.
    opened = dataclasses.replace(snapshot, version=2, instances=(fleet[0], dataclasses.replace(p1, breaker_state="open"), fleet[2]))
    assert scheduler.place(opened, MODEL, list(range(LONG))).topology == "union"
    now[0] += 5.0  # the open time passed: the board lets one trial through, as for union
    assert scheduler.place(opened, MODEL, list(range(LONG))).names == "p1,d1"


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        ({"sampling_params": {"max_tokens": 5}}, ""),
        ({"sampling_params": {"prompt_logprobs": 1}}, "prompt_logprobs"),
        ({"sampling_params": {"n": 2}}, "n>1"),
        ({"sampling_params": {}, "kv_transfer_params": {"do_remote_prefill": True}}, "client_kv_transfer_params"),
    ],
)
def test_pd_ineligible(request_: dict[str, Any], reason: str) -> None:
    assert pd_ineligible(request_) == reason


# -- the legs' requests -------------------------------------------------------------------

RENDERED = {
    "request_id": "r1",
    "token_ids": [1, 2, 3],
    "model": MODEL,
    "sampling_params": {"max_tokens": 50, "min_tokens": 8, "temperature": 0.0},
    "stream": False,
    "stream_options": {"include_usage": True},
    "cache_salt": "s",
}


def test_the_prefill_leg_asks_for_one_token_without_streaming() -> None:
    p = prefill_request(RENDERED, request_id="r1-prefill", kv_transfer_params={"do_remote_decode": True})
    assert p["sampling_params"] == {"max_tokens": 1, "min_tokens": 1, "temperature": 0.0}
    assert p["stream"] is False and "stream_options" not in p
    assert p["request_id"] == "r1-prefill" and p["token_ids"] == [1, 2, 3] and p["cache_salt"] == "s"
    assert RENDERED["sampling_params"]["max_tokens"] == 50  # the original is untouched


def test_the_decode_leg_carries_the_real_budget_and_the_params_object_verbatim() -> None:
    kv = {"remote_engine_id": "e", "whatever": [1]}
    d = decode_request(RENDERED, request_id="r1-decode", kv_transfer_params=kv)
    assert d["kv_transfer_params"] is kv
    assert d["sampling_params"] == RENDERED["sampling_params"] and d["request_id"] == "r1-decode"
    assert leg_ids("r1") == ("r1-prefill", "r1-decode")


def test_push_prefill_params_are_the_decode_callback_whole_with_do_remote_decode() -> None:
    # Shaped like vllm-ascend 0.23.0.post1's D posts it (kv_p2p/mooncake_layerwise_connector.py,
    # update_state_after_alloc; docs/ascend-connectors.md "Push"), plus a key no connector knows yet.
    callback = {
        "token_ids": [], "request_id": "generate-tokens-r1-decode", "do_remote_prefill": False,
        "do_remote_decode": True, "remote_block_ids": [[4, 5]], "remote_block_size": [128],
        "remote_engine_id": "d-engine", "remote_host": "10.0.0.7", "remote_port": 36000, "remote_tp_size": 1,
        "remote_pcp_size": 1, "remote_dcp_size": 1, "remote_cached_tokens": 32, "a_later_field": {"x": 1},
    }
    params = push_prefill_params(callback)
    assert params == callback  # every key kept, none renamed or added (do_remote_decode was already true)
    assert params is not callback  # a copy: P's connector writes into its dict
    assert push_prefill_params({**callback, "do_remote_decode": False})["do_remote_decode"] is True


# -- running against the simulator --------------------------------------------------------

CONFIG = SimConfig(
    served_model_names=(MODEL,), vocab_size=512, eos_token_ids=(2,), special_token_ids=frozenset({0, 1, 2, 3}),
    max_model_len=4096, block_size=16,
)
PROMPT = list(range(10, 60))


def _server(**changes: Any) -> Iterator[LiveServer]:
    yield from sim_server(CONFIG, **changes)


union, prefill, decode, push_prefill, push_decode = pd_sim_fixtures(CONFIG, push_timeout_s=2.0)


@pytest.fixture(scope="module")
def slow_union() -> Iterator[LiveServer]:
    yield from _server(tpot_ms=50.0)


@pytest.fixture(scope="module")
def slow_decode() -> Iterator[LiveServer]:
    yield from _server(role=EngineRole.DECODE, tpot_ms=50.0)


@pytest.fixture(scope="module")
def slow_push_prefill() -> Iterator[LiveServer]:
    # 100 ms per prompt token: its push comes long after push_decode stopped waiting.
    yield from _server(role=EngineRole.PREFILL, kv_transfer="push", ttft_per_token_ms=100.0)


def view(server: LiveServer | str, role: str = "union", transfer: str = "") -> InstanceView:
    url = server if isinstance(server, str) else server.url
    return inst(f"{role}-{url.rsplit(':', 1)[1]}", role, transfer=transfer, url=url)


def closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def engines(http: httpx.AsyncClient, engine_http: Http11Client) -> RecordingEngines:
    return RecordingEngines(engine_http)


def request(rid: str = "r1", max_tokens: int = 12) -> dict[str, Any]:
    return {
        "request_id": rid, "model": MODEL, "token_ids": PROMPT, "stream": False,
        "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0},
    }


async def stats(http: httpx.AsyncClient, server: LiveServer) -> dict[str, Any]:
    return (await http.get(server.url + "/sim/stats")).json()


async def reference(http: httpx.AsyncClient, union: LiveServer, max_tokens: int = 12) -> list[int]:
    response = await http.post(union.url + "/inference/v1/generate", json=request("ref", max_tokens))
    return response.json()["choices"][0]["token_ids"]


async def test_handoff_answers_like_a_union_instance(
    http: httpx.AsyncClient, engines: RecordingEngines, load: LoadTracker,
    union: LiveServer, prefill: LiveServer, decode: LiveServer,
) -> None:
    before = (await stats(http, decode))["prompt_tokens_by_source"].get("external_kv_transfer", 0)
    p, d = view(prefill, "prefill", "pull"), view(decode, "decode", "pull")
    ctx = router_pd_context(engines, "r1", Placed(p, d), load=load)

    response = await whole(open_handoff, ctx, Placed(p, d), request())

    # Each leg reached its engine under its own id as X-Request-Id (what vLLM names it by).
    assert (await stats(http, prefill))["x_request_ids"][-1] == "r1-prefill"
    assert (await stats(http, decode))["x_request_ids"][-1] == "r1-decode"

    assert response["choices"][0]["token_ids"] == await reference(http, union)
    after = (await stats(http, decode))["prompt_tokens_by_source"].get("external_kv_transfer", 0)
    assert after - before == len(PROMPT)
    (p_name, p_req), (d_name, d_req) = engines.sent
    assert (p_name, d_name) == (p.name, d.name)
    assert (p_req["request_id"], d_req["request_id"]) == ("r1-prefill", "r1-decode")
    assert p_req["sampling_params"]["max_tokens"] == 1 and p_req["stream"] is False
    assert p_req["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    # Verbatim: the very object P answered with went to D.
    assert d_req["kv_transfer_params"] is engines.answers[0]["kv_transfer_params"]
    assert d_req["sampling_params"]["max_tokens"] == 12
    assert engines.aborted == []
    assert (await stats(http, prefill))["kv"]["held"] == 0


async def test_handoff_never_calls_decode_when_prefill_returns_no_params(
    engines: RecordingEngines, load: LoadTracker, union: LiveServer, decode: LiveServer
) -> None:
    # A union instance answers the prefill leg but produces no kv_transfer_params.
    p, d = view(union, "prefill", "pull"), view(decode, "decode", "pull")
    with pytest.raises(EngineError) as info:
        await whole(open_handoff, router_pd_context(engines, "r1", Placed(p, d), load=load), Placed(p, d), request())
    assert info.value.instance == p.name
    assert [name for name, _ in engines.sent] == [p.name]


async def test_handoff_blames_an_unreachable_prefill_instance(
    engines: RecordingEngines, load: LoadTracker, decode: LiveServer
) -> None:
    p, d = view(closed_url(), "prefill", "pull"), view(decode, "decode", "pull")
    with pytest.raises(EngineError) as info:
        await whole(open_handoff, router_pd_context(engines, "r1", Placed(p, d), load=load), Placed(p, d), request())
    assert info.value.instance == p.name
    assert [name for name, _ in engines.sent] == [p.name]


async def test_handoff_blames_an_unreachable_decode_instance(
    http: httpx.AsyncClient, engines: RecordingEngines, load: LoadTracker, prefill: LiveServer
) -> None:
    p, d = view(prefill, "prefill", "pull"), view(closed_url(), "decode", "pull")
    with pytest.raises(EngineError) as info:
        await whole(open_handoff, router_pd_context(engines, "r1", Placed(p, d), load=load), Placed(p, d), request())
    assert info.value.instance == d.name
    assert [name for name, _ in engines.sent] == [p.name, d.name]


async def test_handoff_without_a_placed_decode_is_no_capacity(engines: RecordingEngines, prefill: LiveServer) -> None:
    @dataclasses.dataclass
    class Half:
        instances: tuple[InstanceView, ...]

    with pytest.raises(NoCapacity):
        half = Half((view(prefill, "prefill", "pull"),))
        await whole(open_handoff, router_pd_context(engines, "r1", half), half, request())
    assert engines.sent == []


async def test_a_cancelled_handoff_aborts_the_running_leg_and_releases_its_hold(
    http: httpx.AsyncClient, engines: RecordingEngines, load: LoadTracker,
    prefill: LiveServer, slow_decode: LiveServer,
) -> None:
    p, d = view(prefill, "prefill", "pull"), view(slow_decode, "decode", "pull")
    ctx = router_pd_context(engines, "r1", Placed(p, d), load=load)
    task = asyncio.create_task(whole(open_handoff, ctx, Placed(p, d), request(max_tokens=400)))

    async def decoding() -> bool:
        # D's holds are taken before P prefills: its leg is running once it was sent.
        return any(name == d.name for name, _ in engines.sent) and load.inflight(d.name) == 1

    await eventually(decoding)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engines.aborted == [(d.name, ["r1-decode"])]

    async def idle() -> bool:
        return (await stats(http, slow_decode))["running"] == 0

    await eventually(idle)


# -- Trigger ------------------------------------------------------------------------------


@pytest.fixture
async def metaserver(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MetaServer]:
    """The real Django app on the test's loop (as under Daphne), with a fresh metaserver."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    ms = MetaServer(f"http://127.0.0.1:{sock.getsockname()[1]}")
    monkeypatch.setattr(metaserver_module, "_process", ms)
    server = uvicorn.Server(uvicorn.Config(get_asgi_application(), log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await eventually(lambda: _true(server.started))
    yield ms
    server.should_exit = True
    await task
    sock.close()
    assert ms.pending == 0, "a metaserver registration leaked"


async def _true(value: bool) -> bool:
    return value


async def test_trigger_answers_like_a_union_instance(
    http: httpx.AsyncClient, engines: RecordingEngines, load: LoadTracker, metaserver: MetaServer,
    union: LiveServer, push_prefill: LiveServer, push_decode: LiveServer,
) -> None:
    before = (await stats(http, push_decode))["prompt_tokens_by_source"].get("external_kv_transfer", 0)
    p, d = view(push_prefill, "prefill", "push"), view(push_decode, "decode", "push")
    ctx = router_pd_context(engines, "r1", Placed(p, d), load=load, callback_timeout_s=5.0)

    response = await whole(open_trigger, ctx, Placed(p, d), request())

    # Both legs under D's id, as X-Request-Id too: P's engine id must be the one the callback names.
    assert (await stats(http, push_decode))["x_request_ids"][-1] == "r1-decode"
    assert (await stats(http, push_prefill))["x_request_ids"][-1] == "r1-decode"
    assert response["choices"][0]["token_ids"] == await reference(http, union)
    after = (await stats(http, push_decode))["prompt_tokens_by_source"].get("external_kv_transfer", 0)
    assert after - before == len(PROMPT)
    (d_name, d_req), (p_name, p_req) = engines.sent
    assert (d_name, p_name) == (d.name, p.name)
    callback_url = d_req["kv_transfer_params"]["metaserver"]
    assert callback_url.startswith(metaserver.base_url + "/internal/metaserver/" + metaserver.owner + ".")
    # P runs under D's request id and gets D's callback whole (vllm-ascend's layer-wise proxy).
    assert p_req["request_id"] == d_req["request_id"] == "r1-decode"
    callback = p_req["kv_transfer_params"]
    assert callback["request_id"] == "generate-tokens-r1-decode" and callback["remote_cached_tokens"] == 0
    assert callback["do_remote_decode"] is True and "remote_tp_size" in callback and "remote_block_size" in callback
    assert metaserver.delivered == 1
    # The request is over: replaying D's callback is refused and starts nothing.
    replay = await http.post(callback_url, json={"request_id": "generate-tokens-r1-decode"})
    assert replay.status_code == 404
    assert len(engines.sent) == 2


async def test_trigger_picks_the_prefill_instance_when_the_callback_arrives(
    http: httpx.AsyncClient, engines: RecordingEngines, load: LoadTracker, metaserver: MetaServer,
    union: LiveServer, push_prefill: LiveServer, push_decode: LiveServer,
) -> None:
    p, d = view(push_prefill, "prefill", "push"), view(push_decode, "decode", "push")
    picked: list[str] = []

    def pick() -> InstanceView:
        picked.append(p.name)
        return p

    placed = Placed(view(closed_url(), "prefill", "push"), d)
    ctx = dataclasses.replace(router_pd_context(engines, "r2", placed, load=load), pick_prefill=pick)
    # The placement named another P; the one picked when the callback arrives runs the prefill.
    response = await whole(open_trigger, ctx, placed, request("r2"))
    assert response["choices"][0]["token_ids"] == await reference(http, union)
    assert picked == [p.name]


async def test_trigger_aborts_decode_when_the_prefill_fails(
    http: httpx.AsyncClient, engines: RecordingEngines, load: LoadTracker, metaserver: MetaServer,
    push_decode: LiveServer,
) -> None:
    p, d = view(closed_url(), "prefill", "push"), view(push_decode, "decode", "push")
    ctx = router_pd_context(engines, "r3", Placed(p, d), load=load, callback_timeout_s=5.0)
    with pytest.raises(EngineError) as info:
        await whole(open_trigger, ctx, Placed(p, d), request("r3"))
    assert info.value.instance == p.name
    assert (d.name, ["r3-decode"]) in engines.aborted

    async def nothing_waits() -> bool:
        return (await stats(http, push_decode))["kv"]["waiting"] == 0

    await eventually(nothing_waits)


async def test_trigger_blames_the_decode_instance_that_gave_up_while_prefill_ran(
    http: httpx.AsyncClient, engines: RecordingEngines, load: LoadTracker, metaserver: MetaServer,
    slow_push_prefill: LiveServer, push_decode: LiveServer,
) -> None:
    p, d = view(slow_push_prefill, "prefill", "push"), view(push_decode, "decode", "push")
    ctx = router_pd_context(engines, "r8", Placed(p, d), load=load, callback_timeout_s=5.0)
    with pytest.raises(EngineError) as info:
        await whole(open_trigger, ctx, Placed(p, d), request("r8"))
    assert info.value.instance == d.name
    # P's leg was still running: it is aborted rather than left prefilling for nobody.
    assert (p.name, ["r8-decode"]) in engines.aborted


async def test_trigger_blames_a_decode_instance_that_never_calls_back(
    engines: RecordingEngines, load: LoadTracker, metaserver: MetaServer,
    slow_union: LiveServer, push_prefill: LiveServer,
) -> None:
    # A union instance ignores the transfer params: no callback ever comes.
    p, d = view(push_prefill, "prefill", "push"), view(slow_union, "decode", "push")
    ctx = router_pd_context(engines, "r4", Placed(p, d), load=load, callback_timeout_s=0.2)
    with pytest.raises(EngineError) as info:
        await whole(open_trigger, ctx, Placed(p, d), request("r4", max_tokens=400))
    assert info.value.instance == d.name
    assert "did not call the metaserver back" in info.value.message
    assert engines.aborted == [(d.name, ["r4-decode"])]
    assert [name for name, _ in engines.sent] == [d.name]


async def test_trigger_blames_a_decode_instance_that_answers_without_calling_back(
    engines: RecordingEngines, load: LoadTracker, metaserver: MetaServer,
    union: LiveServer, push_prefill: LiveServer,
) -> None:
    p, d = view(push_prefill, "prefill", "push"), view(union, "decode", "push")
    ctx = router_pd_context(engines, "r5", Placed(p, d), load=load, callback_timeout_s=5.0)
    with pytest.raises(EngineError) as info:
        await whole(open_trigger, ctx, Placed(p, d), request("r5"))
    assert info.value.instance == d.name and "without calling back" in info.value.message


async def test_a_cancelled_trigger_releases_everything(
    http: httpx.AsyncClient, engines: RecordingEngines, load: LoadTracker, metaserver: MetaServer,
    push_prefill: LiveServer, slow_union: LiveServer,
) -> None:
    # D (a slow union instance: it never calls back) is still running when the client leaves:
    # the decode leg is aborted and the token released.
    p = view(push_prefill, "prefill", "push")
    d = view(slow_union, "decode", "push")
    ctx = router_pd_context(engines, "r7", Placed(p, d), load=load, callback_timeout_s=30.0)
    task = asyncio.create_task(whole(open_trigger, ctx, Placed(p, d), request("r7", max_tokens=400)))

    async def registered() -> bool:
        return metaserver.pending == 1 and load.inflight(d.name) == 1

    await eventually(registered)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert metaserver.pending == 0
    assert (d.name, ["r7-decode"]) in engines.aborted


# -- the router's seam ----------------------------------------------------------------------


@pytest.mark.parametrize("transfer", ["pull", "push"])
async def test_the_router_places_and_runs_pd_through_its_own_legs(
    http: httpx.AsyncClient, engine_http: Http11Client, metaserver: MetaServer, union: LiveServer,
    prefill: LiveServer, decode: LiveServer, push_prefill: LiveServer, push_decode: LiveServer, transfer: str,
) -> None:
    p_server, d_server = (prefill, decode) if transfer == "pull" else (push_prefill, push_decode)
    u, p, d = view(union), view(p_server, "prefill", transfer), view(d_server, "decode", transfer)
    snapshot = FleetSnapshot(
        version=1, models={MODEL: ModelView(MODEL, "/m", 4096, 151936)}, render=RenderView(True, "http://r", 5.0),
        instances=(u, p, d),
    )
    load = LoadTracker()
    scheduler = Scheduler(load)
    scheduler.topology_policy = pd_topology_policy(
        lambda i: load.inflight(i.name) / max(i.weight, 1), policy=PDPolicy(min_prompt_tokens=len(PROMPT)),
    )
    placement = scheduler.place(snapshot, MODEL, PROMPT, tokens=len(PROMPT) + 12)
    assert (placement.topology, placement.instances) == (TRANSFER_TOPOLOGY[transfer].value, (p, d))
    # A short prompt stays on the union instance.
    assert scheduler.place(snapshot, MODEL, PROMPT[:10]).topology == "union"

    pipeline = ServingPipeline(snapshot, None, EngineClient(engine_http), scheduler)  # type: ignore[arg-type]  # no render needed
    ctx = GenerateContext(pipeline.guard, snapshot, "r9", TokenizedPrompt(PROMPT, request("r9")), 0, 0, len(PROMPT) + 12)
    async with AsyncExitStack() as stack:
        opened = await TopologyRegistry().openers[placement.topology](ctx, placement, request("r9"), stack)
    response = opened.response
    assert response is not None and opened.events is None

    assert response["choices"][0]["token_ids"] == await reference(http, union)
    assert load.snapshot() == {}
    assert scheduler.admission.inflight_tokens() in ({}, {p.name: 0, d.name: 0})


@pytest.mark.parametrize("transfer", ["pull", "push"])
async def test_both_legs_carry_the_requests_trace_headers(
    http: httpx.AsyncClient, engines: RecordingEngines, load: LoadTracker, metaserver: MetaServer,
    prefill: LiveServer, decode: LiveServer, push_prefill: LiveServer, push_decode: LiveServer, transfer: str,
) -> None:
    p_server, d_server = (prefill, decode) if transfer == "pull" else (push_prefill, push_decode)
    placed = Placed(view(p_server, "prefill", transfer), view(d_server, "decode", transfer))
    opener = open_handoff if transfer == "pull" else open_trigger
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    # What the request's RequestContext hands its attempts (the edge puts the client's there).
    ctx = router_pd_context(
        engines, f"t-{transfer}", placed, load=load, callback_timeout_s=5.0, trace={"traceparent": traceparent}
    )
    await whole(opener, ctx, placed, request(f"t-{transfer}"))
    # Each engine's latest generate: P's prefill leg and D's decode leg (P's started by D's callback).
    assert (await stats(http, p_server))["traceparents"][-1] == traceparent
    assert (await stats(http, d_server))["traceparents"][-1] == traceparent


@pytest.mark.parametrize("refusal", ["admission", "breaker"])
async def test_a_decode_side_that_refuses_refuses_the_handoff_before_any_prefill(
    http: httpx.AsyncClient, engine_http: Http11Client, prefill: LiveServer, decode: LiveServer, refusal: str,
) -> None:
    p, d = view(prefill, "prefill", "pull"), view(decode, "decode", "pull")
    snapshot = FleetSnapshot(
        version=1, models={MODEL: ModelView(MODEL, "/m", 4096)}, render=RenderView(True, "http://r", 5.0),
        instances=(p, d),
    )
    admission = TokenAdmission(AdmissionSettings(wait_s=0.2))
    scheduler = Scheduler(LoadTracker(), breakers=BreakerBoard(threshold=1), admission=admission)
    engines = RecordingEngines(engine_http)
    full = await admission.acquire(d, d.token_capacity) if refusal == "admission" else None
    if refusal == "breaker":
        scheduler.breakers.failure(d, "tripped by the test")  # threshold 1: open
    held_before = (await stats(http, prefill))["kv"]["held"]
    pipeline = ServingPipeline(snapshot, None, engines, scheduler)  # type: ignore[arg-type]  # no render needed
    ctx = GenerateContext(pipeline.guard, snapshot, "r10", TokenizedPrompt(PROMPT, request("r10")), 0, 0, len(PROMPT) + 12)

    with pytest.raises(AdmissionTimeout if refusal == "admission" else BreakerOpen):
        async with AsyncExitStack() as stack:
            await TopologyRegistry().openers["handoff"](ctx, Placed(p, d), request("r10"), stack)

    assert engines.sent == []  # P never prefilled: no KV pinned on it for a decode that cannot come
    assert (await stats(http, prefill))["kv"]["held"] == held_before
    if full is not None:
        full.release()
    assert scheduler.load.snapshot() == {}
    assert not any(admission.inflight_tokens().values())
    # Neither breaker heard a failure of this attempt (D's was opened by the test, P's untouched).
    assert scheduler.breakers._get(p).failures == 0
    assert scheduler.breakers._get(d).failures == (1 if refusal == "breaker" else 0)
    assert scheduler.breakers.begin(p)  # P's slot is free (no half-open slot left taken)
    scheduler.breakers.release(p)


async def test_the_settle_step_waits_its_legs_out_through_a_second_cancellation() -> None:
    aborting = asyncio.Event()  # each leg's abort is still on its way when the second cancel lands
    cleaned: list[str] = []

    async def leg(name: str) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await aborting.wait()
            cleaned.append(name)

    p_task, d_task = asyncio.create_task(leg("prefill")), asyncio.create_task(leg("decode"))
    await asyncio.sleep(0)
    settle = asyncio.create_task(_settle(p_task, d_task))
    await asyncio.sleep(0.01)
    settle.cancel()  # the second cancellation: the first one is what started the settling
    await asyncio.sleep(0.01)
    assert not settle.done()  # still waiting for both legs' aborts
    aborting.set()
    with pytest.raises(asyncio.CancelledError):
        await settle
    assert sorted(cleaned) == ["decode", "prefill"]
    assert p_task.cancelled() and d_task.cancelled()
