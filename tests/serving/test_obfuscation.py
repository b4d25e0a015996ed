"""Token obfuscation boundary: the mapping, every id-valued field, fail-closed paths, a keyed simulator."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enginesim import SimConfig
from enginesim.testing import LiveServer
from serving.pipeline.engine.client import EngineClient
from serving.pipeline.engine.requests import engine_request
from serving.pipeline.errors import RequestError
from serving.pipeline.http11 import Http11Client
from serving.pipeline.obfuscation.fields import deobfuscate_event, deobfuscate_response, obfuscate_request
from serving.pipeline.obfuscation.keyring import (
    clear_mappings,
    eligible,
    load_error,
    mapping_for,
    register_mapping,
    require_mapping,
)
from serving.pipeline.obfuscation.mapping import (
    ObfuscatedOutputInvalid,
    ObfuscationKeyError,
    ObfuscationRefused,
    TokenMapping,
    key_id,
    permutation,
)
from serving.pipeline.placement import filters
from serving.pipeline.snapshot import FleetSnapshot, InstanceView, RenderView
from tests.serving.loopback import LoopbackClient

KEY = b"unit-test-obfuscation-key-0001"
VOCAB = 512
MAPPING = TokenMapping.from_key(KEY, VOCAB)

keys = st.binary(min_size=16, max_size=48)
vocab_sizes = st.integers(min_value=2, max_value=3000)


@settings(max_examples=40, deadline=None)
@given(keys, vocab_sizes, st.data())
def test_it_round_trips_every_id_both_ways(key: bytes, vocab: int, data: st.DataObject) -> None:
    m = TokenMapping.from_key(key, vocab)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=200))
    assert m.to_semantic(m.to_physical(ids)) == ids
    assert m.to_physical(m.to_semantic(ids)) == ids
    assert sorted(m.forward.tolist()) == list(range(vocab))  # a bijection of the whole vocabulary


@settings(max_examples=20, deadline=None)
@given(keys, keys)
def test_it_derives_distinct_permutations_and_ids_for_distinct_keys(a: bytes, b: bytes) -> None:
    if a == b:
        return
    assert key_id(a) != key_id(b)
    assert not np.array_equal(permutation(a, 4096), permutation(b, 4096))


def test_it_is_deterministic_and_moves_most_ids() -> None:
    again = TokenMapping.from_key(KEY, VOCAB)
    assert np.array_equal(again.forward, MAPPING.forward)
    assert again.key_id == MAPPING.key_id == key_id(KEY)
    assert len(MAPPING.key_id) == 16
    # A permutation that left ids in place would leak them; a random one fixes about one.
    assert int((MAPPING.forward == np.arange(VOCAB)).sum()) < 10


def test_it_rejects_short_keys_and_tiny_vocabularies() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        TokenMapping.from_key(b"short", VOCAB)
    with pytest.raises(ValueError, match="vocab_size"):
        TokenMapping.from_key(KEY, 1)


def test_it_refuses_ids_outside_the_vocabulary() -> None:
    with pytest.raises(ObfuscationRefused, match="outside the vocabulary"):
        MAPPING.to_physical([1, VOCAB])
    with pytest.raises(ObfuscationRefused):
        MAPPING.to_physical([-1])
    with pytest.raises(ObfuscatedOutputInvalid):
        MAPPING.to_semantic([VOCAB + 7])
    assert ObfuscationRefused("x").status == 400 and ObfuscatedOutputInvalid("x").status == 502


def full_request() -> dict[str, Any]:
    """A GenerateRequest with every field set, as render (a chat with tools, a reasoning parser and
    token offsets) and the router could send it."""
    return {
        "request_id": "chatcmpl-1",
        "token_ids": [1, 5, 9, 2, 0, 511],
        "token_offsets": [[0, 3], [3, 7], [7, 8], [8, 12], [12, 13], [13, 20]],
        "features": None,
        "content_parts": None,
        "sampling_params": {
            "temperature": 0.0,
            "max_tokens": 8,
            "stop": [],
            "bad_words": [],
            "stop_token_ids": [2, 7],
            "allowed_token_ids": [3, 4, 5, 2],
            "logprob_token_ids": [10, 11],
            "trace_decode_token_ids": [12, 13],
            "logit_bias": {"5": 1.5, "300": -100.0},
            "prompt_logprob_token_ids": [[1, 2, -1], [3, -1, -1]],
            "logprobs": 3,
            "output_kind": 2,
        },
        "model": "tiny",
        "reasoning_ended": None,
        "reasoning_parser_kwargs": {"chat_template_kwargs": {"enable_thinking": False, "persona": "Captain Nemo"}},
        "output_mode": "tokens",
        "parse_context": {
            "tools": [{"type": "function", "function": {"name": "lookup_salary", "parameters": {"type": "object"}}}],
            "tool_choice": "auto",
            "chat_template_kwargs": {"persona": "Captain Nemo"},
        },
        "stream": False,
        "stream_options": None,
        "cache_salt": "tenant-acme",
        "priority": 0,
        "kv_transfer_params": {"do_remote_decode": True},
        "ec_transfer_params": None,
        "return_token_ids": True,
    }


def test_it_maps_every_id_valued_request_field_and_leaves_the_input_alone() -> None:
    req = full_request()
    before = copy.deepcopy(req)
    out = obfuscate_request(req, MAPPING)
    assert req == before
    p = MAPPING.physical
    sp = out["sampling_params"]
    assert out["token_ids"] == [p(i) for i in req["token_ids"]]
    assert sp["stop_token_ids"] == [p(2), p(7)]
    assert sp["allowed_token_ids"] == [p(3), p(4), p(5), p(2)]
    assert sp["logprob_token_ids"] == [p(10), p(11)]
    assert sp["trace_decode_token_ids"] == [p(12), p(13)]
    assert sp["logit_bias"] == {str(p(5)): 1.5, str(p(300)): -100.0}
    assert sp["prompt_logprob_token_ids"] == [[p(1), p(2), -1], [p(3), -1, -1]]
    # Numbers, flags, names and connector state travel unchanged.
    for name in ("request_id", "model", "kv_transfer_params", "priority", "return_token_ids", "stream"):
        assert out[name] == req[name]
    assert sp["temperature"] == 0.0 and sp["max_tokens"] == 8 and sp["logprobs"] == 3


def test_it_leaves_out_what_the_engine_never_reads_and_digests_the_cache_salt() -> None:
    req = full_request()
    out = obfuscate_request(req, MAPPING)
    # Tool schemas, chat_template_kwargs (twice) and character offsets: generate reads none of
    # them in tokens mode (module docstring), so none of them is sent.
    for name in ("parse_context", "token_offsets", "reasoning_parser_kwargs", "reasoning_ended"):
        assert name not in out
    wire = json.dumps(out)
    for text in ("lookup_salary", "Captain Nemo", "enable_thinking", "tenant-acme"):
        assert text not in wire
    assert out["cache_salt"] == MAPPING.salt("tenant-acme") and len(out["cache_salt"]) == 64
    assert req["parse_context"]["tool_choice"] == "auto"  # the coordinator's copy keeps it


def test_the_salt_digest_partitions_the_cache_as_the_client_did_and_fits_vllm() -> None:
    assert MAPPING.salt("a") == TokenMapping.from_key(KEY, VOCAB).salt("a")  # every process agrees
    assert MAPPING.salt("a") != MAPPING.salt("b")
    assert MAPPING.salt("a") != TokenMapping.from_key(b"another-key-of-enough-bytes", VOCAB).salt("a")
    # vLLM's cache_salt check: at most 128 characters, none of @ / \\ NUL.
    salt = MAPPING.salt("x@y/z\\" + "\x00" * 3 + "é" * 300)
    assert len(salt) <= 128 and not set(salt) & set("@/\\\x00")


def test_it_obfuscates_what_engine_request_builds_for_every_attempt() -> None:
    # A retry or replay builds a fresh engine request from the semantic one: each is mapped anew.
    rendered = {"request_id": "r", "token_ids": [4, 5, 6], "sampling_params": {"temperature": 0.0}}
    for attempt in ("r", "r-a1"):
        out = obfuscate_request(engine_request(rendered, request_id=attempt), MAPPING)
        assert out["token_ids"] == MAPPING.to_physical([4, 5, 6])
        assert out["request_id"] == attempt and out["sampling_params"]["max_tokens"] == 16
    assert rendered["token_ids"] == [4, 5, 6]


@pytest.mark.parametrize(
    "mutate, param",
    [
        (lambda r: r["sampling_params"].__setitem__("stop", ["\n\n"]), "stop"),
        (lambda r: r["sampling_params"].__setitem__("bad_words", ["secret"]), "bad_words"),
        (lambda r: r["sampling_params"].__setitem__("structured_outputs", {"json": {}}), "structured_outputs"),
        (lambda r: r.__setitem__("content_parts", [{"type": "image_url", "url": "x"}]), "messages"),
        (lambda r: r.__setitem__("features", {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": []},
                                              "kwargs_data": {"image": ["cGl4ZWxz"]}}), "messages"),
        (lambda r: r.__setitem__("output_mode", "derender"), "output_mode"),
        (lambda r: r.__setitem__("prompt_text", "hello"), None),
        (lambda r: r["sampling_params"].__setitem__("banned_token_ids", [1]), "sampling_params"),
        (lambda r: r["sampling_params"].__setitem__("logit_bias", {"x": 1.0}), "logit_bias"),
        (lambda r: r.__setitem__("token_ids", [1, VOCAB]), None),
    ],
)
def test_it_refuses_rather_than_sends_text_or_unmappable_fields(mutate: Any, param: str | None) -> None:
    req = full_request()
    mutate(req)
    with pytest.raises(ObfuscationRefused) as info:
        obfuscate_request(req, MAPPING)
    assert isinstance(info.value, RequestError) and info.value.status == 400
    assert info.value.param == param


def engine_answer(physical_prompt: list[int]) -> dict[str, Any]:
    """What an engine returns, in physical ids, for every id-valued response field."""
    p = MAPPING.physical
    top = [{"token_id": p(20), "logprob": -0.1, "rank": None}, {"token_id": p(21), "logprob": -2.0, "rank": 2}]
    return {
        "request_id": "generate-tokens-r",
        "prompt_token_ids": physical_prompt,
        "prompt_logprobs": [None, {str(p(5)): {"logprob": -1.0, "rank": 1, "decoded_token": None}}],
        "prompt_token_id_logprobs": None,
        "usage": {"prompt_tokens": len(physical_prompt), "completion_tokens": 2, "total_tokens": 9},
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "stop_reason": p(7),
                "token_ids": [p(20), p(7)],
                "sampling_mask": [[p(20), p(21)], [p(7)]],
                "logprobs": {"content": [{"token_id": p(20), "logprob": -0.1, "rank": None, "top_logprobs": top}]},
            },
            {"index": 1, "finish_reason": "stop", "stop_reason": "repetition_detected", "token_ids": [p(3)], "logprobs": None},
            {"index": 2, "finish_reason": "length", "stop_reason": None, "token_ids": [p(4)], "logprobs": None},
        ],
    }


def test_it_maps_every_id_valued_response_field_back() -> None:
    semantic_prompt = [1, 5, 9]
    resp = engine_answer(MAPPING.to_physical(semantic_prompt))
    out = deobfuscate_response(resp, MAPPING)
    assert out["prompt_token_ids"] == semantic_prompt
    assert out["prompt_logprobs"] == [None, {"5": {"logprob": -1.0, "rank": 1, "decoded_token": None}}]
    c0, c1, c2 = out["choices"]
    assert c0["token_ids"] == [20, 7] and c0["stop_reason"] == 7
    assert c0["sampling_mask"] == [[20, 21], [7]]
    entry = c0["logprobs"]["content"][0]
    assert entry["token_id"] == 20
    assert [t["token_id"] for t in entry["top_logprobs"]] == [20, 21]
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.1, -2.0]
    assert c1["stop_reason"] == "repetition_detected" and c1["token_ids"] == [3]
    assert c2["stop_reason"] is None and c2["token_ids"] == [4]
    assert out["usage"] == resp["usage"]


def test_it_maps_stream_events_and_passes_error_events_scrubbed() -> None:
    p = MAPPING.physical
    event = {"request_id": "x", "usage": None, "output_mode": "tokens",
             "choices": [{"index": 0, "finish_reason": None, "stop_reason": None, "token_ids": [p(8)], "logprobs": None}]}
    assert deobfuscate_event(event, MAPPING)["choices"][0]["token_ids"] == [8]
    usage_only = {"request_id": "x", "usage": {"prompt_tokens": 3}, "choices": []}
    assert deobfuscate_event(usage_only, MAPPING) == usage_only
    error = {"error": {"message": f"boom at {p(8)}", "type": "InternalServerError", "param": None, "code": 500}}
    scrubbed = deobfuscate_event(error, MAPPING)["error"]  # passes as an error, without its text
    assert (scrubbed["type"], scrubbed["param"], scrubbed["code"]) == ("InternalServerError", None, 500)
    assert str(p(8)) not in scrubbed["message"]


def test_it_refuses_engine_output_from_another_key_space() -> None:
    resp = {"choices": [{"index": 0, "token_ids": [VOCAB * 2], "finish_reason": "length"}]}
    with pytest.raises(ObfuscatedOutputInvalid):
        deobfuscate_response(resp, MAPPING)


OFF = RenderView(enable=True, base_url="http://render", timeout_s=1.0)
ON = dataclasses.replace(OFF, obfuscation=True, obfuscation_key_id=MAPPING.key_id)


def test_it_requires_the_configured_key_when_obfuscation_is_on() -> None:
    assert require_mapping(OFF, None) is None
    assert require_mapping(OFF, MAPPING) is None  # off means off: never map
    assert require_mapping(ON, MAPPING) is MAPPING
    with pytest.raises(ObfuscationKeyError, match="not available"):
        require_mapping(ON, None)
    with pytest.raises(ObfuscationKeyError, match="mismatch"):
        require_mapping(ON, TokenMapping.from_key(b"another-key-of-enough-bytes", VOCAB))
    with pytest.raises(ObfuscationKeyError, match="no key id"):
        require_mapping(dataclasses.replace(ON, obfuscation_key_id=""), MAPPING)
    # A missing key is the server's state, not the request's fault: 503, like any outage.
    assert (ObfuscationKeyError("x").status, ObfuscationKeyError("x").type) == (503, "ServiceUnavailableError")


def key_pool(instances: list[InstanceView], render: RenderView) -> list[InstanceView]:
    snapshot = FleetSnapshot(version=1, models={}, render=render, instances=tuple(instances))
    return filters.eligible_instances(snapshot, instances[0].model)


def inst(name: str, key: str = "") -> InstanceView:
    return InstanceView(
        id=1, name=name, url="http://e", role="union", model="tiny", weight=1, token_capacity=0,
        max_model_len=2048, token_generate=True, native_openai=False, tokenizer=False, state="active",
        obfuscation_key_id=key,
    )


def test_it_keeps_mismatched_instances_out_of_traffic() -> None:
    plain, keyed, other = inst("plain"), inst("keyed", MAPPING.key_id), inst("other", "0123456789abcdef")
    assert eligible(keyed, ON) == (True, "")
    ok, why = eligible(other, ON)
    assert not ok and "differs" in why
    ok, why = eligible(plain, ON)
    assert not ok and "plain weights" in why
    assert eligible(plain, OFF) == (True, "")
    ok, why = eligible(keyed, OFF)
    assert not ok and "obfuscation is off" in why
    # Placement's eligibility set applies the same verdict to the deployment's traffic.
    assert key_pool([plain, keyed, other], ON) == [keyed]
    assert key_pool([plain, keyed, other], OFF) == [plain]
    # Rotation: a new key id on the render config moves traffic to the engines that declare it.
    rotated = TokenMapping.from_key(b"rotated-key-0002-for-tests", VOCAB)
    new = inst("new", rotated.key_id)
    on2 = dataclasses.replace(ON, obfuscation_key_id=rotated.key_id)
    assert key_pool([keyed, new], on2) == [new]


# --- a keyed simulator behind the boundary ---------------------------------------------------

EOS = 2


@pytest.fixture(scope="module")
def keyed_sim() -> Iterator[LiveServer]:
    # The simulator sees physical ids as opaque; configured like an obfuscated model, its eos
    # id is the physical one (as in the obfuscated model's generation_config.json).
    server = LiveServer(SimConfig(vocab_size=VOCAB, eos_token_ids=(MAPPING.physical(EOS),), max_model_len=256, seed=0))
    server.start()
    yield server
    server.stop()


async def test_it_sends_a_simulator_only_physical_ids(keyed_sim: LiveServer) -> None:
    keyed_sim.reset()
    instance = dataclasses.replace(inst("sim-1", MAPPING.key_id), url=keyed_sim.url)
    semantic_prompt = [1, 30, 31, 32, 33, 2, 1, 40]
    rendered = {"request_id": "cmpl-1-0", "token_ids": semantic_prompt, "model": "tiny", "return_token_ids": True,
                "sampling_params": {"temperature": 0.0, "max_tokens": 12, "logprobs": 2, "stop_token_ids": [9]}}
    async with contextlib.aclosing(Http11Client()) as http:  # the production client
        engines = EngineClient(http)
        assert eligible(instance, ON)[0]
        mapping = require_mapping(ON, MAPPING)
        assert mapping is not None
        physical = await engines.generate(instance, obfuscate_request(engine_request(rendered, request_id="r0"), mapping))
        stats = (await http.get(f"{keyed_sim.url}/sim/stats")).json()
    assert stats["last_token_ids"] == MAPPING.to_physical(semantic_prompt) != semantic_prompt
    out = deobfuscate_response(physical, mapping)
    assert out["prompt_token_ids"] == semantic_prompt
    choice = out["choices"][0]
    assert choice["token_ids"] == MAPPING.to_semantic(physical["choices"][0]["token_ids"])
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == choice["token_ids"]
    if choice["finish_reason"] == "stop":
        assert choice["token_ids"][-1] in (EOS, 9)


# --- the whole pipeline, with the boundary, against a keyed simulator ------------------------

BIG = TokenMapping.from_key(KEY, 152000)  # covers the fake render's Qwen-sized ids


@pytest.fixture(scope="module")
def big_sim() -> Iterator[LiveServer]:
    server = LiveServer(SimConfig(vocab_size=BIG.vocab_size, eos_token_ids=(BIG.physical(EOS),), max_model_len=2048, seed=0))
    server.start()
    yield server
    server.stop()


def _pipeline(http: Http11Client, sim: LiveServer, render: RenderView, key: str) -> Any:
    from serving.pipeline.obfuscation.boundary import EngineBoundary
    from serving.pipeline.placement.load import LoadTracker
    from serving.pipeline.placement.scheduler import Scheduler
    from serving.pipeline.render.client import RenderClient
    from serving.pipeline.service import ServingPipeline
    from tests.serving.fakes import RENDER_URL, fleet_snapshot

    snap = dataclasses.replace(
        fleet_snapshot(dataclasses.replace(inst("e1", key), url=sim.url), dataclasses.replace(inst("e2", ""), id=2, url="http://127.0.0.1:9")),
        render=dataclasses.replace(render, base_url=RENDER_URL),
    )
    mapping = require_mapping(snap.render, mapping_for(snap))
    return ServingPipeline(
        snap, RenderClient(http, RENDER_URL, 5.0), EngineClient(http), Scheduler(LoadTracker()),
        boundary=EngineBoundary(mapping),
    )


@pytest.fixture
def registered() -> Iterator[TokenMapping]:
    register_mapping(BIG)
    yield BIG
    clear_mappings()


async def test_it_serves_chat_and_multi_prompt_completions_through_the_boundary(
    big_sim: LiveServer, registered: TokenMapping
) -> None:
    from tests.serving.fakes import CHAT_PROMPT, FakeUpstreams, completion_prompt_ids

    upstreams = FakeUpstreams()
    on = dataclasses.replace(ON, obfuscation_key_id=BIG.key_id)
    # The production client: render is the fake on 127.0.0.1, the engine the real simulator.
    async with LoopbackClient(upstreams.handler, fakes={"render.test"}) as http:
        big_sim.reset()
        pipeline = _pipeline(http, big_sim, on, BIG.key_id)
        # e2 (plain weights) is not even a candidate: nothing can reach its dead address.
        assert [i.name for i in pipeline.scheduler.pool(pipeline.snapshot, "tiny")] == ["e1"]
        await pipeline.chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}, "c1")
        stats = (await http.get(f"{big_sim.url}/sim/stats")).json()
        assert stats["last_token_ids"] == BIG.to_physical(CHAT_PROMPT)
        derendered = upstreams.calls_of("derender")[-1].body
        semantic_out = derendered["generate_response"]["choices"][0]["token_ids"]
        # Replay the physical request: what the engine emitted is exactly what derender got, mapped back.
        again = await EngineClient(http).generate(
            dataclasses.replace(inst("e1"), url=big_sim.url),
            {"token_ids": BIG.to_physical(CHAT_PROMPT), "sampling_params": {"max_tokens": 6, "temperature": 1.0}, "model": "tiny"},
        )
        assert semantic_out == BIG.to_semantic(again["choices"][0]["token_ids"])

        out = await pipeline.completions({"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 4}, "m1")
        assert len(out["choices"]) == 3
        stats = (await http.get(f"{big_sim.url}/sim/stats")).json()
        physical_prompts = {tuple(BIG.to_physical(completion_prompt_ids(i))) for i in range(3)}
        assert tuple(stats["last_token_ids"]) in physical_prompts
        gens = upstreams.calls_of("derender")[-1].body["generate_responses"]
        assert all(i < BIG.vocab_size for g in gens for c in g["choices"] for i in c["token_ids"])


async def test_it_serves_anthropic_messages_through_the_boundary(big_sim: LiveServer, registered: TokenMapping) -> None:
    """Messages take the chat token path, so the engine sees only physical ids there too."""
    from tests.serving.fakes import CHAT_PROMPT, FakeUpstreams

    upstreams = FakeUpstreams()
    on = dataclasses.replace(ON, obfuscation_key_id=BIG.key_id)
    async with LoopbackClient(upstreams.handler, fakes={"render.test"}) as http:
        big_sim.reset()
        pipeline = _pipeline(http, big_sim, on, BIG.key_id)
        out = await pipeline.messages(
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}, "a1")
        assert out["type"] == "message" and out["usage"]["input_tokens"] == len(CHAT_PROMPT)
        stats = (await http.get(f"{big_sim.url}/sim/stats")).json()
        assert stats["last_token_ids"] == BIG.to_physical(CHAT_PROMPT)
        assert [c.path for c in upstreams.calls if c.kind == "render"] == ["/v1/messages/render"]


async def test_it_refuses_all_traffic_without_the_configured_key(big_sim: LiveServer) -> None:
    clear_mappings()
    async with contextlib.aclosing(Http11Client()) as http:
        with pytest.raises(ObfuscationKeyError, match="not available"):
            _pipeline(http, big_sim, dataclasses.replace(ON, obfuscation_key_id=BIG.key_id), BIG.key_id)
        # Rotation half done: the loaded key is not the named one.
        register_mapping(TokenMapping.from_key(b"the-next-key-not-yet-named", BIG.vocab_size))
        try:
            with pytest.raises(ObfuscationKeyError, match="mismatch"):
                _pipeline(http, big_sim, dataclasses.replace(ON, obfuscation_key_id=BIG.key_id), BIG.key_id)
        finally:
            clear_mappings()


def test_it_leaves_a_plain_deployment_unchanged() -> None:
    from tests.serving.fakes import MODEL, fleet_snapshot

    snap = fleet_snapshot()
    assert filters.eligible_instances(snap, MODEL) == list(snap.instances)
    assert mapping_for(snap) is None and require_mapping(snap.render, None) is None


# --- keys from settings and files (the Django side) ------------------------------------------


def test_it_resolves_key_references(settings: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.obfuscation_keys import KeyUnavailable, key_id_of, resolve_key

    settings.MOTOR_OBFUSCATION_KEY_DIR = tmp_path
    settings.MOTOR_OBFUSCATION_KEY_TEST = "k" * 32
    assert resolve_key("setting:MOTOR_OBFUSCATION_KEY_TEST") == b"k" * 32
    monkeypatch.setenv("MOTOR_OBFUSCATION_KEY_TEST_ENV", "e" * 20)
    assert resolve_key("setting:MOTOR_OBFUSCATION_KEY_TEST_ENV") == b"e" * 20
    (tmp_path / "key").write_bytes(b"f" * 40 + b"\n")
    assert resolve_key(f"file:{tmp_path / 'key'}") == b"f" * 40
    assert key_id_of(f"file:{tmp_path / 'key'}") == key_id(b"f" * 40)
    for ref, why in [
        ("setting:MOTOR_OBFUSCATION_KEY_NO_SUCH", "not set"),
        (f"file:{tmp_path / 'missing'}", "cannot read"),
        ("vault:x", "names no obfuscation key"),
        ("plain-key-material", "names no obfuscation key"),
    ]:
        with pytest.raises(KeyUnavailable, match=why):
            resolve_key(ref)
    settings.MOTOR_OBFUSCATION_KEY_TEST = "short"
    with pytest.raises(KeyUnavailable, match="shorter"):
        resolve_key("setting:MOTOR_OBFUSCATION_KEY_TEST")


def test_it_registers_the_configured_key_when_a_snapshot_is_built(settings: Any, tmp_path: Any) -> None:
    from catalog.models import RenderConfig
    from serving.obfuscation_keys import load_for
    from serving.pipeline.snapshot import ModelView

    (tmp_path / "config.json").write_text('{"vocab_size": 600}')
    models = [ModelView("tiny", str(tmp_path), 2048)]
    settings.MOTOR_OBFUSCATION_KEY_TEST = "a-test-key-of-enough-length"
    good = key_id(b"a-test-key-of-enough-length")
    clear_mappings()
    try:
        assert load_for(RenderConfig(obfuscation=False), models) is None
        cfg = RenderConfig(obfuscation=True, obfuscation_key_ref="setting:MOTOR_OBFUSCATION_KEY_TEST", obfuscation_key_id=good)
        m = load_for(cfg, models)
        assert m is not None and m.key_id == good and m.vocab_size == 600 and load_error() == ""
        snap_render = RenderView(enable=True, base_url="x", timeout_s=1, obfuscation=True, obfuscation_key_id=good)
        assert require_mapping(snap_render, m) is m
        # A key reference that resolves to nothing: no mapping, a reason, and traffic refused.
        clear_mappings()
        bad = RenderConfig(obfuscation=True, obfuscation_key_ref="setting:MOTOR_OBFUSCATION_KEY_NO_SUCH", obfuscation_key_id=good)
        assert load_for(bad, models) is None
        assert "not set" in load_error()
        # A key whose id is not the configured one: registered, and reported as a mismatch.
        wrong = RenderConfig(obfuscation=True, obfuscation_key_ref="setting:MOTOR_OBFUSCATION_KEY_TEST", obfuscation_key_id="0" * 16)
        assert load_for(wrong, models) is not None
        assert "has id" in load_error()
    finally:
        clear_mappings()


# --- through the /v1 views, with the key from settings ---------------------------------------

VIEW_KEY = "view-test-obfuscation-key-0001"


@pytest.fixture
def obf_fleet(transactional_db: None, settings: Any, upstreams: Any, mock_client: LoopbackClient,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from catalog.models import RenderConfig, ServedModel
    from fleet.models import EngineInstance
    from serving import snapshots
    from tests.serving.fakes import ENGINE_URLS, MODEL

    settings.MOTOR_API_KEYS = []
    settings.MOTOR_OPEN_ACCESS = True
    settings.MOTOR_OBFUSCATION_KEY_VIEW = VIEW_KEY
    settings.MOTOR_OBFUSCATION_VOCAB_SIZE = 152000
    model = ServedModel.objects.create(name=MODEL, model_path="/models/tiny", max_model_len=2048, vocab_size=151936)
    RenderConfig.objects.create(
        host="render.test", port=8100, timeout_ms=5000, obfuscation=True,
        obfuscation_key_ref="setting:MOTOR_OBFUSCATION_KEY_VIEW", obfuscation_key_id=key_id(VIEW_KEY.encode()),
    )
    EngineInstance.objects.create(name="e1", url=ENGINE_URLS["e1"], served_model=model, obfuscation_key_id=key_id(VIEW_KEY.encode()))
    EngineInstance.objects.create(name="e2", url=ENGINE_URLS["e2"], served_model=model)  # plain weights
    monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: mock_client)
    snapshots.invalidate()
    clear_mappings()
    yield upstreams
    snapshots.invalidate()
    clear_mappings()


@pytest.mark.django_db(transaction=True)
async def test_the_api_sends_engines_physical_ids_and_clients_get_semantic_ones(
    obf_fleet: Any, v1: httpx.AsyncClient
) -> None:
    from tests.serving.fakes import CHAT_PROMPT, text_of

    m = TokenMapping.from_key(VIEW_KEY.encode(), 152000)
    for _ in range(3):  # least-loaded placement would alternate: only e1 may ever be chosen
        r = await v1.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.content
    gens = obf_fleet.calls_of("generate")
    assert {c.host for c in gens} == {"e1"}
    assert all(c.body["token_ids"] == m.to_physical(CHAT_PROMPT) for c in gens)
    physical_out = gens[-1].response["choices"][0]["token_ids"]
    semantic_out = obf_fleet.calls_of("derender")[-1].body["generate_response"]["choices"][0]["token_ids"]
    assert semantic_out == m.to_semantic(physical_out)
    assert r.json()["choices"][0]["message"]["content"] == text_of(semantic_out)


@pytest.mark.django_db(transaction=True)
async def test_the_api_refuses_traffic_when_the_key_is_missing(
    obf_fleet: Any, settings: Any, v1: httpx.AsyncClient
) -> None:
    del settings.MOTOR_OBFUSCATION_KEY_VIEW
    r = await v1.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "ServiceUnavailableError"
    assert "not available" in r.json()["error"]["message"]
    assert obf_fleet.calls == []  # not even render: nothing leaves without the key
