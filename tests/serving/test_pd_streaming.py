"""Streaming Handoff and Trigger through the router's stream-opening path, against simulator P/D roles.

Engines are live simulators (pull-mode P/D for Handoff, push-mode for Trigger, a union instance
for reference and as the relay target); render is the fake one (tests/serving/fakes.py), whose
derender shows every id. Trigger's callback reaches the real Django metaserver view served by
uvicorn on the test's loop. Every test ends with nothing leaked: load, admission, metaserver
registrations, open engine streams on the simulators, stray tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import aclosing, asynccontextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from django.core.asgi import get_asgi_application

from enginesim import EngineRole, SimConfig
from enginesim.testing import LiveServer, eventually
from serving.pipeline.derender.session import StreamSettings
from serving.pipeline.engine.client import EngineClient
from serving.pipeline.errors import UpstreamRequestError
from serving.pipeline.http11 import Http11Client
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Scheduler
from serving.pipeline.render.client import RenderClient
from serving.pipeline.resilience.breaker import BreakerBoard
from serving.pipeline.response import Response
from serving.pipeline.service import EventStream, ServingPipeline
from serving.pipeline.snapshot import FleetSnapshot, InstanceView, ModelView, RenderView
from serving.pipeline.topologies import metaserver as metaserver_module
from serving.pipeline.topologies.hybrid import PDPolicy, pd_topology_policy
from serving.pipeline.topologies.metaserver import MetaServer
from serving.pipeline.tracing import NO_TRACE
from tests.pd_sims import MOONCAKE_PREFILL_ENGINE_ID, mooncake_sim_fixtures, pd_sim_fixtures, sim_server
from tests.serving.fakes import CHAT_PROMPT, MODEL, RENDER_URL, parse_frames
from tests.serving.leaks import assert_nothing_held
from tests.serving.loopback import LoopbackClient

WATCHDOG_S = 20.0
CONFIG = SimConfig(
    served_model_names=(MODEL,), vocab_size=152_000, eos_token_ids=(2,), special_token_ids=frozenset({0, 1, 2, 3}),
    max_model_len=4096, block_size=16,
)


def _server(**changes: Any) -> Iterator[LiveServer]:
    yield from sim_server(CONFIG, **changes)


union, prefill, decode, push_prefill, push_decode = pd_sim_fixtures(CONFIG, push_timeout_s=5.0)
mooncake_prefill, mooncake_decode = mooncake_sim_fixtures(CONFIG)


def view(server: LiveServer, role: str = "union", transfer: str = "") -> InstanceView:
    port = server.url.rsplit(":", 1)[1]
    return InstanceView(
        id=int(port), name=f"{role}-{port}", url=server.url, role=role, model=MODEL, weight=1, token_capacity=65536,
        max_model_len=4096, token_generate=True, native_openai=False, tokenizer=False, state="active",
        kind="sim", kv_transfer=transfer, kv_connector="NixlConnector" if transfer else "",
    )


class RecordingEngines(EngineClient):
    """The real client, recording every request it sends (non-streaming and streaming)."""

    def __init__(self, client: Http11Client) -> None:
        super().__init__(client)
        self.sent: list[tuple[str, bool, dict[str, Any]]] = []
        self.answers: list[dict[str, Any]] = []
        self.aborted: list[tuple[str, list[str]]] = []

    async def generate(
        self, instance: InstanceView, request: dict[str, Any], *, trace: Mapping[str, str] = NO_TRACE
    ) -> dict[str, Any]:
        self.sent.append((instance.name, False, request))
        response = await super().generate(instance, request, trace=trace)
        self.answers.append(response)
        return response

    async def abort(self, instance: InstanceView, request_ids: list[str]) -> None:
        self.aborted.append((instance.name, request_ids))
        await super().abort(instance, request_ids)

    @asynccontextmanager
    async def generate_stream(
        self, instance: InstanceView, request: dict[str, Any], *, whole_reads: bool = False,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> AsyncIterator[Any]:
        self.sent.append((instance.name, True, request))
        async with super().generate_stream(instance, request, whole_reads=whole_reads, trace=trace) as events:
            yield events


@pytest.fixture
async def metaserver(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MetaServer]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    ms = MetaServer(f"http://127.0.0.1:{sock.getsockname()[1]}")
    monkeypatch.setattr(metaserver_module, "_process", ms)
    server = uvicorn.Server(uvicorn.Config(get_asgi_application(), log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await eventually(lambda: _true(server.started))
    _metaserver_servers.append(server)
    yield ms
    _metaserver_servers.remove(server)
    server.should_exit = True
    await task
    sock.close()


# The live metaserver fixtures' uvicorn servers (at most one per test).
_metaserver_servers: list[uvicorn.Server] = []


async def _true(value: bool) -> bool:
    return value


async def callbacks_answered() -> None:
    """Wait until the metaserver's uvicorn has finished every request cycle it started.

    The decode simulator's callback is answered before the prefill it started ends, but Django's
    handler closes the response in a thread afterwards, so uvicorn's task for that request can
    outlive the coordinator's answer by a moment. It belongs to the test's server, not to the
    coordinator; waiting for it (bounded) keeps the task check strict for everything else.
    """
    await eventually(lambda: _true(all(not s.server_state.tasks for s in _metaserver_servers)))


async def nothing_held(scheduler: Scheduler, before: set[asyncio.Task[Any]]) -> None:
    await callbacks_answered()
    await assert_nothing_held(scheduler, before)


@dataclasses.dataclass
class Rig:
    pipeline: ServingPipeline
    engines: RecordingEngines
    scheduler: Scheduler
    servers: list[LiveServer]


@pytest.fixture
async def rig_factory(
    http: httpx.AsyncClient, engine_http: Http11Client, mock_client: LoopbackClient, union: LiveServer, prefill: LiveServer,
    decode: LiveServer, push_prefill: LiveServer, push_decode: LiveServer,
) -> AsyncIterator[Any]:
    rigs: list[Rig] = []
    before = asyncio.all_tasks()
    for s in (union, prefill, decode, push_prefill, push_decode):
        await http.delete(s.url + "/sim/faults")

    def make(*instances: InstanceView) -> Rig:
        snapshot = FleetSnapshot(
            version=1, models={MODEL: ModelView(MODEL, "/models/tiny", 4096, 151936)},
            render=RenderView(enable=True, base_url=RENDER_URL, timeout_s=5.0), instances=instances,
        )
        scheduler = Scheduler(LoadTracker(), breakers=BreakerBoard())
        scheduler.topology_policy = pd_topology_policy(
            lambda i: scheduler.load.inflight(i.name) / max(i.weight, 1), policy=PDPolicy(min_prompt_tokens=1),
        )
        engines = RecordingEngines(engine_http)
        pipeline = ServingPipeline(
            snapshot, RenderClient(mock_client, RENDER_URL, 5.0), engines, scheduler,
            stream_settings=StreamSettings(chunk_timeout_s=5.0, max_relays=2),
        )
        rig = Rig(pipeline, engines, scheduler, [union, prefill, decode, push_prefill, push_decode])
        rigs.append(rig)
        return rig

    yield make
    # Nothing leaked: holds, admission, registrations, engine streams, tasks.
    for rig in rigs:
        assert rig.scheduler.load.snapshot() == {}
        assert not any(rig.scheduler.admission.inflight_tokens().values())
        assert rig.scheduler.admission.waiting() == 0
    assert metaserver_module.process_metaserver().pending == 0

    async def streams_closed() -> bool:
        stats = [(await http.get(s.url + "/sim/stats")).json() for s in (union, prefill, decode, push_prefill, push_decode)]
        return all(st["active_streams"] == 0 for st in stats)

    await eventually(streams_closed)
    await callbacks_answered()
    await mock_client.aclose()  # its kept-alive connections to the loopback render, and their tasks
    for _ in range(20):
        stray = asyncio.all_tasks() - before - {asyncio.current_task()}
        stray = {t for t in stray if "serve" not in repr(t.get_coro())}  # the metaserver's uvicorn
        if not stray:
            break
        await asyncio.sleep(0.01)
    assert not stray, stray


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "stream": True, "max_tokens": 12,
            "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}, **extra}


async def drain(stream: Any) -> list[Any]:
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream), stream
    async with asyncio.timeout(WATCHDOG_S):
        raw = b"".join([f async for f in stream.frames()])
    return parse_frames(raw)


def content(frames: list[Any]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in frames
                   if isinstance(c, dict) and c.get("choices"))


def usage(frames: list[Any]) -> dict[str, Any]:
    (u,) = [c["usage"] for c in frames if isinstance(c, dict) and c.get("usage")]
    return u


async def reference(rig_factory: Any, union: LiveServer) -> list[Any]:
    rig = rig_factory(view(union))
    return await drain(await rig.pipeline.chat(chat(), "ref"))


async def test_streaming_handoff_equals_union_and_hands_p_params_to_d_verbatim(
    rig_factory: Any, union: LiveServer, prefill: LiveServer, decode: LiveServer,
) -> None:
    expected = await reference(rig_factory, union)
    p, d = view(prefill, "prefill", "pull"), view(decode, "decode", "pull")
    rig = rig_factory(view(union), p, d)

    frames = await drain(await rig.pipeline.chat(chat(), "h1"))

    assert content(frames) == content(expected) and content(frames)
    assert usage(frames)["completion_tokens"] == usage(expected)["completion_tokens"] and frames[-1] == "[DONE]"
    (p_name, p_stream, p_req), (d_name, d_stream, d_req) = rig.engines.sent
    assert (p_name, p_stream, d_name, d_stream) == (p.name, False, d.name, True)
    assert p_req["stream"] is False and p_req["sampling_params"]["max_tokens"] == 1
    assert d_req["kv_transfer_params"] is rig.engines.answers[0]["kv_transfer_params"]  # verbatim: the same object
    assert list(p_req["token_ids"]) == list(d_req["token_ids"]) == CHAT_PROMPT  # render's ids, as 4-byte integers


async def test_streaming_trigger_equals_union(
    rig_factory: Any, metaserver: MetaServer, union: LiveServer, push_prefill: LiveServer, push_decode: LiveServer,
    http: httpx.AsyncClient,
) -> None:
    expected = await reference(rig_factory, union)
    p, d = view(push_prefill, "prefill", "push"), view(push_decode, "decode", "push")
    rig = rig_factory(view(union), p, d)
    before = (await http.get(push_decode.url + "/sim/stats")).json()["prompt_tokens_by_source"].get("external_kv_transfer", 0)

    frames = await drain(await rig.pipeline.chat(chat(), "t1"))

    assert content(frames) == content(expected)
    (d_name, d_stream, d_req), (p_name, p_stream, p_req) = rig.engines.sent
    assert (d_name, d_stream, p_name, p_stream) == (d.name, True, p.name, False)
    assert d_req["kv_transfer_params"]["metaserver"].startswith(metaserver.base_url + "/internal/metaserver/")
    assert p_req["request_id"] == d_req["request_id"]  # P's push names D's request by P's own id
    assert p_req["kv_transfer_params"]["request_id"] == "generate-tokens-" + d_req["request_id"]
    after = (await http.get(push_decode.url + "/sim/stats")).json()["prompt_tokens_by_source"]["external_kv_transfer"]
    assert after - before == len(CHAT_PROMPT)
    assert metaserver.delivered == 1 and metaserver.pending == 0


async def test_a_streaming_handoff_relays_after_decode_drops_mid_stream(
    rig_factory: Any, union: LiveServer, prefill: LiveServer, decode: LiveServer, http: httpx.AsyncClient,
) -> None:
    expected = await reference(rig_factory, union)
    p, d, u = view(prefill, "prefill", "pull"), view(decode, "decode", "pull"), view(union)
    rig = rig_factory(u, p, d)
    await http.post(decode.url + "/sim/faults", json={"mode": "drop_after_tokens", "tokens": 5, "count": 1})

    frames = await drain(await rig.pipeline.chat(chat(), "h2"))

    assert content(frames) == content(expected)  # no gap, no duplicate
    assert usage(frames)["completion_tokens"] == usage(expected)["completion_tokens"]
    assert usage(frames)["prompt_tokens"] == len(CHAT_PROMPT)
    assert not any(isinstance(c, dict) and "error" in c for c in frames)
    # D is excluded after its failure: the relay runs on the union instance with the replay ids.
    names = [(name, streaming) for name, streaming, _ in rig.engines.sent]
    assert names == [(p.name, False), (d.name, True), (u.name, True)]
    relay = rig.engines.sent[-1][2]
    assert relay["token_ids"][: len(CHAT_PROMPT)] == CHAT_PROMPT and len(relay["token_ids"]) > len(CHAT_PROMPT)
    assert relay["sampling_params"]["max_tokens"] == 12 - (len(relay["token_ids"]) - len(CHAT_PROMPT))


async def test_a_pd_only_fleet_ends_the_stream_with_an_error_frame_when_no_decode_is_left(
    rig_factory: Any, union: LiveServer, prefill: LiveServer, decode: LiveServer, http: httpx.AsyncClient,
) -> None:
    expected = await reference(rig_factory, union)
    p, d = view(prefill, "prefill", "pull"), view(decode, "decode", "pull")
    rig = rig_factory(p, d)
    await http.post(decode.url + "/sim/faults", json={"mode": "error_event_after_tokens", "tokens": 4, "count": 1})

    stream = await rig.pipeline.chat(chat(), "h3")
    frames = await drain(stream)

    # D was the failed instance and is excluded: with no other decode and no union, the stream ends
    # with an error frame after the committed chunks (no duplicate), and everything is released.
    assert content(expected).startswith(content(frames))
    assert any(isinstance(c, dict) and "error" in c for c in frames) and frames[-1] == "[DONE]"


async def test_pd_ineligible_requests_stream_on_union(
    rig_factory: Any, union: LiveServer, prefill: LiveServer, decode: LiveServer,
) -> None:
    u = view(union)
    rig = rig_factory(u, view(prefill, "prefill", "pull"), view(decode, "decode", "pull"))

    frames = await drain(await rig.pipeline.chat(chat(n=2, temperature=1.0, seed=7), "i1"))

    assert frames[-1] == "[DONE]" and content(frames)
    assert [(name, streaming) for name, streaming, _ in rig.engines.sent] == [(u.name, True)]
    # The non-streaming path asks the same question.
    body = chat(n=2, temperature=1.0, seed=7, stream=False, stream_options=None)
    answer = await rig.pipeline.chat(body, "i2")
    assert isinstance(answer, dict) and len(answer["choices"]) == 2
    assert [(name, streaming) for name, streaming, _ in rig.engines.sent[1:]] == [(u.name, False)]


async def test_trigger_multi_prompt_streaming_without_a_native_path_fans_out_on_trigger(
    rig_factory: Any, metaserver: MetaServer, union: LiveServer, push_prefill: LiveServer, push_decode: LiveServer,
) -> None:
    # Issue 33: a Trigger-only fleet has no native path (its push pairs serve none), so the RFC's
    # native route would be a 503. Each prompt runs its own Trigger instead, merged as on Handoff.
    p, d = view(push_prefill, "prefill", "push"), view(push_decode, "decode", "push")
    rig = rig_factory(p, d)
    body = {"model": MODEL, "prompt": ["a", "b"], "stream": True, "max_tokens": 4, "ignore_eos": True}

    stream = await rig.pipeline.completions(body, "m1")
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    async with asyncio.timeout(WATCHDOG_S):
        frames = parse_frames(b"".join([f async for f in stream.frames()]))

    assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
    assert not any(isinstance(f, dict) and "error" in f for f in frames)
    texts: dict[int, str] = {}
    for f in frames:
        if isinstance(f, dict):
            for c in f["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert sorted(texts) == [0, 1] and all(texts.values())
    # Two Trigger runs: D first (streaming), then P's prefill on D's callback, once per prompt.
    assert sorted((name, streaming) for name, streaming, _ in rig.engines.sent) == sorted(
        [(d.name, True), (p.name, False)] * 2
    )
    assert metaserver.delivered == 2 and metaserver.pending == 0
    assert rig.pipeline.counters.get("motor_route_decisions_total", path="native", reason="trigger_multi_prompt_stream") == 0


@pytest.fixture(scope="module")
def decode2() -> Iterator[LiveServer]:
    yield from _server(role=EngineRole.DECODE)


async def test_a_relay_onto_another_pd_pair_gives_p_and_d_the_same_replay_ids(
    rig_factory: Any, union: LiveServer, prefill: LiveServer, decode: LiveServer, decode2: LiveServer,
    http: httpx.AsyncClient,
) -> None:
    expected = await reference(rig_factory, union)
    p, d, d2 = view(prefill, "prefill", "pull"), view(decode, "decode", "pull"), view(decode2, "decode", "pull")
    rig = rig_factory(p, d, d2)
    first_d = min((d, d2), key=lambda i: i.name)  # equal load: the scheduler takes the first by name
    failing = decode if first_d is d else decode2
    await http.post(failing.url + "/sim/faults", json={"mode": "drop_after_tokens", "tokens": 4, "count": 1})

    frames = await drain(await rig.pipeline.chat(chat(), "h4"))

    assert content(frames) == content(expected)
    sent = rig.engines.sent
    assert [streaming for _, streaming, _ in sent] == [False, True, False, True]
    (_, _, p2_req), (d2_name, _, d2_req) = sent[2], sent[3]
    assert d2_name != first_d.name
    assert p2_req["token_ids"] == d2_req["token_ids"] == CHAT_PROMPT + d2_req["token_ids"][len(CHAT_PROMPT):]
    assert len(d2_req["token_ids"]) == len(CHAT_PROMPT) + 4
    assert d2_req["kv_transfer_params"] is rig.engines.answers[1]["kv_transfer_params"]
    await http.delete(failing.url + "/sim/faults")


@pytest.fixture(scope="module")
def slow_push_prefill() -> Iterator[LiveServer]:
    # 100 ms per prompt token: the test leaves while the prefill leg runs.
    yield from _server(role=EngineRole.PREFILL, kv_transfer="push", ttft_per_token_ms=100.0)


async def test_a_failed_prefill_leg_moves_the_stream_to_union_before_any_byte(
    rig_factory: Any, union: LiveServer, prefill: LiveServer, decode: LiveServer, http: httpx.AsyncClient,
) -> None:
    expected = await reference(rig_factory, union)
    p, d, u = view(prefill, "prefill", "pull"), view(decode, "decode", "pull"), view(union)
    rig = rig_factory(u, p, d)
    await http.post(prefill.url + "/sim/faults", json={"mode": "http_status", "status": 500, "count": 1})

    frames = await drain(await rig.pipeline.chat(chat(), "f1"))

    assert content(frames) == content(expected)
    assert [(name, streaming) for name, streaming, _ in rig.engines.sent] == [(p.name, False), (u.name, True)]
    assert rig.scheduler.breakers._get(p).failures == 1


@pytest.mark.parametrize("transfer", ["pull", "push"])
async def test_a_client_leaving_mid_stream_aborts_decode_and_releases_everything(
    rig_factory: Any, metaserver: MetaServer, union: LiveServer, prefill: LiveServer, decode: LiveServer,
    push_prefill: LiveServer, push_decode: LiveServer, transfer: str,
) -> None:
    p_server, d_server = (prefill, decode) if transfer == "pull" else (push_prefill, push_decode)
    p, d = view(p_server, "prefill", transfer), view(d_server, "decode", transfer)
    rig = rig_factory(p, d)
    stream = await rig.pipeline.chat(chat(max_tokens=200), "x1")
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)

    async with asyncio.timeout(WATCHDOG_S), aclosing(stream.frames()) as frames:  # type: ignore[type-var]
        for _ in range(3):
            await anext(frames)

    d_id = stream.body.streams[0].request_id
    assert d_id.endswith("-decode") and (d.name, [d_id]) in rig.engines.aborted
    assert metaserver.pending == 0


async def test_a_client_leaving_while_trigger_prefills_releases_the_registration_and_aborts_both_legs(
    rig_factory: Any, metaserver: MetaServer, slow_push_prefill: LiveServer, push_decode: LiveServer,
    http: httpx.AsyncClient,
) -> None:
    p, d = view(slow_push_prefill, "prefill", "push"), view(push_decode, "decode", "push")
    rig = rig_factory(p, d)
    task = asyncio.create_task(rig.pipeline.chat(chat(), "x2"))

    async def prefilling() -> bool:
        return any(name == p.name for name, _, _ in rig.engines.sent)

    await eventually(prefilling)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert metaserver.pending == 0
    aborted = {name for name, _ in rig.engines.aborted}
    assert aborted == {p.name, d.name}
    # (The simulated D keeps a request that waits for a push until its own push timeout: its abort
    # route only knows running requests. Ours is sent; the sim's limitation is noted on the issue.)


async def test_a_streaming_trigger_relays_after_decode_drops_mid_stream(
    rig_factory: Any, metaserver: MetaServer, union: LiveServer, push_prefill: LiveServer, push_decode: LiveServer,
    http: httpx.AsyncClient,
) -> None:
    expected = await reference(rig_factory, union)
    p, d, u = view(push_prefill, "prefill", "push"), view(push_decode, "decode", "push"), view(union)
    rig = rig_factory(u, p, d)
    await http.post(push_decode.url + "/sim/faults", json={"mode": "drop_after_tokens", "tokens": 3, "count": 1})

    frames = await drain(await rig.pipeline.chat(chat(), "t2"))

    assert content(frames) == content(expected)
    assert [(name, streaming) for name, streaming, _ in rig.engines.sent] == [(d.name, True), (p.name, False), (u.name, True)]
    assert rig.engines.sent[-1][2]["token_ids"] == CHAT_PROMPT + rig.engines.sent[-1][2]["token_ids"][len(CHAT_PROMPT):]
    assert len(rig.engines.sent[-1][2]["token_ids"]) == len(CHAT_PROMPT) + 3
    assert metaserver.pending == 0


# -- multi-prompt on P/D ------------------------------------------------------------------------

PROMPTS = ["a", "b"]  # the fake render gives them 2 and 3 tokens (tests/serving/fakes.py)


def completion(stream: bool, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPTS, "stream": stream, "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def by_index(frames: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for c in frames:
        if isinstance(c, dict):
            for choice in c.get("choices") or []:
                texts[choice["index"]] = texts.get(choice["index"], "") + (choice.get("text") or "")
    return texts


def legs_by_prompt(rig: Rig) -> dict[tuple[int, ...], list[tuple[str, bool, dict[str, Any]]]]:
    legs: dict[tuple[int, ...], list[tuple[str, bool, dict[str, Any]]]] = {}
    for sent in rig.engines.sent:
        legs.setdefault(tuple(sent[2]["token_ids"]), []).append(sent)
    return legs


def answer_to(rig: Rig, p_req: dict[str, Any]) -> dict[str, Any]:
    """P's answer to ``p_req`` (the recorder keeps answers in completion order)."""
    (answer,) = [a for a in rig.engines.answers if a["request_id"] == "generate-tokens-" + p_req["request_id"]]
    return answer


async def test_a_streaming_multi_prompt_handoff_fans_out_one_pd_run_per_prompt(
    rig_factory: Any, union: LiveServer, prefill: LiveServer, decode: LiveServer, http: httpx.AsyncClient,
) -> None:
    expected = await drain(await rig_factory(view(union)).pipeline.completions(completion(True), "ref-m"))
    p, d = view(prefill, "prefill", "pull"), view(decode, "decode", "pull")
    rig = rig_factory(p, d)  # P/D only: every prompt goes through Handoff
    before_kv = (await http.get(decode.url + "/sim/stats")).json()["prompt_tokens_by_source"].get("external_kv_transfer", 0)
    before = asyncio.all_tasks()

    frames = await drain(await rig.pipeline.completions(completion(True), "m1"))

    chunks = [c for c in frames if isinstance(c, dict)]
    assert by_index(frames) == by_index(expected) and set(by_index(frames)) == {0, 1}
    assert {c["id"] for c in chunks} == {"cmpl-m1"}  # one response id over both prompts
    finishes = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(finishes) == [0, 1]
    # Usage once, last, the coordinator's account of both prompts (not P's legs counted again).
    (u,) = [c["usage"] for c in chunks if c.get("usage")]
    assert chunks[-1]["usage"] == u == usage(expected) and u["prompt_tokens"] == 5 and frames[-1] == "[DONE]"
    # Each prompt had its own P then D, D streaming with its own P's params verbatim.
    legs = legs_by_prompt(rig)
    assert len(legs) == 2
    for (p_name, p_stream, p_req), (d_name, d_stream, d_req) in legs.values():
        assert (p_name, p_stream, d_name, d_stream) == (p.name, False, d.name, True)
        assert d_req["kv_transfer_params"] is answer_to(rig, p_req)["kv_transfer_params"]
    assert len({req["request_id"] for _, _, req in rig.engines.sent}) == 4
    after_kv = (await http.get(decode.url + "/sim/stats")).json()["prompt_tokens_by_source"]["external_kv_transfer"]
    assert after_kv - before_kv == 5  # both prompts' KV came from P
    await nothing_held(rig.scheduler, before)


@pytest.mark.parametrize("transfer", ["pull", "push"])  # Handoff, Trigger
async def test_a_non_streaming_multi_prompt_pd_run_answers_like_union(
    rig_factory: Any, metaserver: MetaServer, union: LiveServer, prefill: LiveServer, decode: LiveServer,
    push_prefill: LiveServer, push_decode: LiveServer, transfer: str,
) -> None:
    expected = await rig_factory(view(union)).pipeline.completions(completion(False), "ref-n")
    p_server, d_server = (prefill, decode) if transfer == "pull" else (push_prefill, push_decode)
    p, d = view(p_server, "prefill", transfer), view(d_server, "decode", transfer)
    rig = rig_factory(p, d)
    before = asyncio.all_tasks()

    answer = await rig.pipeline.completions(completion(False), "m2")

    assert isinstance(answer, dict) and isinstance(expected, dict)
    assert answer["id"] == "cmpl-m2" and [c["index"] for c in answer["choices"]] == [0, 1]
    assert [c["text"] for c in answer["choices"]] == [c["text"] for c in expected["choices"]]
    assert answer["usage"] == expected["usage"] and answer["usage"]["prompt_tokens"] == 5
    legs = legs_by_prompt(rig)
    assert sorted(legs) == [(1000, 1000), (1001, 1001, 1001)]  # one P/D run per prompt
    if transfer == "pull":
        # Handoff: P computes the prompt and one token, D continues from P's KV transfer params.
        for (p_name, _, p_req), (d_name, _, d_req) in legs.values():
            assert (p_name, d_name) == (p.name, d.name) and p_req["sampling_params"]["max_tokens"] == 1
            assert d_req["kv_transfer_params"] is answer_to(rig, p_req)["kv_transfer_params"]
        assert metaserver.delivered == 0
    else:
        # Trigger: one callback per prompt, each starting the prefill of its own prompt under its D's id.
        assert metaserver.delivered == 2 and metaserver.pending == 0
        for (d_name, _, d_req), (p_name, _, p_req) in legs.values():
            assert (d_name, p_name) == (d.name, p.name)
            assert p_req["request_id"] == d_req["request_id"]
            assert p_req["kv_transfer_params"]["request_id"] == "generate-tokens-" + d_req["request_id"]
        assert len({req["request_id"] for _, _, req in rig.engines.sent}) == 2
    await nothing_held(rig.scheduler, before)


async def test_a_streaming_handoff_over_upstream_mooncake_writes_both_legs_params(
    rig_factory: Any, union: LiveServer, mooncake_prefill: LiveServer, mooncake_decode: LiveServer,
    http: httpx.AsyncClient,
) -> None:
    # Through the router's seam: the snapshot's connector and KV port reach the opener. P answers
    # kv_transfer_params null (upstream vLLM 0.33.0's MooncakeConnector.request_finished).
    expected = await reference(rig_factory, union)
    p = dataclasses.replace(
        view(mooncake_prefill, "prefill", "pull"), name=MOONCAKE_PREFILL_ENGINE_ID, kv_connector="MooncakeConnector",
        kv_port=mooncake_prefill.port,
    )
    d = dataclasses.replace(view(mooncake_decode, "decode", "pull"), kv_connector="MooncakeConnector")
    rig = rig_factory(p, d)
    before = (await http.get(mooncake_decode.url + "/sim/stats")).json()["prompt_tokens_by_source"].get(
        "external_kv_transfer", 0)

    frames = await drain(await rig.pipeline.chat(chat(), "mc1"))

    assert content(frames) == content(expected) and frames[-1] == "[DONE]"
    (_, _, p_req), (_, d_stream, d_req) = rig.engines.sent
    assert rig.engines.answers[0]["kv_transfer_params"] is None and d_stream is True
    assert d_req["kv_transfer_params"]["transfer_id"] == p_req["kv_transfer_params"]["transfer_id"]
    assert d_req["kv_transfer_params"]["remote_bootstrap_addr"] == mooncake_prefill.url
    after = (await http.get(mooncake_decode.url + "/sim/stats")).json()["prompt_tokens_by_source"]["external_kv_transfer"]
    assert after - before == len(CHAT_PROMPT)


def _prefill_barrier(rig: Rig) -> dict[str, int]:
    """Make every non-streaming generate (the P legs) wait, bounded, until two are in flight;
    returns the record of the most that were. Opened one after another, the first would wait out
    the bound alone and the peak would stay 1."""
    inner = rig.engines.generate
    seen = {"in_flight": 0, "peak": 0}
    both = asyncio.Event()

    async def generate(
        instance: InstanceView, request: dict[str, Any], *, trace: Mapping[str, str] = NO_TRACE
    ) -> dict[str, Any]:
        seen["in_flight"] += 1
        seen["peak"] = max(seen["peak"], seen["in_flight"])
        if seen["in_flight"] == 2:
            both.set()
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(3.0):
                    await both.wait()
            return await inner(instance, request, trace=trace)
        finally:
            seen["in_flight"] -= 1

    rig.engines.generate = generate  # type: ignore[method-assign]
    return seen


async def test_multi_prompt_streams_open_concurrently_under_handoff(
    rig_factory: Any, prefill: LiveServer, decode: LiveServer,
) -> None:
    p, d = view(prefill, "prefill", "pull"), view(decode, "decode", "pull")
    rig = rig_factory(p, d)
    seen = _prefill_barrier(rig)
    body = {"model": MODEL, "prompt": ["a", "b"], "stream": True, "max_tokens": 4, "ignore_eos": True}

    frames = await drain(await rig.pipeline.completions(body, "c1"))

    assert seen["peak"] == 2  # both prefills were in flight at once
    assert frames[-1] == "[DONE]" and not any(isinstance(f, dict) and "error" in f for f in frames)
    assert {f["choices"][0]["index"] for f in frames[:-1] if f.get("choices")} == {0, 1}
    legs = sorted((name, streaming) for name, streaming, _ in rig.engines.sent)
    assert legs == sorted([(p.name, False), (p.name, False), (d.name, True), (d.name, True)])


async def test_a_failed_opening_cancels_and_releases_its_siblings_before_the_response(
    rig_factory: Any, prefill: LiveServer, decode: LiveServer, http: httpx.AsyncClient,
) -> None:
    p, d = view(prefill, "prefill", "pull"), view(decode, "decode", "pull")
    rig = rig_factory(p, d)
    seen = _prefill_barrier(rig)
    await http.post(prefill.url + "/sim/faults", json={"mode": "http_status", "status": 400, "count": 1})
    body = {"model": MODEL, "prompt": ["a", "b"], "stream": True, "max_tokens": 4}

    # One prompt's 400 is the request's answer, before any byte: no half-open response.
    with pytest.raises(UpstreamRequestError) as info:
        await rig.pipeline.completions(body, "c2")

    assert info.value.status == 400 and seen["peak"] == 2
    await http.delete(prefill.url + "/sim/faults")
    # (The fixture asserts nothing is held: leases, loads, engine streams, tasks.)


def choice_texts(frames: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for c in frames:
        if isinstance(c, dict) and c.get("choices"):
            choice = c["choices"][0]
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    return texts


async def test_the_choices_of_an_n_2_stream_relay_onto_handoff_each_from_its_own_ids(
    rig_factory: Any, union: LiveServer, prefill: LiveServer, decode: LiveServer, http: httpx.AsyncClient,
) -> None:
    body = chat(n=2, temperature=1.0)
    expected = await drain(await rig_factory(view(union)).pipeline.chat(body, "n0"))
    u, p, d = view(union), view(prefill, "prefill", "pull"), view(decode, "decode", "pull")
    rig = rig_factory(u, p, d)
    # n > 1 stays on union (one instance samples every choice); it drops after 5 ids of the two.
    await http.post(union.url + "/sim/faults", json={"mode": "drop_after_tokens", "tokens": 5, "count": 1})

    frames = await drain(await rig.pipeline.chat(body, "n1"))

    assert choice_texts(frames) == choice_texts(expected) and set(choice_texts(frames)) == {0, 1}
    assert usage(frames)["completion_tokens"] == usage(expected)["completion_tokens"]
    assert not any(isinstance(c, dict) and "error" in c for c in frames)
    # Each choice went on alone (n 1), so it is P/D-eligible now: a Handoff each, P and D given
    # the same replay ids, the choice's own committed ids after the prompt.
    sent = rig.engines.sent
    assert (sent[0][0], sent[0][2]["sampling_params"]["n"]) == (u.name, 2)
    legs = sent[1:]
    assert sorted((name, streaming) for name, streaming, _ in legs) == sorted(
        [(p.name, False), (p.name, False), (d.name, True), (d.name, True)])
    decode_legs = [r for name, streaming, r in legs if streaming]
    prefill_legs = [r for name, streaming, r in legs if not streaming]
    assert sorted(r["token_ids"] for r in decode_legs) == sorted(r["token_ids"] for r in prefill_legs)
    committed = sorted(len(r["token_ids"]) - len(CHAT_PROMPT) for r in decode_legs)
    assert sum(committed) == 5 and all(k >= 1 for k in committed)
    assert all(r["sampling_params"]["n"] == 1 for r in decode_legs)
    await http.delete(union.url + "/sim/faults")
