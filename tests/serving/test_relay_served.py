"""Relay of every choice of an n > 1 stream, through the real server (Daphne and uvicorn over a
127.0.0.1 socket, ``live_edge``) against simulated engines whose connection dies mid-stream.

Two enginesim union engines sit behind TCP proxies (``tests/integration/cutting_proxy.py``) that
cut the first event stream after some bytes, as a crashed engine or a broken network would; the
render sidecar is the fake served on 127.0.0.1 (its derender shows every id as ``<id>``), and the
coordinator reaches all of them with its production client. The simulator's
next token is a function of the context (a choice's first token is salted by its index), so a
choice continued alone from its committed ids must go on exactly as it would have: the relayed
answer equals the fault-free one, choice by choice, with one role delta per choice and our usage.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from catalog.models import RenderConfig, ServedModel
from enginesim import SimConfig
from enginesim.testing import LiveServer, eventually
from fleet.models import EngineInstance
from serving import runtime, snapshots
from tests.integration.cutting_proxy import Cut, CuttingProxy
from tests.pd_sims import sim_server
from tests.serving.fakes import MODEL, RENDER_URL, FakeUpstreams
from tests.serving.loopback import LoopbackClient
from tests.serving.router_fakes import model_dir

pytestmark = pytest.mark.django_db(transaction=True)

CONFIG = SimConfig(
    served_model_names=(MODEL,), vocab_size=152_000, eos_token_ids=(2,), special_token_ids=frozenset({0, 1, 2, 3}),
    # A few ms per step: each event leaves the engine in a read of its own, so a cut lands between events.
    max_model_len=4096, block_size=16, tpot_ms=5.0,
)
# Long enough that the cut below always lands before both choices finished: an engine event is
# 40-70 bytes by its ids' digits, so 12 tokens a choice sometimes all passed before byte 1200 and
# nothing was left to relay (a flaky run in CI).
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def sim1() -> Iterator[LiveServer]:
    yield from sim_server(CONFIG)


@pytest.fixture(scope="module")
def sim2() -> Iterator[LiveServer]:
    yield from sim_server(CONFIG)


@pytest.fixture
def cut(
    transactional_db: None, upstreams: FakeUpstreams, render_fake_client: LoopbackClient, monkeypatch: pytest.MonkeyPatch,
    settings: Any, sim1: LiveServer, sim2: LiveServer,
) -> Iterator[Cut]:
    """The fleet (two sims behind cutting proxies), the fake render, and the shared cut."""
    settings.MOTOR_API_KEYS = []
    settings.MOTOR_OPEN_ACCESS = True
    model = ServedModel.objects.create(name=MODEL, model_path=model_dir(), max_model_len=4096, vocab_size=151936)
    host, port = RENDER_URL.removeprefix("http://").split(":")
    RenderConfig.objects.create(host=host, port=int(port), timeout_ms=5000)
    shared = Cut()
    with ExitStack() as proxies:
        for i, sim in enumerate((sim1, sim2), start=1):
            proxy = proxies.enter_context(CuttingProxy(sim.port, shared))
            EngineInstance.objects.create(name=f"sim{i}", url=proxy.url, served_model=model, kind="sim")
        # The production upstream client: render to the fake, the engines through the proxies.
        monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: render_fake_client)
        snapshots.invalidate()
        yield shared
        snapshots.invalidate()


async def stream_choices(base: str, body: dict[str, Any]) -> tuple[dict[int, str], int, list[dict[str, Any]], bool]:
    """Per-choice text, role deltas, usage chunks and whether an error frame came, read off the socket."""
    texts: dict[int, str] = {}
    roles, usage, error = 0, [], False
    async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=30) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            frames = [line.removeprefix("data: ") async for line in response.aiter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
    for raw in frames[:-1]:
        chunk = json.loads(raw)
        error = error or "error" in chunk
        if chunk.get("usage"):
            usage.append(chunk["usage"])
        for c in chunk.get("choices") or []:
            roles += bool(c["delta"].get("role"))
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    return texts, roles, usage, error


async def test_every_choice_of_an_n_2_stream_is_relayed_through_the_server(
    served: str, cut: Cut, sim1: LiveServer, sim2: LiveServer,
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": MAX_TOKENS, "n": 2,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    reference, ref_roles, ref_usage, ref_error = await stream_choices(served, body)
    assert set(reference) == {0, 1} and reference[0] != reference[1] and ref_roles == 2 and not ref_error
    relays_before = runtime.counters.get("motor_stream_relays_total", topology="union", reason="failure")

    cut.arm(1200)  # a few events of both choices reach the client, then the engine's connection dies
    texts, roles, usage, error = await stream_choices(served, body)

    assert cut.cuts == 1  # the fault happened
    assert texts == reference and not error  # one uninterrupted stream per choice: no gap, no duplicate
    assert roles == 2  # the role delta once per choice, not per attempt
    # Ours: the original prompt and every committed token, once (the relayed engines saw longer prompts).
    assert len(usage) == 1 and usage[0] == ref_usage[0]
    assert runtime.counters.get("motor_stream_relays_total", topology="union", reason="failure") == relays_before + 1

    # Nothing held: admission, load, and no stream left running on either engine.
    async def idle() -> bool:
        engines_idle = sim1.engine.stats.active_streams == sim2.engine.stats.active_streams == 0
        return engines_idle and runtime.inflight_tokens() == {} and runtime.load.snapshot() == {}

    await eventually(idle)


def test_the_cut_lets_through_exactly_its_bytes_when_one_read_brings_more() -> None:
    # On a loaded machine the proxy's first read may hold the engine's head and a dozen events:
    # cut before that read, the coordinator saw no head and retried the request instead of
    # relaying the stream (the test above, 2 of 8 runs under uvicorn at load 20).
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in (b'data: {"i": %d}\n\n' % i for i in range(100)))
    engine = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = engine.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(head + body)  # one write: one segment on the loopback, one read
            conn.recv(65536)  # until the proxy closes

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    shared = Cut()
    shared.arm(1200)
    with engine, CuttingProxy(engine.getsockname()[1], shared) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
            got = b""
            while data := client.recv(65536):
                got += data
    thread.join(timeout=10)
    assert shared.cuts == 1
    assert got == (head + body)[:1200]
