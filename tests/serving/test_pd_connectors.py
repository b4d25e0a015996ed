"""Handoff over the two Mooncake pull contracts, chosen by the pair's connector.

- vllm-ascend's ``MooncakeConnectorV1`` (and NIXL): P answers the prefill leg with D's
  ``kv_transfer_params`` and D gets them verbatim (the P/D seed's pull flow).
- upstream vLLM's ``MooncakeConnector``: the router gives both legs a transfer id, D also P's
  engine id and bootstrap address, and P answers ``kv_transfer_params: null``.

No NPU or RDMA is available, so the bodies are built from the connectors' sources (cited at each)
and run against the simulator's pull roles speaking each contract (enginesim/pd.py), or, for the
Ascend answer, a recorded-shape answer through the real engine client's seam.
"""

from __future__ import annotations

import dataclasses
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from enginesim import SimConfig
from enginesim.testing import LiveServer
from serving.pipeline.errors import EngineError
from serving.pipeline.http11 import Http11Client
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.snapshot import InstanceView
from serving.pipeline.topologies.handoff import (
    MOONCAKE_BOOTSTRAP_PORT,
    bootstrap_addr,
    open_handoff,
    router_pull_params,
    router_supplies_params,
)
from serving.pipeline.topologies.pd import PDContext
from serving.snapshots import wire_connector
from tests.pd_sims import (
    MOONCAKE_PREFILL_ENGINE_ID,
    Placed,
    RecordingEngines,
    mooncake_sim_fixtures,
    pd_sim_fixtures,
    router_pd_context,
)

MODEL = "tiny"
CONFIG = SimConfig(
    served_model_names=(MODEL,), vocab_size=512, eos_token_ids=(2,), special_token_ids=frozenset({0, 1, 2, 3}),
    max_model_len=4096, block_size=16,
)
PROMPT = list(range(10, 60))

union, prefill, decode, push_prefill, push_decode = pd_sim_fixtures(CONFIG, push_timeout_s=2.0)
mooncake_prefill, mooncake_decode = mooncake_sim_fixtures(CONFIG)


def inst(name: str, role: str, connector: str, *, url: str = "http://127.0.0.1:9", **kw: Any) -> InstanceView:
    return InstanceView(
        id=abs(hash(name)) % 10_000, name=name, url=url, role=role, model=MODEL, weight=1, token_capacity=65536,
        max_model_len=4096, token_generate=True, native_openai=False, tokenizer=False, state="active",
        kind="sim", kv_transfer="pull", kv_connector=connector, **kw,
    )


def request(rid: str = "r1", max_tokens: int = 12) -> dict[str, Any]:
    return {
        "request_id": rid, "model": MODEL, "token_ids": PROMPT, "stream": False,
        "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0},
    }


async def run(ctx: PDContext, placed: Placed, engine_request: dict[str, Any]) -> dict[str, Any]:
    async with AsyncExitStack() as stack:
        opened = await open_handoff(ctx, placed, engine_request, stack)
    assert opened.response is not None
    return opened.response


async def kv_stats(http: httpx.AsyncClient, server: LiveServer) -> dict[str, Any]:
    return (await http.get(server.url + "/sim/stats")).json()


async def reference(http: httpx.AsyncClient, union: LiveServer) -> list[int]:
    response = await http.post(union.url + "/inference/v1/generate", json=request("ref"))
    return response.json()["choices"][0]["token_ids"]


# -- which contract (pure) ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("p_connector", "d_connector", "router"),
    [
        pytest.param("MooncakeConnector", "MooncakeConnector", True, id="upstream-mooncake"),
        pytest.param("MooncakeConnector", "", True, id="upstream-mooncake-blank-decode"),
        pytest.param("MooncakeConnectorV1", "MooncakeConnectorV1", False, id="ascend-mooncake"),
        pytest.param("NixlConnector", "NixlConnector", False, id="nixl"),
    ],
)
def test_the_pair_connector_says_who_writes_the_decode_params(p_connector: str, d_connector: str, router: bool) -> None:
    assert router_supplies_params(inst("p", "prefill", p_connector), inst("d", "decode", d_connector)) is router


@pytest.mark.parametrize(
    ("record", "hardware", "wire"),
    [
        # fleet/ascend.py launches a Mooncake pull engine on Ascend as vllm-ascend's MooncakeConnectorV1.
        pytest.param("MooncakeConnector", "A3", "MooncakeConnectorV1", id="ascend-pull"),
        pytest.param("MooncakeLayerwiseConnector", "A2", "MooncakeLayerwiseConnector", id="ascend-push"),
        pytest.param("MooncakeConnector", "cuda", "MooncakeConnector", id="upstream-pull"),
        pytest.param("NixlConnector", "cpu", "NixlConnector", id="nixl"),
    ],
)
def test_the_snapshot_names_the_connector_the_engine_was_launched_with(record: str, hardware: str, wire: str) -> None:
    assert wire_connector(record, hardware) == wire


def test_upstream_mooncake_params_are_the_ones_its_connector_reads() -> None:
    # vLLM 0.33.0, vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py:
    # P (update_state_after_alloc, do_remote_decode branch) warns "Missing transfer_id ... from
    # router!" without a transfer_id; D (do_remote_prefill branch) needs remote_engine_id,
    # remote_bootstrap_addr and transfer_id, and GETs remote_bootstrap_addr + "/query"
    # (_connect_to_prefiller_bootstrap), so the address is a base URL; the port defaults to
    # VLLM_MOONCAKE_BOOTSTRAP_PORT (8998, vllm/envs.py).
    p = inst("p-up", "prefill", "MooncakeConnector", url="http://10.1.2.3:8211", kv_port=9100)
    p_params, d_params = router_pull_params(p, "r1-xyz")
    assert p_params == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "r1-xyz"}
    assert d_params == {
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "r1-xyz",
        "remote_engine_id": "p-up", "remote_bootstrap_addr": "http://10.1.2.3:9100",
    }
    assert bootstrap_addr(inst("p", "prefill", "MooncakeConnector", url="http://[fd00::5]:8211")) == (
        f"http://[fd00::5]:{MOONCAKE_BOOTSTRAP_PORT}"
    )


# -- upstream vLLM MooncakeConnector: the router supplies both legs' params ----------------


def mooncake_pair(p: LiveServer, d: LiveServer) -> Placed:
    # The simulator's bootstrap registry is its HTTP port: the record's KV port says so.
    return Placed(
        inst(MOONCAKE_PREFILL_ENGINE_ID, "prefill", "MooncakeConnector", url=p.url, kv_port=p.port),
        inst("mooncake-decode", "decode", "MooncakeConnector", url=d.url),
    )


async def test_handoff_over_upstream_mooncake_supplies_the_transfer_and_accepts_a_null_answer(
    http: httpx.AsyncClient, engine_http: Http11Client, load: LoadTracker, union: LiveServer,
    mooncake_prefill: LiveServer, mooncake_decode: LiveServer,
) -> None:
    engines = RecordingEngines(engine_http)
    placed = mooncake_pair(mooncake_prefill, mooncake_decode)
    before = (await kv_stats(http, mooncake_decode))["prompt_tokens_by_source"].get("external_kv_transfer", 0)
    held = (await kv_stats(http, mooncake_prefill))["kv"]["held"]

    response = await run(router_pd_context(engines, "r1", placed, load=load), placed, request())

    assert response["choices"][0]["token_ids"] == await reference(http, union)
    (_, p_req), (_, d_req) = engines.sent
    assert engines.answers[0]["kv_transfer_params"] is None  # what upstream Mooncake's P answers
    p_kv, d_kv = p_req["kv_transfer_params"], d_req["kv_transfer_params"]
    assert p_kv["do_remote_decode"] is True and p_kv["transfer_id"].startswith("r1-")
    assert d_kv == {
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": p_kv["transfer_id"],
        "remote_engine_id": MOONCAKE_PREFILL_ENGINE_ID, "remote_bootstrap_addr": mooncake_prefill.url,
    }
    # D pulled the whole prompt from P, and P freed the blocks it held for that transfer.
    after = (await kv_stats(http, mooncake_decode))["prompt_tokens_by_source"]["external_kv_transfer"]
    assert after - before == len(PROMPT)
    assert (await kv_stats(http, mooncake_prefill))["kv"]["held"] == held
    assert engines.aborted == []


async def test_each_upstream_mooncake_handoff_gets_its_own_transfer_id(
    http: httpx.AsyncClient, engine_http: Http11Client, load: LoadTracker, mooncake_prefill: LiveServer, mooncake_decode: LiveServer,
) -> None:
    # P keeps blocks under the transfer id until a D pulls them: two requests under one client
    # request id must never share one (a D would read another request's KV).
    engines = RecordingEngines(engine_http)
    placed = mooncake_pair(mooncake_prefill, mooncake_decode)
    for _ in range(2):
        await run(router_pd_context(engines, "r2", placed, load=load), placed, request("r2", max_tokens=2))
    ids = [req["kv_transfer_params"]["transfer_id"] for name, req in engines.sent if name == placed.prefill.name]
    assert len(set(ids)) == 2


async def test_an_upstream_mooncake_pair_failing_its_pull_blames_decode(
    http: httpx.AsyncClient, engine_http: Http11Client, load: LoadTracker, mooncake_prefill: LiveServer, mooncake_decode: LiveServer,
) -> None:
    # P's record names another engine id than P was launched with: D's pull is refused (vLLM:
    # "remote engine_id ... not found from bootstrap server") and the attempt fails on D.
    placed = mooncake_pair(mooncake_prefill, mooncake_decode)
    placed = Placed(dataclasses.replace(placed.prefill, name="renamed-prefill"), placed.decode)
    engines = RecordingEngines(engine_http)
    with pytest.raises(EngineError) as info:
        await run(router_pd_context(engines, "r3", placed, load=load), placed, request("r3"))
    assert info.value.instance == placed.decode.name


# -- vllm-ascend MooncakeConnectorV1: P returns D's params -----------------------------------


def ascend_prefill_answer() -> dict[str, Any]:
    """A prefill leg's answer as vllm-ascend 0.23.0.post1's pull connector returns it:
    ``MooncakeConnectorScheduler.request_finished`` in
    vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_connector.py (docs/ascend-connectors.md,
    "Pull", step 2); ids, hosts and sizes illustrative."""
    return {
        "request_id": "generate-tokens-r4-prefill", "model": MODEL, "created": 1767225600,
        "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": 1, "total_tokens": len(PROMPT) + 1},
        "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [77], "logprobs": None}],
        "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4, 5, 6]],
            "remote_engine_id": "ascend-p-engine", "remote_request_id": "generate-tokens-r4-prefill-8f3a2b1c0",
            "remote_host": "10.0.0.2", "remote_port": 36000, "remote_pcp_size": 1, "remote_dcp_size": 1,
            "remote_ptp_size": 8, "last_token_id": 77, "remote_multi_nodes_meta_mapping": {},
            "num_prompt_blocks": 4, "remote_block_size": 16,
        },
    }


async def test_handoff_over_ascend_mooncake_hands_p_answer_to_d_verbatim(
    http: httpx.AsyncClient, engine_http: Http11Client, load: LoadTracker, decode: LiveServer,
) -> None:
    canned = ascend_prefill_answer()
    engines = RecordingEngines(engine_http, canned=canned)
    p = inst("ascend-p", "prefill", "MooncakeConnectorV1")
    d = inst("ascend-d", "decode", "MooncakeConnectorV1", url=decode.url)

    # The simulated D cannot pull from an Ascend P: it refuses the params (500), after they
    # reached it. What matters here is what was sent.
    with pytest.raises(EngineError):
        await run(router_pd_context(engines, "r4", Placed(p, d), load=load), Placed(p, d), request("r4"))

    (_, p_req), (_, d_req) = engines.sent
    # The pull proxy's prefill params (build_prefill_request): only do_remote_decode is read.
    assert p_req["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert "transfer_id" not in p_req["kv_transfer_params"]
    assert d_req["kv_transfer_params"] is canned["kv_transfer_params"]  # the same object, every field


async def test_an_ascend_mooncake_prefill_answering_null_is_prefill_fault(
    http: httpx.AsyncClient, engine_http: Http11Client, load: LoadTracker, decode: LiveServer,
) -> None:
    # vllm-ascend's P returns no params when the request did not end length-capped (aborted,
    # stopped): there is no KV to hand off, and D is never called with invented params.
    canned = ascend_prefill_answer() | {"kv_transfer_params": None}
    engines = RecordingEngines(engine_http, canned=canned)
    p, d = inst("ascend-p", "prefill", "MooncakeConnectorV1"), inst("ascend-d", "decode", "MooncakeConnectorV1", url=decode.url)
    with pytest.raises(EngineError) as info:
        await run(router_pd_context(engines, "r5", Placed(p, d), load=load), Placed(p, d), request("r5"))
    assert info.value.instance == p.name
    assert [name for name, _ in engines.sent] == [p.name]
