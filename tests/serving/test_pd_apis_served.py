"""Anthropic Messages and the Responses API on Trigger and PD Hybrid, through the real server.

Daphne and uvicorn on a 127.0.0.1 socket, the fake render sidecar served on 127.0.0.1 (its
derender shows every id as ``<id>``), simulated engines (``tests/pd_sims.py``) reached with the
production upstream client, and the official ``anthropic`` and ``openai`` clients reading every
answer and stream. Each request is answered twice: on a fleet of one union engine (the
reference), then on the topology under test, where the answer must be the same:

- Trigger: a push prefill/decode pair alone; D first, P on D's callback (the served metaserver
  view), D decoding on the KV P pushed and computing no prompt token.
- PD Hybrid: a union engine beside a pull pair; a prompt past PD Hybrid's threshold goes to the
  pair (P, then D with P's params), D computing no prompt token.

Handoff for both APIs: tests/serving/test_messages_api.py, test_native_pd_real.py.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from asgiref.sync import sync_to_async

from catalog.models import RenderConfig, ServedModel
from enginesim.testing import LiveServer, eventually
from fleet.models import EngineInstance
from serving import runtime, snapshots
from serving.pipeline.topologies import metaserver as metaserver_module
from serving.pipeline.topologies.hybrid import PDPolicy
from serving.pipeline.topologies.metaserver import MetaServer
from tests.pd_sims import pd_sim_fixtures, sim_server
from tests.serving.fakes import MODEL, RENDER_URL, FakeUpstreams
from tests.serving.loopback import LoopbackClient
from tests.serving.router_fakes import model_dir
from tests.serving.test_trigger_per_prompt_served import CONFIG

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "sk-pd-apis-" + "0123456789abcdef"
PROMPT_TOKENS = PDPolicy().min_prompt_tokens + 20  # past PD Hybrid's threshold


def long_prompt() -> list[int]:
    """A prompt no engine has seen: no prefix cache (the engines' own, or the coordinator's KV
    affinity) sends a request anywhere but where the topology says."""
    start = random.randrange(1000, 100_000)
    return list(range(start, start + PROMPT_TOKENS))


union, prefill, decode, push_prefill, push_decode = pd_sim_fixtures(CONFIG, push_timeout_s=5.0)


@pytest.fixture(scope="module")
def reference_union() -> Iterator[LiveServer]:
    """The union engine of the reference fleet: it caches the test's prompt, which would make
    PD Hybrid prefer it over the pair."""
    yield from sim_server(CONFIG)


class Fleet:
    """The database fleet the served coordinator reads; ``use`` swaps its engines."""

    def __init__(self, model: ServedModel) -> None:
        self.model = model

    async def use(self, *engines: tuple[str, LiveServer, str]) -> None:
        await sync_to_async(self._use)(*engines)
        snapshots.invalidate()

    def _use(self, *engines: tuple[str, LiveServer, str]) -> None:
        """(role, server, kv_transfer) per engine: the whole fleet from now on."""
        EngineInstance.objects.all().delete()
        for role, server, transfer in engines:
            connector = {"push": "MooncakeLayerwiseConnector", "pull": "NixlConnector"}.get(transfer, "")
            EngineInstance.objects.create(
                # Named by port: the coordinator's KV affinity knows an instance by its name.
                name=f"{role}-{server.url.rsplit(':', 1)[1]}", url=server.url, served_model=self.model, role=role, kind="sim",
                kv_connector=connector, kv_transfer=transfer,
            )
            server.reset()


@pytest.fixture
def fleet(
    transactional_db: None, upstreams: FakeUpstreams, render_fake_client: LoopbackClient,
    monkeypatch: pytest.MonkeyPatch, settings: Any, served: str,
) -> Iterator[Fleet]:
    settings.MOTOR_OPEN_ACCESS = False
    settings.MOTOR_API_KEYS = [KEY]
    monkeypatch.setattr(metaserver_module, "_process", MetaServer(served))
    model = ServedModel.objects.create(name=MODEL, model_path=model_dir(), max_model_len=4096, vocab_size=151936)
    host, port = RENDER_URL.removeprefix("http://").split(":")
    RenderConfig.objects.create(host=host, port=int(port), timeout_ms=5000)
    render, prompt = upstreams._render, long_prompt()

    def rendered(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        generate = render(request, body).json()
        generate["token_ids"] = prompt
        return httpx.Response(200, json=generate)

    upstreams.override("render", "render", rendered)
    monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: render_fake_client)
    yield Fleet(model)
    snapshots.invalidate()
    assert metaserver_module.process_metaserver().pending == 0


MESSAGE = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi"}],
           "extra_body": {"temperature": 0, "ignore_eos": True}}
RESPONSE = {"model": MODEL, "max_output_tokens": 8, "input": "Say hi", "temperature": 0,
            "extra_body": {"ignore_eos": True}}


async def answers(base: str, api: str) -> tuple[Any, Any]:
    """The whole answer and the streamed one, as the official client reads them (what varies on
    every answer left out: ids, times, thinking signatures)."""
    if api == "messages":
        async with anthropic.AsyncAnthropic(base_url=base, api_key=KEY, max_retries=0, timeout=30.0) as claude:
            whole = await claude.messages.create(**MESSAGE)  # type: ignore[arg-type]
            async with claude.messages.stream(**MESSAGE) as events:  # type: ignore[arg-type]
                streamed = await events.get_final_message()
        return [whole.model_dump(exclude={"id"}), streamed.model_dump(exclude={"id"})]
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=30.0) as client:
        response = await client.responses.create(**RESPONSE)  # type: ignore[arg-type]
        async with client.responses.stream(**RESPONSE) as events:  # type: ignore[arg-type]
            final = await events.get_final_response()
    changing = {"id", "created_at"}
    out = []
    for r in (response, final):
        data = r.model_dump(exclude=changing)
        data["output"] = [{k: v for k, v in item.items() if k != "id"} for item in data["output"]]
        for item in data["output"]:  # the stream helper adds its own keys to each part
            item["content"] = [{k: part[k] for k in ("type", "text")} for part in item.get("content") or []]
        out.append(data)
    return out


async def idle(*servers: LiveServer) -> None:
    async def quiet() -> bool:
        return runtime.inflight_tokens() == {} and runtime.load.snapshot() == {} and all(
            s.engine.stats.active_streams == 0 for s in servers)

    await eventually(quiet)


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_trigger_answers_like_a_union_engine(
    served: str, fleet: Fleet, api: str, reference_union: LiveServer, push_prefill: LiveServer,
    push_decode: LiveServer,
) -> None:
    await fleet.use(("union", reference_union, ""))
    reference = await answers(served, api)
    await fleet.use(("prefill", push_prefill, "push"), ("decode", push_decode, "push"))
    runtime.counters.clear()
    ours = await answers(served, api)
    assert ours == reference
    assert reference[0] == reference[1]  # the stream spells the whole answer
    # Both requests (whole, streamed) ran Trigger: D first, then P on D's callback; D took the
    # prompt's KV from P's push (the second time from its own prefix cache but the last block)
    # and computed none of it.
    assert metaserver_module.process_metaserver().delivered == 2
    assert push_decode.engine.stats.requests_received == push_prefill.engine.stats.requests_received == 2
    by_source = push_decode.engine.stats.prompt_tokens_by_source
    assert by_source["external_kv_transfer"] >= PROMPT_TOKENS and by_source["local_compute"] == 0
    await idle(push_prefill, push_decode)


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_pd_hybrid_sends_a_long_prompt_to_the_pair_and_answers_like_a_union_engine(
    served: str, fleet: Fleet, api: str, reference_union: LiveServer, union: LiveServer, prefill: LiveServer,
    decode: LiveServer,
) -> None:
    await fleet.use(("union", reference_union, ""))
    reference = await answers(served, api)
    await fleet.use(("union", union, ""), ("prefill", prefill, "pull"), ("decode", decode, "pull"))
    ours = await answers(served, api)
    assert ours == reference and reference[0] == reference[1]
    # PD Hybrid chose the pair for both: P then D, D on P's KV (and its prefix cache), the union
    # engine idle.
    assert union.engine.stats.requests_received == 0
    assert prefill.engine.stats.requests_received == decode.engine.stats.requests_received == 2
    by_source = decode.engine.stats.prompt_tokens_by_source
    assert by_source["external_kv_transfer"] >= PROMPT_TOKENS and by_source["local_compute"] == 0
    await idle(union, prefill, decode)
