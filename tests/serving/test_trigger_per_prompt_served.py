"""Issue 33: a Trigger multi-prompt stream with no native path, through the real server.

On a Trigger-only fleet whose engines serve no OpenAI API of their own, the RFC's native route
for a multi-prompt stream does not exist: each prompt runs its own token-only Trigger, merged.
That decision is counted in ``motor_route_decisions_total`` under a reason of its own
(``path="token_only"``, ``reason="trigger_per_prompt"``), shown by ``/metrics`` with only
declared label values. Daphne and uvicorn on a 127.0.0.1 socket, push-pair simulators, the
fake render served on 127.0.0.1 (its derender shows every id as ``<id>``), all reached with the
production upstream client, D's callback on the served metaserver view.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from catalog.models import RenderConfig, ServedModel
from enginesim import SimConfig
from enginesim.testing import LiveServer, eventually
from fleet.models import EngineInstance
from serving import runtime, snapshots
from serving.pipeline.topologies import metaserver as metaserver_module
from serving.pipeline.topologies.metaserver import MetaServer
from tests.pd_sims import pd_sim_fixtures
from tests.serving.fakes import MODEL, RENDER_URL, FakeUpstreams
from tests.serving.loopback import LoopbackClient
from tests.serving.router_fakes import model_dir
from tests.serving.test_metric_labels import unknown_label_values

pytestmark = pytest.mark.django_db(transaction=True)

CONFIG = SimConfig(
    served_model_names=(MODEL,), vocab_size=152_000, eos_token_ids=(2,), special_token_ids=frozenset({0, 1, 2, 3}),
    max_model_len=4096, block_size=16,
)
COUNTED = f'motor_route_decisions_total{{model="{MODEL}",path="token_only",reason="trigger_per_prompt"}}'


*_, push_prefill, push_decode = pd_sim_fixtures(CONFIG, push_timeout_s=5.0)  # the push pair only


@pytest.fixture
def trigger_only(
    transactional_db: None, upstreams: FakeUpstreams, render_fake_client: LoopbackClient, monkeypatch: pytest.MonkeyPatch,
    settings: Any, served: str,
    push_prefill: LiveServer, push_decode: LiveServer, request: pytest.FixtureRequest,
) -> Iterator[MetaServer]:
    """One push pair, render on (the fake); serving its own OpenAI API when the test parametrizes
    this fixture with True, else token-only."""
    native = bool(getattr(request, "param", False))
    settings.MOTOR_API_KEYS = []
    settings.MOTOR_OPEN_ACCESS = True
    metaserver = MetaServer(served)
    monkeypatch.setattr(metaserver_module, "_process", metaserver)
    model = ServedModel.objects.create(name=MODEL, model_path=model_dir(), max_model_len=4096, vocab_size=151936)
    host, port = RENDER_URL.removeprefix("http://").split(":")
    RenderConfig.objects.create(host=host, port=int(port), timeout_ms=5000)
    for role, server in (("prefill", push_prefill), ("decode", push_decode)):
        EngineInstance.objects.create(
            name=f"{role}-1", url=server.url, served_model=model, role=role, kind="sim", cap_native_openai=native,
            kv_connector="MooncakeLayerwiseConnector", kv_transfer="push",
        )
        server.reset()
    # The production upstream client: render to the fake, the engines over their sockets.
    monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: render_fake_client)
    snapshots.invalidate()
    yield metaserver
    snapshots.invalidate()
    assert metaserver.pending == 0


async def test_the_per_prompt_trigger_fallback_is_counted_under_its_own_reason(
    served: str, trigger_only: MetaServer, push_prefill: LiveServer, push_decode: LiveServer
) -> None:
    runtime.counters.clear()
    body = {"model": MODEL, "prompt": ["a", "b"], "stream": True, "max_tokens": 4, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=served, trust_env=False, timeout=30) as client:
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        frames = [b[6:] for b in response.text.split("\n\n") if b.startswith("data: ")]
        assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
        indexes = {c["index"] for f in frames[:-1] for c in json.loads(f)["choices"]}
        assert indexes == {0, 1}
        # Each prompt ran its own Trigger: D first, then P on D's callback.
        assert trigger_only.delivered == 2
        assert push_decode.engine.stats.requests_received == push_prefill.engine.stats.requests_received == 2
        text = (await client.get("/metrics")).text
    assert f"{COUNTED} 1.0" in text
    assert 'path="native",reason="trigger_multi_prompt_stream"' not in text
    assert unknown_label_values(text) == []

    async def idle() -> bool:
        return runtime.inflight_tokens() == {} and runtime.load.snapshot() == {} and all(
            s.engine.stats.active_streams == 0 for s in (push_prefill, push_decode))

    await eventually(idle)


@pytest.mark.parametrize("trigger_only", [True], ids=["native_api"], indirect=True)
async def test_a_push_pair_serving_its_own_api_takes_the_multi_prompt_stream_natively_per_prompt(
    served: str, trigger_only: MetaServer, push_prefill: LiveServer, push_decode: LiveServer
) -> None:
    # The RFC's route for a Trigger multi-prompt stream is native: with the pair's own API there
    # is one, a pair flow per prompt (D first, P on D's callback), merged as vLLM merges them.
    runtime.counters.clear()
    body = {"model": MODEL, "prompt": ["a", "b"], "stream": True, "max_tokens": 4, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=served, trust_env=False, timeout=30) as client:
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        frames = [b[6:] for b in response.text.split("\n\n") if b.startswith("data: ")]
        assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
        chunks = [json.loads(f) for f in frames[:-1]]
        assert {c["index"] for f in chunks for c in f["choices"]} == {0, 1} and len({f["id"] for f in chunks}) == 1
        text = (await client.get("/metrics")).text
    assert f'motor_route_decisions_total{{model="{MODEL}",path="native",reason="trigger_multi_prompt_stream"}} 1.0' in text
    assert f"{COUNTED} 0.0" in text or COUNTED not in text
    assert trigger_only.delivered == 2
    # Through the engines' own API: D computed no prompt token (P pushed both prompts' KV).
    by_source = push_decode.engine.stats.prompt_tokens_by_source
    assert by_source["external_kv_transfer"] > 0 and by_source["local_compute"] == 0
