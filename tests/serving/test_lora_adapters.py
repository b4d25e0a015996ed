"""A LoRA adapter as a served model on the data plane: its view of the fleet, placement only on
engines that hold it, KV affinity apart from its base's, and its base's sidecars called under the
base's name."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import httpx
import pytest

from serving.pipeline.errors import RequestError
from serving.pipeline.placement.filters import eligible_instances
from serving.pipeline.placement.kv_affinity import KVAffinityIndex, PromptBlocks
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Scheduler
from serving.pipeline.protocol import BlockStored
from serving.pipeline.render.adapter_names import AdapterRenderPool
from serving.pipeline.snapshot import FleetSnapshot

from .fakes import MODEL, RENDER_URL, FakeUpstreams, fleet_snapshot, instance
from .loopback import LoopbackClient
from .router_fakes import assert_no_leaks, make_rig

ADAPTER = "tiny-lora"


def adapter_fleet() -> FleetSnapshot:
    """e1 holds the adapter, e2 does not; both serve the base model."""
    snapshot = fleet_snapshot(replace(instance("e1"), lora_adapters=frozenset({ADAPTER})), instance("e2"))
    base = snapshot.models[MODEL]
    return replace(snapshot, models={MODEL: base, ADAPTER: replace(base, name=ADAPTER, base=MODEL)})


def test_an_adapters_view_holds_its_bases_render_and_only_the_engines_that_hold_it() -> None:
    snapshot = adapter_fleet()
    view = snapshot.for_model(ADAPTER)
    assert [i.name for i in view.instances] == ["e1"]
    assert view.render.base_url == RENDER_URL and list(view.models) == [ADAPTER]
    assert [i.name for i in snapshot.for_model(MODEL).instances] == ["e1", "e2"]


def test_placement_filters_an_adapters_request_to_engines_that_hold_it_even_over_the_whole_fleet() -> None:
    snapshot = adapter_fleet()
    assert [i.name for i in eligible_instances(snapshot, ADAPTER)] == ["e1"]
    assert [i.name for i in eligible_instances(snapshot, MODEL)] == ["e1", "e2"]
    scheduler = Scheduler(LoadTracker())
    # e1 busy: the base's request goes to e2, the adapter's still only to e1.
    with scheduler.load.hold(snapshot.instances[0]):
        assert scheduler.place(snapshot, MODEL, [1, 2, 3]).instances[0].name == "e2"
        assert scheduler.place(snapshot, ADAPTER, [1, 2, 3]).instances[0].name == "e1"


def test_an_adapter_no_engine_holds_has_no_candidate() -> None:
    snapshot = adapter_fleet()
    snapshot = replace(snapshot, instances=tuple(replace(i, lora_adapters=frozenset()) for i in snapshot.instances))
    assert snapshot.for_model(ADAPTER).instances == ()
    assert eligible_instances(snapshot, ADAPTER) == []


def test_kv_affinity_keys_an_adapters_blocks_apart_from_the_bases() -> None:
    index = KVAffinityIndex(default_block_size=4)
    prompt = list(range(12))
    index.record("e1", PromptBlocks(prompt))  # the base model's request cached its blocks on e1
    assert index.match("e1", PromptBlocks(prompt)) == 3
    assert index.match("e1", PromptBlocks(prompt, ADAPTER)) == 0
    index.record("e2", PromptBlocks(prompt, ADAPTER))
    assert index.depths(PromptBlocks(prompt, ADAPTER)) == {"e2": 3}
    assert index.depths(PromptBlocks(prompt, "other-lora")) == {}
    assert index.depths(PromptBlocks(prompt)) == {"e1": 3}


def test_kv_events_of_an_adapters_blocks_index_under_the_adapter() -> None:
    index = KVAffinityIndex(default_block_size=4)
    prompt = list(range(8))
    index.apply_events("e1", [BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=prompt,
                                          block_size=4, lora_name=ADAPTER)])
    assert index.match("e1", PromptBlocks(prompt, ADAPTER)) == 2
    assert index.match("e1", PromptBlocks(prompt)) == 0


def test_the_scheduler_keeps_an_adapters_affinity_apart_from_the_bases() -> None:
    snapshot = adapter_fleet()
    affinity = KVAffinityIndex(default_block_size=4)
    scheduler = Scheduler(LoadTracker(), affinity=affinity)
    prompt = list(range(16))
    scheduler.place(snapshot, ADAPTER, prompt)  # on e1, the only holder
    assert scheduler.cached_tokens(snapshot, ADAPTER, prompt) == {"e1": 16}
    assert scheduler.cached_tokens(snapshot, MODEL, prompt) == {}


async def test_the_adapters_render_pool_calls_the_bases_sidecar_under_the_bases_name() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if request.url.path.endswith("/render"):
            if body["model"] != MODEL:  # as vLLM's sidecar, which loads no adapter
                return httpx.Response(404, json={"error": {"message": "nope", "type": "NotFoundError", "code": 404}})
            return httpx.Response(200, json={
                "request_id": "r1", "token_ids": [1, 2], "sampling_params": {"max_tokens": 4}, "model": body["model"],
            })
        if body.get("stream"):
            return httpx.Response(200, json={"chunk": {"id": "x", "model": body["model"], "choices": []}, "stream_state": {}})
        return httpx.Response(200, json={"id": "x", "model": body["model"], "choices": []})

    snapshot = adapter_fleet()
    async with LoopbackClient(handler) as client:  # the production client, the fake sidecar on 127.0.0.1
        pool = AdapterRenderPool(client, snapshot.for_model(ADAPTER).render, adapter=ADAPTER, base=MODEL)
        body = {"model": ADAPTER, "messages": [{"role": "user", "content": "hi"}]}
        rendered = await pool.render_chat(body, "r1")
        assert rendered["model"] == ADAPTER  # the generate request names the adapter
        answer = await pool.derender_chat({"choices": []}, prompt_token_ids=[1, 2], chat_request=body, model=ADAPTER)
        assert answer["model"] == ADAPTER
        chunk, _ = await pool.derender_chunk("chat", {"choices": []}, stream_state=None, prompt_tokens=2,
                                             prompt_token_ids=[1, 2], request=body, model=ADAPTER)
        assert chunk["model"] == ADAPTER
        assert list(client.loopback.connections.values()) == [1]  # all three on one kept-alive socket
    assert [s["model"] for s in seen] == [MODEL, MODEL, MODEL]
    assert seen[1]["chat_request"]["model"] == MODEL and seen[2]["chat_request"]["model"] == MODEL
    assert body["model"] == ADAPTER  # the client's body is not changed in place



async def test_an_adapter_is_refused_before_any_upstream_call_with_obfuscation_on(upstreams: FakeUpstreams) -> None:
    # The engines' weights are permuted with the render config's key; the adapter's are not, so
    # its answers would be noise: refused (fail closed), where the base model is still served.
    rig = make_rig(upstreams)
    snapshot = adapter_fleet()
    snapshot = replace(snapshot, render=replace(snapshot.render, obfuscation=True, obfuscation_key_id="k" * 16))
    body = {"model": ADAPTER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with pytest.raises(RequestError, match="not served with token obfuscation on") as refused:
        await rig.pipeline(snapshot).chat(body, "req-lora-obf")
    assert refused.value.status == 400 and refused.value.param == "model"
    assert upstreams.calls == []
    await assert_no_leaks(rig, set())
