"""Issue 33, finding 1: the native path on a fleet of prefill/decode pairs only.

The vllm-ascend guide's proxy flow at the OpenAI level: the client's body to P's own API with one
output token and ``do_remote_decode``, then to D's own API with the ``kv_transfer_params`` P
answered, verbatim; D's answer is the client's. Through the real servers (Daphne and uvicorn on a
127.0.0.1 socket) against live simulators (their own OpenAI API, ``enginesim.openai_api``), each
answer compared with a union simulator's own answer to the same body (the simulators' output is a
function of seed and context, like greedy decoding). Render-off traffic, Responses and Messages,
streaming and not; what a pair cannot serve exactly is a 503 that says why; nothing is held after.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from catalog.models import RenderConfig, ServedModel
from enginesim import SimConfig
from enginesim.faults import Fault, FaultMode
from enginesim.testing import LiveServer, eventually
from fleet.models import EngineInstance
from serving import runtime, snapshots
from serving.pipeline.errors import QueueFull, RequestError
from serving.pipeline.topologies import metaserver as metaserver_module
from serving.pipeline.topologies.metaserver import MetaServer
from serving.pipeline.topologies.native_pd import decode_body, native_pd_ineligible, prefill_body
from serving.pipeline.topologies.native_prompts import merge_whole, split_prompts, sum_usage
from tests.pd_sims import pd_sim_fixtures
from tests.serving.fakes import MODEL
from tests.serving.live_edge import error_of
from tests.serving.router_fakes import Rig, engine, snapshot_with

pytestmark = pytest.mark.django_db(transaction=True)

CONFIG = SimConfig(
    served_model_names=(MODEL,), vocab_size=152_000, eos_token_ids=(2,), special_token_ids=frozenset({0, 1, 2, 3}),
    max_model_len=4096, block_size=16,
)
union, prefill, decode, push_prefill, push_decode = pd_sim_fixtures(CONFIG, push_timeout_s=5.0)


@pytest.fixture
def pd_only(
    transactional_db: None, prefill: LiveServer, decode: LiveServer, union: LiveServer, settings: Any
) -> Iterator[tuple[LiveServer, LiveServer]]:
    """A fleet of one P/D pair (NIXL pull) serving token-only generate and their own OpenAI API,
    render off; the union simulator is no part of it (the reference answers come from it directly)."""
    settings.MOTOR_API_KEYS = []
    settings.MOTOR_OPEN_ACCESS = True
    model = ServedModel.objects.create(name=MODEL, model_path="/models/tiny", max_model_len=4096, vocab_size=152_000)
    RenderConfig.objects.create(host="127.0.0.1", port=9, enable=False)
    for role, server in (("prefill", prefill), ("decode", decode)):
        EngineInstance.objects.create(
            name=f"{role}-1", url=server.url, served_model=model, role=role, kind="sim", cap_native_openai=True,
            cap_tokenizer=True, kv_connector="NixlConnector", kv_transfer="pull",
        )
    for server in (prefill, decode, union):
        server.reset()
    snapshots.invalidate()
    yield prefill, decode
    snapshots.invalidate()


async def assert_nothing_held(*servers: LiveServer) -> None:
    async def idle() -> bool:
        return (runtime.inflight_tokens() == {} and runtime.load.snapshot() == {}
                and all(s.engine.stats.active_streams == 0 and s.engine.running == 0 for s in servers))

    await eventually(idle)


async def post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=30) as client:
        return await client.post(path, json=body)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about prefill and decode."}],
            "max_tokens": 12, "temperature": 0, **extra}


def streamed_text(path: str, raw: bytes) -> str:
    """The text of an SSE answer in the API's own stream format."""
    text = ""
    for block in raw.decode().split("\n\n"):
        data = next((line[6:] for line in block.split("\n") if line.startswith("data: ")), None)
        if data is None or data == "[DONE]":
            continue
        event = json.loads(data)
        if path == "/v1/chat/completions":
            text += "".join(c["delta"].get("content") or "" for c in event["choices"])
        elif path == "/v1/completions":
            text += "".join(c["text"] for c in event["choices"])
        elif event.get("type") == "response.output_text.delta":
            text += event["delta"]
        elif event.get("type") == "content_block_delta":
            text += event["delta"]["text"]
    return text


def whole_text(path: str, answer: dict[str, Any]) -> str:
    if path == "/v1/chat/completions":
        return str(answer["choices"][0]["message"]["content"])
    if path == "/v1/completions":
        return str(answer["choices"][0]["text"])
    if path == "/v1/responses":
        return str(answer["output"][0]["content"][0]["text"])
    return str(answer["content"][0]["text"])


BODIES = [
    ("/v1/chat/completions", chat()),
    ("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}),
    ("/v1/responses", {"model": MODEL, "input": "What is KV transfer?", "max_output_tokens": 9}),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 11}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("path", "body"), BODIES, ids=[p.rsplit("/", 1)[1] for p, _ in BODIES])
async def test_a_pd_only_fleet_serves_the_native_path_through_the_guides_proxy_flow(
    served: str, pd_only: tuple[LiveServer, LiveServer], union: LiveServer, path: str, body: dict[str, Any],
    stream: bool,
) -> None:
    p, d = pd_only
    body = {**body, "stream": stream}
    ours = await post(served, path, body)
    theirs = await post(union.url, path, body)
    assert ours.status_code == 200, ours.text
    if stream:
        assert ours.headers["content-type"].startswith("text/event-stream")
        assert streamed_text(path, ours.content) == streamed_text(path, theirs.content) != ""
    else:
        answer = ours.json()
        assert whole_text(path, answer) == whole_text(path, theirs.json()) != ""
        assert answer["usage"] == theirs.json()["usage"]
        assert answer.get("kv_transfer_params") is None  # D's connector params stay inside
    # P prefilled once (one token, non-streaming), D decoded once with the whole prompt from P's KV.
    assert (p.engine.stats.requests_received, d.engine.stats.requests_received) == (1, 1)
    by_source = d.engine.stats.prompt_tokens_by_source
    assert by_source["external_kv_transfer"] > 0 and by_source["local_compute"] == 0
    await assert_nothing_held(p, d, union)


async def test_a_stream_with_usage_counts_like_the_union_engine(
    served: str, pd_only: tuple[LiveServer, LiveServer], union: LiveServer
) -> None:
    body = chat(stream=True, stream_options={"include_usage": True})
    ours, theirs = await post(served, "/v1/chat/completions", body), await post(union.url, "/v1/chat/completions", body)

    def usage(raw: bytes) -> Any:
        frames = [json.loads(b[6:]) for b in raw.decode().split("\n\n") if b.startswith("data: {")]
        return frames[-1]["usage"]

    assert ours.status_code == 200 and usage(ours.content) == usage(theirs.content)
    assert ours.content.endswith(b"data: [DONE]\n\n") and ours.content.count(b"[DONE]") == 1
    await assert_nothing_held(*pd_only)


async def test_what_a_pair_cannot_serve_exactly_is_a_503_saying_why(
    served: str, pd_only: tuple[LiveServer, LiveServer]
) -> None:
    p, d = pd_only
    error = error_of(await post(served, "/v1/chat/completions", chat(n=2)), 503)
    assert "prefill/decode pairs cannot serve it exactly (n>1)" in error["message"]
    assert p.engine.stats.requests_received == d.engine.stats.requests_received == 0
    await assert_nothing_held(p, d)


async def test_a_failed_prefill_never_reaches_decode(served: str, pd_only: tuple[LiveServer, LiveServer]) -> None:
    p, d = pd_only
    p.engine.faults.arm(_fault(), 5)
    error = error_of(await post(served, "/v1/chat/completions", chat()), 502)
    assert error["type"] == "BadGatewayError"
    assert p.engine.stats.requests_received == 1 and d.engine.stats.requests_received == 0
    await assert_nothing_held(p, d)


def _fault() -> Fault:
    return Fault(mode=FaultMode.HTTP_STATUS, status=500)


async def test_with_obfuscation_on_a_pd_pair_never_gets_the_native_path(rig: Rig) -> None:
    fleet = snapshot_with(
        engine("e1", role="prefill", native_openai=True, kv_transfer="pull", kv_connector="NixlConnector"),
        engine("e2", role="decode", native_openai=True, kv_transfer="pull", kv_connector="NixlConnector"),
        obfuscation=True,
    )
    with pytest.raises(RequestError) as info:
        await rig.pipeline(fleet).responses({"model": MODEL, "input": "hi", "previous_response_id": "r"}, "obf1")
    assert info.value.status == 400 and "obfuscation" in info.value.message
    assert rig.native.calls == [] and rig.upstreams.calls == []


async def test_a_decode_side_without_room_refuses_before_prefill_pins_kv(
    served: str, pd_only: tuple[LiveServer, LiveServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # D's holds are reserved before P prefills (as the token-only Handoff does): a full D refuses
    # the request while P has computed nothing it would keep pinned for a pull that never comes.
    p, d = pd_only
    acquire = runtime.admission.acquire

    async def full_decode(instance: Any, tokens: int, group: Any = None) -> Any:
        if instance.role == "decode":
            raise QueueFull("queue full", retry_after_s=2)
        return await acquire(instance, tokens, group)

    monkeypatch.setattr(runtime.admission, "acquire", full_decode)
    response = await post(served, "/v1/responses", BODIES[2][1])
    error_of(response, 429)
    assert response.headers["Retry-After"] == "2"
    assert p.engine.stats.requests_received == d.engine.stats.requests_received == 0
    await assert_nothing_held(p, d)


@pytest.mark.parametrize(("kind", "body", "field"), [
    ("chat", chat(stream=True, stream_options={"include_usage": True}, min_tokens=5), "max_completion_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 30, "stream": True}, "max_tokens"),
    ("responses", {"model": MODEL, "input": "x", "max_output_tokens": 30}, "max_output_tokens"),
    ("messages", {"model": MODEL, "messages": [], "max_tokens": 30}, "max_tokens"),
])
def test_the_prefill_leg_is_the_guides_one_token_whole_request(kind: Any, body: dict[str, Any], field: str) -> None:
    params = {"do_remote_decode": True, "do_remote_prefill": False}
    leg = prefill_body(kind, body, params)
    assert leg[field] == 1 and leg["stream"] is False and "stream_options" not in leg
    assert leg["kv_transfer_params"] is params
    if kind == "chat":
        assert "max_tokens" not in leg  # vLLM's chat reads max_completion_tokens first; one bound only
    assert leg.get("min_tokens", 1) == 1
    assert leg.get("store", False) is False
    answered = {"do_remote_prefill": True, "remote_engine_id": "p"}
    d_leg = decode_body(body, answered)
    assert d_leg["kv_transfer_params"] is answered and {k: v for k, v in d_leg.items() if k != "kv_transfer_params"} == body


@pytest.mark.parametrize(("kind", "body", "why"), [
    ("chat", chat(n=2), "n>1"),
    ("completions", {"model": MODEL, "prompt": "x", "best_of": 3}, "n>1"),
    ("chat", chat(prompt_logprobs=1), "prompt_logprobs"),
    ("completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, "prompt_logprobs"),
    ("completions", {"model": MODEL, "prompt": ["a", "b"]}, "several_prompts"),
    ("responses", {"model": MODEL, "input": "x", "background": True}, "background"),
    ("completions", {"model": MODEL, "prompt": [5, 6, 7], "echo": True}, ""),
    ("messages", {"model": MODEL, "messages": [], "max_tokens": 3}, ""),
])
def test_what_a_pair_cannot_serve_exactly(kind: Any, body: dict[str, Any], why: str) -> None:
    assert native_pd_ineligible(kind, body) == why


# -- several completion prompts: one pair run per prompt, merged as vLLM merges them ---------------

PROMPTS = {"model": MODEL, "prompt": ["Once upon a time", [104, 105, 106, 107], "KV moves from P to D"],
           "max_tokens": 7, "temperature": 0}


def streamed_choices(raw: bytes) -> tuple[dict[int, str], dict[int, str | None], list[dict[str, Any]]]:
    """A completion stream's text and finish reason per choice index, and its usage-only chunks."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage: list[dict[str, Any]] = []
    for block in raw.decode().split("\n\n"):
        if not block.startswith("data: {"):
            continue
        event = json.loads(block[6:])
        if not event["choices"]:
            usage.append(event["usage"])
        for c in event["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            finish[c["index"]] = c["finish_reason"] or finish.get(c["index"])
    return texts, finish, usage


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_completion_of_several_prompts_runs_one_pair_run_per_prompt_merged_as_vllm(
    served: str, pd_only: tuple[LiveServer, LiveServer], union: LiveServer, stream: bool
) -> None:
    # Render off on a P/D-only fleet: the native path is the pairs', which take one prompt per
    # body. Each prompt runs its own P/D flow; the answer is the union engine's to the same body.
    p, d = pd_only
    body = {**PROMPTS, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    ours = await post(served, "/v1/completions", body)
    theirs = await post(union.url, "/v1/completions", body)
    assert ours.status_code == 200, ours.text
    assert theirs.status_code == 200, theirs.text
    if stream:
        assert ours.content.endswith(b"data: [DONE]\n\n") and ours.content.count(b"[DONE]") == 1
        texts, finish, usage = streamed_choices(ours.content)
        assert (texts, finish, usage) == streamed_choices(theirs.content)
        assert sorted(texts) == [0, 1, 2] and all(texts.values()) and len(usage) == 1
        ids = {json.loads(b[6:])["id"] for b in ours.content.decode().split("\n\n") if b.startswith("data: {")}
        assert len(ids) == 1  # one response, whatever leg each chunk came from
    else:
        answer, reference = ours.json(), theirs.json()
        assert [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]] == [
            (c["index"], c["text"], c["finish_reason"]) for c in reference["choices"]]
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2] and all(c["text"] for c in answer["choices"])
        assert answer["usage"] == reference["usage"]
        assert answer.get("kv_transfer_params") is None
    # One P/D run per prompt, D computing no prompt token.
    assert (p.engine.stats.requests_received, d.engine.stats.requests_received) == (3, 3)
    by_source = d.engine.stats.prompt_tokens_by_source
    assert by_source["external_kv_transfer"] > 0 and by_source["local_compute"] == 0
    await assert_nothing_held(p, d, union)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_failing_prompt_fails_the_completion_and_frees_every_leg(
    served: str, pd_only: tuple[LiveServer, LiveServer], stream: bool
) -> None:
    # One prompt's prefill fails (its pair is then excluded: no route left for it); whatever its
    # siblings hold (P's call, D's reservation, D's stall) is cancelled and given back.
    p, d = pd_only
    p.engine.faults.arm(_fault(), 1)
    d.engine.faults.arm(Fault(mode=FaultMode.STALL_AFTER_TOKENS, tokens=0), 3)
    error = error_of(await post(served, "/v1/completions", {**PROMPTS, "stream": stream}), 502)
    assert error["type"] == "BadGatewayError"
    await assert_nothing_held(p, d)


async def test_a_prompt_failing_mid_stream_ends_the_merged_stream_once(
    served: str, pd_only: tuple[LiveServer, LiveServer]
) -> None:
    p, d = pd_only
    d.engine.faults.arm(Fault(mode=FaultMode.ERROR_EVENT_AFTER_TOKENS, tokens=2), 1)
    response = await post(served, "/v1/completions", {**PROMPTS, "stream": True, "max_tokens": 50})
    assert response.status_code == 200
    frames = [b for b in response.content.decode().split("\n\n") if b.startswith("data: ")]
    assert frames[-1] == "data: [DONE]" and response.content.count(b"[DONE]") == 1
    assert "error" in json.loads(frames[-2][6:])
    await assert_nothing_held(p, d)


@pytest.mark.parametrize("when", ["opening", "streaming"])
async def test_a_client_leaving_a_completion_of_several_prompts_frees_every_leg(
    served: str, pd_only: tuple[LiveServer, LiveServer], when: str
) -> None:
    # opening: one prompt's P never answers while its siblings' streams are open (held for the
    # response that never starts); streaming: one prompt's D stalls after a few tokens while the
    # client reads the merged stream. Either way every leg is closed when the client leaves.
    p, d = pd_only
    stalled = p if when == "opening" else d
    stalled.engine.faults.arm(Fault(mode=FaultMode.STALL_AFTER_TOKENS, tokens=0 if when == "opening" else 2), 1)
    body = {**PROMPTS, "stream": True, "max_tokens": 30}

    async def read() -> None:
        async with httpx.AsyncClient(base_url=served, trust_env=False, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for _ in response.aiter_raw():
                    pass

    request = asyncio.create_task(read())

    async def stuck() -> bool:
        if when == "opening":
            return p.engine.stats.requests_received == 3 and d.engine.stats.requests_received == 2
        return d.engine.stats.requests_received == 3 and d.engine.stats.active_streams == 1

    await eventually(stuck)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request

    async def let_go() -> bool:
        return stalled.engine.stats.disconnects >= 1

    await eventually(let_go)
    await assert_nothing_held(p, d)


def test_prompt_answers_merge_prompt_major_with_one_usage() -> None:
    def answer(prompt: int, tokens: int, cached: int | None) -> dict[str, Any]:
        details = None if cached is None else {"cached_tokens": cached}
        return {"id": f"cmpl-{prompt}", "object": "text_completion", "kv_transfer_params": {"x": 1},
                "choices": [{"index": 0, "text": f"t{prompt}", "finish_reason": "length"}],
                "usage": {"prompt_tokens": tokens, "completion_tokens": 2, "total_tokens": tokens + 2,
                          "prompt_tokens_details": details}}

    merged = merge_whole([answer(0, 5, None), answer(1, 7, 3), answer(2, 1, 1)], n=1)
    assert merged["id"] == "cmpl-0" and merged["kv_transfer_params"] is None
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "t0"), (1, "t1"), (2, "t2")]
    assert merged["usage"] == {"prompt_tokens": 13, "completion_tokens": 6, "total_tokens": 19,
                               "prompt_tokens_details": {"cached_tokens": 4}}
    # vLLM numbers a prompt's choices prompt * n + choice.
    two = {"choices": [{"index": 0}, {"index": 1}]}
    assert [c["index"] for c in merge_whole([two, two], n=2)["choices"]] == [0, 1, 2, 3]
    assert sum_usage([]) == {} and split_prompts({"prompt": ["a", [5]], "n": 1}) == [
        {"prompt": "a", "n": 1}, {"prompt": [5], "n": 1}]


# -- a P and a D that form no pair ----------------------------------------------------------------


@pytest.fixture
def unpaired(
    transactional_db: None, prefill: LiveServer, push_decode: LiveServer, settings: Any
) -> Iterator[tuple[LiveServer, LiveServer]]:
    """A pull prefill and a push decode, both serving their own OpenAI API, render off: no pair."""
    settings.MOTOR_API_KEYS = []
    settings.MOTOR_OPEN_ACCESS = True
    model = ServedModel.objects.create(name=MODEL, model_path="/models/tiny", max_model_len=4096, vocab_size=152_000)
    RenderConfig.objects.create(host="127.0.0.1", port=9, enable=False)
    for role, server, connector, transfer in (("prefill", prefill, "NixlConnector", "pull"),
                                              ("decode", push_decode, "MooncakeLayerwiseConnector", "push")):
        EngineInstance.objects.create(
            name=f"{role}-1", url=server.url, served_model=model, role=role, kind="sim", cap_native_openai=True,
            cap_tokenizer=True, kv_connector=connector, kv_transfer=transfer,
        )
    for server in (prefill, push_decode):
        server.reset()
    snapshots.invalidate()
    yield prefill, push_decode
    snapshots.invalidate()


@pytest.mark.parametrize(("path", "body", "status"), [
    # Stored state only an engine's own API has: never servable on this fleet (request_checks.unservable).
    ("/v1/responses", {**BODIES[2][1], "previous_response_id": "resp_1"}, 400),
    ("/v1/chat/completions", chat(), 503),  # render off: the native path finds no route
], ids=["responses", "chat"])
async def test_a_p_and_d_of_different_transfer_modes_are_refused_saying_so(
    served: str, unpaired: tuple[LiveServer, LiveServer], path: str, body: dict[str, Any], status: int
) -> None:
    # Both engines serve their own OpenAI API: the refusal says they form no pair, and why, not
    # that no engine serves its own API.
    error = error_of(await post(served, path, body), status)
    message = error["message"]
    assert "transfer KV by pull" in message and "by push" in message and "no prefill/decode pair forms" in message
    assert "no engine serves" not in message and "no engine of this model does" not in message
    assert all(s.engine.stats.requests_received == 0 for s in unpaired)
    await assert_nothing_held(*unpaired)


# -- push pairs (Trigger): D's own API first, P's on D's callback -----------------------------------


@pytest.fixture
def push_only(
    transactional_db: None, push_prefill: LiveServer, push_decode: LiveServer, union: LiveServer, settings: Any,
    served: str, monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[LiveServer, LiveServer, MetaServer]]:
    """A fleet of one push pair (the layer-wise connector's order) serving their own OpenAI API,
    render off; D calls the coordinator's real metaserver view back on the served socket."""
    settings.MOTOR_API_KEYS = []
    settings.MOTOR_OPEN_ACCESS = True
    metaserver = MetaServer(served)
    monkeypatch.setattr(metaserver_module, "_process", metaserver)
    model = ServedModel.objects.create(name=MODEL, model_path="/models/tiny", max_model_len=4096, vocab_size=152_000)
    RenderConfig.objects.create(host="127.0.0.1", port=9, enable=False)
    for role, server in (("prefill", push_prefill), ("decode", push_decode)):
        EngineInstance.objects.create(
            name=f"{role}-1", url=server.url, served_model=model, role=role, kind="sim", cap_native_openai=True,
            cap_tokenizer=True, kv_connector="MooncakeLayerwiseConnector", kv_transfer="push",
        )
    for server in (push_prefill, push_decode, union):
        server.reset()
    snapshots.invalidate()
    yield push_prefill, push_decode, metaserver
    snapshots.invalidate()
    assert metaserver.pending == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("path", "body"), BODIES, ids=[p.rsplit("/", 1)[1] for p, _ in BODIES])
async def test_a_trigger_only_fleet_serves_the_native_path_in_the_push_order(
    served: str, push_only: tuple[LiveServer, LiveServer, MetaServer], union: LiveServer, path: str,
    body: dict[str, Any], stream: bool,
) -> None:
    p, d, metaserver = push_only
    body = {**body, "stream": stream}
    ours = await post(served, path, body)
    theirs = await post(union.url, path, body)
    assert ours.status_code == 200, ours.text
    if stream:
        assert streamed_text(path, ours.content) == streamed_text(path, theirs.content) != ""
    else:
        assert whole_text(path, ours.json()) == whole_text(path, theirs.json()) != ""
        assert ours.json().get("kv_transfer_params") is None
    # D first, its callback delivered once, P's one-token prefill pushed the whole prompt to D.
    assert (p.engine.stats.requests_received, d.engine.stats.requests_received) == (1, 1)
    assert metaserver.delivered == 1
    by_source = d.engine.stats.prompt_tokens_by_source
    assert by_source["external_kv_transfer"] > 0 and by_source["local_compute"] == 0
    await assert_nothing_held(p, d, union)


async def test_a_trigger_prefill_that_fails_fails_the_attempt_and_frees_decode(
    served: str, push_only: tuple[LiveServer, LiveServer, MetaServer]
) -> None:
    p, d, metaserver = push_only
    p.engine.faults.arm(_fault(), 5)
    error = error_of(await post(served, "/v1/messages", BODIES[3][1]), 502)
    assert error["type"] == "api_error"  # Anthropic's type for a 5xx
    assert p.engine.stats.requests_received == 1 and metaserver.delivered == 1
    await assert_nothing_held(p, d)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_client_leaving_while_p_prefills_frees_both_sides(
    served: str, pd_only: tuple[LiveServer, LiveServer], stream: bool
) -> None:
    # P never answers (stalled); the client hangs up meanwhile. D's reservation, P's call and its
    # engine slot are all given back, and D never hears of the request.
    p, d = pd_only
    p.engine.faults.arm(Fault(mode=FaultMode.STALL_AFTER_TOKENS, tokens=0), 1)
    request = asyncio.create_task(post(served, "/v1/chat/completions", chat(stream=stream)))

    async def prefilling() -> bool:
        return p.engine.stats.requests_received == 1 and runtime.inflight_tokens() != {}

    await eventually(prefilling)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request

    async def p_let_go() -> bool:
        return p.engine.stats.disconnects == 1

    await eventually(p_let_go)
    await assert_nothing_held(p, d)
    assert d.engine.stats.requests_received == 0


async def test_a_client_leaving_a_trigger_run_frees_both_sides_and_the_registration(
    served: str, push_only: tuple[LiveServer, LiveServer, MetaServer]
) -> None:
    p, d, metaserver = push_only
    p.engine.faults.arm(Fault(mode=FaultMode.STALL_AFTER_TOKENS, tokens=0), 1)
    request = asyncio.create_task(post(served, "/v1/responses", BODIES[2][1]))

    async def prefilling() -> bool:
        return metaserver.delivered == 1 and p.engine.stats.requests_received == 1

    await eventually(prefilling)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request

    async def released() -> bool:
        # D's connection is closed too (the simulator, like a real D waiting for KV, then drops the
        # request when its push never comes); the coordinator holds nothing of either side.
        return metaserver.pending == 0 and p.engine.stats.disconnects == 1

    await eventually(released)
    await assert_nothing_held(p, d)
