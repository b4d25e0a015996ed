"""Prefill / decode roles of the simulator: pull (Handoff), push (Trigger), prefix cache."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from enginesim import EngineRole, SimConfig
from enginesim.testing import LiveServer, eventually, gen_body
from tests.pd_sims import MOONCAKE_PREFILL_ENGINE_ID, mooncake_sim_fixtures, pd_sim_fixtures, sim_server

GENERATE = "/inference/v1/generate"
CONFIG = SimConfig(
    served_model_names=("tiny",),
    vocab_size=512,
    eos_token_ids=(2,),
    special_token_ids=frozenset({0, 1, 2, 3}),
    max_model_len=4096,
    block_size=16,
)
PROMPT = list(range(10, 60))  # 50 tokens: three full blocks of 16 and a partial one
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def _server(**changes: Any) -> Iterator[LiveServer]:
    yield from sim_server(CONFIG, **changes)


union, prefill, decode, push_prefill, push_decode = pd_sim_fixtures(CONFIG, push_timeout_s=1.0)
mooncake_prefill, mooncake_decode = mooncake_sim_fixtures(CONFIG)


@pytest.fixture(autouse=True)
def _nothing_leaked(
    prefill: LiveServer, decode: LiveServer, push_prefill: LiveServer, push_decode: LiveServer,
    mooncake_prefill: LiveServer, mooncake_decode: LiveServer,
) -> Iterator[None]:
    """Every test ends with no blocks held for a pull and no decode waiting for a push."""
    yield
    for server in (prefill, decode, push_prefill, push_decode, mooncake_prefill, mooncake_decode):
        kv = server.engine.kv
        assert (kv.held, kv.waiting, server.engine.running) == (0, 0, 0), server.url


@pytest.fixture
async def http() -> Any:
    async with httpx.AsyncClient(timeout=10.0) as client:
        yield client


def body(prompt: list[int], max_tokens: int, params: dict[str, Any] | None, rid: str = "r1") -> dict[str, Any]:
    sampling = {"max_tokens": max_tokens, "ignore_eos": True}
    return gen_body(prompt, sampling, request_id=rid, kv_transfer_params=params)


async def stats(http: httpx.AsyncClient, server: LiveServer) -> dict[str, Any]:
    return (await http.get(server.url + "/sim/stats")).json()


async def handoff_params(http: httpx.AsyncClient, prefill: LiveServer, prompt: list[int]) -> dict[str, Any]:
    response = await http.post(prefill.url + GENERATE, json=body(prompt, 1, PREFILL_PARAMS, "p"))
    assert response.status_code == 200, response.text
    params = response.json()["kv_transfer_params"]
    assert isinstance(params, dict)
    return params


# -- pull (Handoff) -------------------------------------------------------------------


async def test_it_hands_off_a_prefill_to_a_decode_instance(
    http: httpx.AsyncClient, union: LiveServer, prefill: LiveServer, decode: LiveServer
) -> None:
    params = await handoff_params(http, prefill, PROMPT)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", prefill.port)
    assert params["remote_engine_id"] == (await stats(http, prefill))["kv"]["engine_id"]
    assert params["remote_num_tokens"] == len(PROMPT) and params["tp_size"] == 1
    assert len(params["remote_block_ids"][0]) == 4
    assert (await stats(http, prefill))["kv"]["held"] >= 1
    before = (await stats(http, decode))["prompt_tokens_by_source"]

    response = await http.post(decode.url + GENERATE, json=body(PROMPT, 12, params))
    assert response.status_code == 200, response.text
    reference = await http.post(union.url + GENERATE, json=body(PROMPT, 12, None))
    assert response.json()["choices"][0]["token_ids"] == reference.json()["choices"][0]["token_ids"]
    after = (await stats(http, decode))["prompt_tokens_by_source"]
    # D computed no prompt token itself: all of them came over the "transfer".
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == len(PROMPT)
    assert after.get("local_compute", 0) == before.get("local_compute", 0)
    assert (await stats(http, prefill))["kv"]["held"] == 0

    # P freed the blocks after the pull: the same params again are refused.
    again = await http.post(decode.url + GENERATE, json=body(PROMPT, 12, params))
    assert again.status_code == 500
    assert "no blocks held" in again.json()["error"]["message"]


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda p, other: {**p, "remote_request_id": "made-up"}, id="unknown-request"),
        pytest.param(lambda p, other: {**p, "remote_port": other.port}, id="wrong-port"),
        pytest.param(lambda p, other: {**p, "remote_engine_id": "sim-000"}, id="wrong-engine"),
        pytest.param(lambda p, other: {**p, "remote_block_ids": [[0]]}, id="wrong-blocks"),
    ],
)
async def test_it_refuses_forged_transfer_params(
    http: httpx.AsyncClient, prefill: LiveServer, decode: LiveServer, union: LiveServer, forge: Any
) -> None:
    params = await handoff_params(http, prefill, PROMPT)
    response = await http.post(decode.url + GENERATE, json=body(PROMPT, 4, forge(params, union)))
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "InternalServerError"
    assert error["message"].startswith("Internal server error: KV transfer failed (")
    # The genuine params still work: a forged pull frees nothing.
    assert (await http.post(decode.url + GENERATE, json=body(PROMPT, 4, params))).status_code == 200


async def test_it_refuses_params_for_another_prompt_length(
    http: httpx.AsyncClient, prefill: LiveServer, decode: LiveServer
) -> None:
    params = await handoff_params(http, prefill, PROMPT)
    response = await http.post(decode.url + GENERATE, json=body(PROMPT + [7], 4, params))
    assert response.status_code == 500
    assert "tokens requested" in response.json()["error"]["message"]
    assert (await http.post(decode.url + GENERATE, json=body(PROMPT, 4, params))).status_code == 200


@pytest.mark.parametrize(
    "params", [{"do_remote_prefill": True}, {"do_remote_prefill": True, "remote_host": "127.0.0.1"}]
)
async def test_it_explains_why_partial_params_fail(
    http: httpx.AsyncClient, decode: LiveServer, params: dict[str, Any]
) -> None:
    response = await http.post(decode.url + GENERATE, json=body(PROMPT, 4, params))
    assert response.status_code == 500
    message = response.json()["error"]["message"]
    assert "remote_engine_id" in message and "verbatim" in message


async def test_it_refuses_params_naming_an_unreachable_prefill(
    http: httpx.AsyncClient, prefill: LiveServer, decode: LiveServer
) -> None:
    params = await handoff_params(http, prefill, PROMPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    response = await http.post(decode.url + GENERATE, json=body(PROMPT, 4, {**params, "remote_port": closed}))
    assert response.status_code == 500 and "cannot reach" in response.json()["error"]["message"]
    assert (await http.post(decode.url + GENERATE, json=body(PROMPT, 4, params))).status_code == 200


async def test_it_frees_unclaimed_blocks_after_the_hold_time(http: httpx.AsyncClient, decode: LiveServer) -> None:
    for short in _server(role=EngineRole.PREFILL, kv_hold_seconds=0.05):
        params = await handoff_params(http, short, PROMPT)

        async def freed(server: LiveServer = short) -> bool:
            return (await stats(http, server))["kv"]["expired"] == 1

        await eventually(freed)
        response = await http.post(decode.url + GENERATE, json=body(PROMPT, 4, params))
        assert response.status_code == 500


async def test_it_keeps_the_union_protocol_unchanged(http: httpx.AsyncClient, union: LiveServer) -> None:
    response = await http.post(union.url + GENERATE, json=body(PROMPT, 1, PREFILL_PARAMS))
    assert response.status_code == 200 and response.json()["kv_transfer_params"] is None
    forged = await http.post(union.url + GENERATE, json=body(PROMPT, 1, {"do_remote_prefill": True}))
    assert forged.status_code == 200


# -- pull, router-supplied (upstream vLLM MooncakeConnector) ----------------------------
# Bodies from vLLM 0.33.0's vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py:
# P needs do_remote_decode and a transfer_id (update_state_after_alloc) and returns no params
# (request_finished); D needs do_remote_prefill, remote_engine_id, remote_bootstrap_addr and the
# same transfer_id (update_state_after_alloc), and GETs remote_bootstrap_addr + "/query".


def mooncake_params(p: LiveServer, transfer_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    p_params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    d_params = {
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer_id,
        "remote_engine_id": MOONCAKE_PREFILL_ENGINE_ID, "remote_bootstrap_addr": p.url,
    }
    return p_params, d_params


async def test_it_hands_off_with_router_supplied_mooncake_params(
    http: httpx.AsyncClient, union: LiveServer, mooncake_prefill: LiveServer, mooncake_decode: LiveServer
) -> None:
    p_params, d_params = mooncake_params(mooncake_prefill, "t-1")
    answer = await http.post(mooncake_prefill.url + GENERATE, json=body(PROMPT, 1, p_params, "p"))
    assert answer.status_code == 200 and answer.json()["kv_transfer_params"] is None
    assert (await stats(http, mooncake_prefill))["kv"]["held"] == 1
    before = (await stats(http, mooncake_decode))["prompt_tokens_by_source"].get("external_kv_transfer", 0)

    response = await http.post(mooncake_decode.url + GENERATE, json=body(PROMPT, 12, d_params))

    assert response.status_code == 200, response.text
    reference = await http.post(union.url + GENERATE, json=body(PROMPT, 12, None))
    assert response.json()["choices"][0]["token_ids"] == reference.json()["choices"][0]["token_ids"]
    after = (await stats(http, mooncake_decode))["prompt_tokens_by_source"]["external_kv_transfer"]
    assert after - before == len(PROMPT)
    assert (await stats(http, mooncake_prefill))["kv"]["held"] == 0
    again = await http.post(mooncake_decode.url + GENERATE, json=body(PROMPT, 4, d_params))
    assert again.status_code == 500 and "no blocks held for transfer 't-1'" in again.json()["error"]["message"]


@pytest.mark.parametrize(
    ("forge", "why"),
    [
        pytest.param({"transfer_id": "t-other"}, "no blocks held", id="other-transfer"),
        pytest.param({"remote_engine_id": "someone-else"}, "engine id", id="wrong-engine"),
        pytest.param({"remote_bootstrap_addr": "127.0.0.1:1"}, "base URL", id="not-a-url"),
    ],
)
async def test_it_refuses_forged_mooncake_params(
    http: httpx.AsyncClient, mooncake_prefill: LiveServer, mooncake_decode: LiveServer,
    forge: dict[str, Any], why: str,
) -> None:
    p_params, d_params = mooncake_params(mooncake_prefill, "t-2")
    assert (await http.post(mooncake_prefill.url + GENERATE, json=body(PROMPT, 1, p_params, "p"))).status_code == 200
    response = await http.post(mooncake_decode.url + GENERATE, json=body(PROMPT, 4, {**d_params, **forge}))
    assert response.status_code == 500 and why in response.json()["error"]["message"]
    assert (await http.post(mooncake_decode.url + GENERATE, json=body(PROMPT, 4, d_params))).status_code == 200


async def test_a_mooncake_decode_without_router_params_prefills_itself(
    http: httpx.AsyncClient, mooncake_prefill: LiveServer, mooncake_decode: LiveServer
) -> None:
    # What P returned in the other contract is not enough here: upstream Mooncake's D logs
    # "Got invalid KVTransferParams" and computes the prompt itself, so nothing is transferred.
    before = (await stats(http, mooncake_decode))["prompt_tokens_by_source"]
    response = await http.post(mooncake_decode.url + GENERATE, json=body(PROMPT, 4, {"do_remote_prefill": True}))
    assert response.status_code == 200
    after = (await stats(http, mooncake_decode))["prompt_tokens_by_source"]
    assert after.get("external_kv_transfer", 0) == before.get("external_kv_transfer", 0)
    # And a P given no transfer id keeps nothing for a pull (the real one only warns).
    no_id = await http.post(mooncake_prefill.url + GENERATE, json=body(PROMPT, 1, PREFILL_PARAMS, "p"))
    assert no_id.status_code == 200 and no_id.json()["kv_transfer_params"] is None
    assert (await stats(http, mooncake_prefill))["kv"]["held"] == 0


# -- push (Trigger) -------------------------------------------------------------------


class Metaserver:
    """The coordinator's side of the Trigger contract, minimal: on D's announcement, send
    the prefill to P with D's fields (see enginesim.pd)."""

    def __init__(self, prefill_url: str | None, status: int = 200) -> None:
        self.prefill_url = prefill_url
        self.status = status
        self.announcements: list[dict[str, Any]] = []
        # Set (from the server thread) on the first announcement: D is waiting for the push.
        self.announced = threading.Event()
        self.prefill_answers: list[httpx.Response] = []
        self._tasks: set[asyncio.Task[None]] = set()
        app = Starlette(routes=[Route("/meta/{token}", self.announce, methods=["POST"])])
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/meta/secret-token"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> Metaserver:
        self._thread.start()
        while not self._server.started:
            threading.Event().wait(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()

    async def announce(self, request: Request) -> Response:
        data = await request.json()
        data["path_token"] = request.path_params["token"]
        self.announcements.append(data)
        self.announced.set()
        if self.status == 200 and self.prefill_url is not None:
            task = asyncio.create_task(self._dispatch(data))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return JSONResponse({}, status_code=self.status)

    async def _dispatch(self, d: dict[str, Any]) -> None:
        # What vllm-ascend's layer-wise proxy does: the callback whole as P's params, under D's
        # request id (P's push names D's request by P's own id).
        params = {**d, "do_remote_decode": True}
        params.pop("path_token")
        rid = d["request_id"].removeprefix("generate-tokens-")
        async with httpx.AsyncClient(timeout=10.0) as client:
            assert self.prefill_url is not None
            self.prefill_answers.append(
                await client.post(self.prefill_url + GENERATE, json=body(PROMPT, 1, params, rid))
            )


# The keys vllm-ascend 0.23.0.post1's decode side posts to the metaserver
# (kv_p2p/mooncake_layerwise_connector.py, update_state_after_alloc).
ASCEND_CALLBACK_KEYS = {
    "token_ids", "request_id", "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_block_size",
    "remote_engine_id", "remote_host", "remote_port", "remote_tp_size", "remote_pcp_size", "remote_dcp_size",
    "remote_cached_tokens",
}


async def test_it_decodes_after_a_push_triggered_through_the_metaserver(
    http: httpx.AsyncClient, union: LiveServer, push_prefill: LiveServer, push_decode: LiveServer
) -> None:
    with Metaserver(push_prefill.url) as meta:
        params = {"do_remote_prefill": True, "metaserver": meta.url, "coordinator_token": "abc"}
        response = await http.post(push_decode.url + GENERATE, json=body(PROMPT, 12, params, "d1"))
    assert response.status_code == 200, response.text
    reference = await http.post(union.url + GENERATE, json=body(PROMPT, 12, None))
    assert response.json()["choices"][0]["token_ids"] == reference.json()["choices"][0]["token_ids"]
    (announced,) = meta.announcements
    # The real D's body, built by D: nothing it received is echoed (the token travels in the URL).
    assert announced.pop("path_token") == "secret-token"
    assert set(announced) == ASCEND_CALLBACK_KEYS
    assert announced["request_id"] == "generate-tokens-d1" and announced["token_ids"] == []
    assert (announced["do_remote_prefill"], announced["do_remote_decode"]) == (False, True)
    assert (announced["remote_host"], announced["remote_port"]) == ("127.0.0.1", push_decode.port)
    assert announced["remote_block_size"] == [CONFIG.block_size] and announced["remote_cached_tokens"] == 0
    assert len(announced["remote_block_ids"][0]) == -(-len(PROMPT) // CONFIG.block_size)
    (prefill_answer,) = meta.prefill_answers
    assert prefill_answer.status_code == 200 and prefill_answer.json()["kv_transfer_params"] is None
    kv = (await stats(http, push_decode))["kv"]
    assert kv["waiting"] == 0 and kv["pushed"] >= 1
    assert (await stats(http, push_decode))["prompt_tokens_by_source"]["external_kv_transfer"] >= len(PROMPT)


@pytest.mark.parametrize("status", [403, 500])
async def test_it_fails_the_decode_when_the_metaserver_refuses(
    http: httpx.AsyncClient, push_decode: LiveServer, status: int
) -> None:
    with Metaserver(None, status=status) as meta:
        params = {"do_remote_prefill": True, "metaserver": meta.url}
        response = await http.post(push_decode.url + GENERATE, json=body(PROMPT, 4, params, "d2"))
    assert response.status_code == 500
    assert f"metaserver answered {status}" in response.json()["error"]["message"]
    assert (await stats(http, push_decode))["kv"]["waiting"] == 0


async def test_it_gives_up_when_no_push_arrives(http: httpx.AsyncClient, push_decode: LiveServer) -> None:
    with Metaserver(None) as meta:  # accepts, never dispatches a prefill
        params = {"do_remote_prefill": True, "metaserver": meta.url}
        response = await http.post(push_decode.url + GENERATE, json=body(PROMPT, 4, params, "d3"))
    assert response.status_code == 500 and "no KV pushed" in response.json()["error"]["message"]
    assert (await stats(http, push_decode))["kv"]["waiting"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_it_releases_a_decode_waiting_for_a_push_when_aborted(
    http: httpx.AsyncClient, push_decode: LiveServer, stream: bool
) -> None:
    rid = f"d-abort-{stream}"
    with Metaserver(None) as meta:  # accepts, never dispatches: only the abort can end it
        params = {"do_remote_prefill": True, "metaserver": meta.url}
        request = body(PROMPT, 4, params, rid) | {"stream": stream}
        answer = asyncio.create_task(http.post(push_decode.url + GENERATE, json=request))
        assert await asyncio.to_thread(meta.announced.wait, 5.0), "D never announced itself"
        abort = await http.post(
            push_decode.url + "/inference/v1/abort_requests", json={"request_ids": [f"generate-tokens-{rid}"]}
        )
        assert abort.status_code == 200
        # Before the 1 s push timeout, which would answer 500 "no KV pushed" instead.
        response = await answer
    assert response.status_code == 200, response.text
    if stream:
        frames = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
        assert frames[-1] == "[DONE]"
        choices = [json.loads(frame)["choices"][0] for frame in frames[:-1]]
        assert [(c["token_ids"], c["finish_reason"]) for c in choices] == [([], "abort")]
    else:
        (choice,) = response.json()["choices"]
        assert (choice["token_ids"], choice["finish_reason"]) == ([], "abort")
    state = await stats(http, push_decode)
    assert state["kv"]["waiting"] == 0 and state["aborted"] >= 1 and state["finished"]["abort"] >= 1
    # A push arriving after the abort finds nobody waiting.
    late = {"request_id": f"generate-tokens-{rid}", "remote_engine_id": state["kv"]["engine_id"]}
    assert (await http.post(push_decode.url + "/sim/kv/push", json=late)).status_code == 404


async def test_it_requires_a_metaserver_in_push_mode(http: httpx.AsyncClient, push_decode: LiveServer) -> None:
    response = await http.post(push_decode.url + GENERATE, json=body(PROMPT, 4, {"do_remote_prefill": True}))
    assert response.status_code == 500 and "metaserver" in response.json()["error"]["message"]


async def test_it_refuses_a_push_nobody_waits_for(
    http: httpx.AsyncClient, push_prefill: LiveServer, push_decode: LiveServer
) -> None:
    forged = await http.post(push_decode.url + "/sim/kv/push", json={"request_id": "nope"})
    assert forged.status_code == 404
    params = {
        **PREFILL_PARAMS,
        "remote_host": "127.0.0.1",
        "remote_port": push_decode.port,
        "remote_cached_tokens": 0,
    }
    # P pushes under its own request id, which no decode request waits for.
    response = await http.post(push_prefill.url + GENERATE, json=body(PROMPT, 1, params, "nope"))
    assert response.status_code == 500 and "refused the push" in response.json()["error"]["message"]


async def test_a_push_prefill_needs_remote_cached_tokens_like_the_real_one(
    http: httpx.AsyncClient, push_prefill: LiveServer, push_decode: LiveServer
) -> None:
    # vllm-ascend's P indexes params["remote_cached_tokens"]: a coordinator that picks keys out
    # of D's callback and drops this one crashes it. The simulator refuses it the same way.
    params = {**PREFILL_PARAMS, "remote_host": "127.0.0.1", "remote_port": push_decode.port}
    response = await http.post(push_prefill.url + GENERATE, json=body(PROMPT, 1, params))
    assert response.status_code == 500 and "remote_cached_tokens" in response.json()["error"]["message"]


# -- prefix cache ---------------------------------------------------------------------


async def test_it_counts_cached_prefix_blocks_as_hits(http: httpx.AsyncClient, union: LiveServer) -> None:
    await http.delete(union.url + "/sim/cache")
    prefix = list(range(100, 148))  # three blocks of 16
    first = await stats(http, union)
    await http.post(union.url + GENERATE, json=body(prefix + [5, 6, 7], 1, None))
    await http.post(union.url + GENERATE, json=body(prefix + [8, 9], 1, None))
    after = await stats(http, union)
    hits = after["prompt_tokens_by_source"]["local_cache_hit"] - first["prompt_tokens_by_source"].get(
        "local_cache_hit", 0
    )
    assert hits == 48
    metrics = (await http.get(union.url + "/metrics")).text
    assert 'vllm:cache_config_info{block_size="16"' in metrics


def test_it_charges_prefill_time_only_for_uncached_tokens() -> None:
    from enginesim.engine import SimEngine
    from enginesim.protocol import GenerateRequest

    engine = SimEngine(dataclasses.replace(CONFIG, ttft_per_token_ms=1.0))
    request = GenerateRequest.model_validate(body(PROMPT, 1, None))
    cold = engine.start("a", request)
    warm = engine.start("b", request)
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 48)
    assert cold._ttft == pytest.approx(0.050) and warm._ttft == pytest.approx(0.002)
    remote = engine.start("c", GenerateRequest.model_validate(body([7] * 40, 1, None)), remote_kv=True)
    assert remote._ttft == 0
