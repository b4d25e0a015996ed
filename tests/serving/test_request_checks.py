"""request_checks: numbers, engine controls, key policy and ids, on every path, before anything
uses them; every test runs through the ``rig`` fixture, which ends by asserting nothing leaked."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import httpx
import pytest

from serving.pipeline import request_checks
from serving.pipeline.engine.native import prompt_bound
from serving.pipeline.errors import MotorError, RequestError
from serving.pipeline.request_checks import KeyPolicy, RequestLimits, VocabularyUnknown
from serving.pipeline.request_context import KeyGrant, RequestContext
from serving.pipeline.snapshot import FleetSnapshot, ModelView
from tests.serving.fakes import MODEL, VOCAB_SIZE, FakeUpstreams
from tests.serving.router_fakes import Rig, chat_body, engine, model_dir, snapshot_with

NATIVE = (engine("e1", native_openai=True), engine("e2", native_openai=True))


def _render_down(request: httpx.Request, body: Any) -> httpx.Response:
    raise httpx.ConnectError("render is down", request=request)


def _path(rig: Rig, path: str) -> FleetSnapshot:
    """The snapshot (and fakes) that send a chat or completions request down ``path``."""
    if path == "local":
        rig.upstreams.override("render", "render", _render_down)
        return snapshot_with(*NATIVE, model_path=model_dir())
    if path == "native":
        return snapshot_with(*NATIVE, enable=False)
    return snapshot_with(*NATIVE)


async def _call(
    rig: Rig, snapshot: FleetSnapshot, kind: str, body: dict[str, Any], rid: str | RequestContext = "rc"
) -> Any:
    return await getattr(rig.pipeline(snapshot), kind)(body, rid)


def _nothing_sent(rig: Rig) -> None:
    assert rig.upstreams.calls == []  # no render, no generate
    assert rig.native.calls == []
    assert rig.scheduler.admission.inflight_tokens() == {}


BAD_NUMBERS = [
    ("chat", chat_body(max_tokens=-5), "max_tokens"),
    ("chat", chat_body(max_tokens=0), "max_tokens"),
    ("chat", chat_body(max_tokens=2049), "max_tokens"),  # above max_model_len
    ("chat", chat_body(max_tokens=1.5), "body.max_tokens"),  # vLLM's schema: not an integer
    ("chat", chat_body(max_tokens="many"), "body.max_tokens"),
    ("chat", chat_body(n=[2]), "body.n"),
    ("chat", chat_body(max_completion_tokens=-1, max_tokens=10), "max_completion_tokens"),
    ("chat", chat_body(n=-1000), "n"),
    ("chat", chat_body(n=0), "n"),
    ("chat", chat_body(n=16385), "n"),
    ("chat", chat_body(n=129), "n"),  # over the coordinator's choice cap
    ("completions", {"model": MODEL, "prompt": "x", "best_of": 0}, "best_of"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": ["a", "b", "c"], "n": 50}, "n"),  # 150 choices
    ("completions", {"model": MODEL, "prompt": ["a"] * 1025}, "prompt"),
]


@pytest.mark.parametrize("path", ["token_only", "local", "native"])
@pytest.mark.parametrize(("kind", "body", "param"), BAD_NUMBERS)
async def test_it_refuses_bad_numbers_before_any_path_uses_them(
    rig: Rig, path: str, kind: str, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(RequestError) as info:
        await _call(rig, _path(rig, path), kind, body)
    assert (info.value.status, info.value.param) == (400, param)
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}
    _nothing_sent(rig)


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("responses", {"model": MODEL, "input": "x", "max_output_tokens": -3}, "max_output_tokens"),
        ("responses", {"model": MODEL, "input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),
        ("messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ("messages", {"model": MODEL, "messages": [], "max_tokens": 0}, "max_tokens"),
        ("messages", {"model": MODEL, "messages": [], "max_tokens": -7}, "max_tokens"),
    ],
)
async def test_it_refuses_bad_numbers_on_responses_and_messages(
    rig: Rig, kind: str, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(RequestError) as info:
        await _call(rig, snapshot_with(*NATIVE), kind, body)
    assert (info.value.status, info.value.param) == (400, param)
    _nothing_sent(rig)


@pytest.mark.parametrize("path", ["token_only", "native"])
async def test_integers_in_another_spelling_are_read_as_vllm_reads_them(rig: Rig, path: str) -> None:
    # pydantic's lax mode, as vLLM parses bodies: "5" and 2.0 are integers; they go on as ints.
    await _call(rig, _path(rig, path), "chat", chat_body(max_tokens="5", n=2.0))
    sent = rig.native.calls[0][2] if path == "native" else rig.upstreams.calls_of("render")[0].body
    assert (sent["max_tokens"], sent["n"]) == (5, 2)
    assert type(sent["max_tokens"]) is int and type(sent["n"]) is int


async def test_a_schema_error_has_vllms_type_and_param(rig: Rig) -> None:
    with pytest.raises(RequestError) as info:
        await _call(rig, snapshot_with(*NATIVE), "chat", chat_body(max_tokens=2.5))
    error = info.value.body()["error"]
    assert (error["type"], error["param"], error["code"]) == ("Bad Request", "body.max_tokens", 400)
    assert error["message"].startswith("1 validation error:")
    _nothing_sent(rig)


async def test_the_choice_cap_is_configurable(rig: Rig) -> None:
    body = {"model": MODEL, "prompt": ["a", "b"], "n": 2}
    with pytest.raises(RequestError, match="limit of 3 choices"):
        await rig.pipeline(snapshot_with(*NATIVE), limits=RequestLimits(max_choices=3)).completions(body, "cap")
    _nothing_sent(rig)
    out = await rig.pipeline(snapshot_with(*NATIVE), limits=RequestLimits(max_choices=4)).completions(body, "cap2")
    assert len(out["choices"]) == 4


async def test_a_valid_native_request_reserves_positive_tokens(rig: Rig) -> None:
    seen: list[dict[str, int]] = []
    original = rig.native.answer

    def observe(host: str, path: str, body: dict[str, Any]) -> httpx.Response:
        seen.append(rig.scheduler.admission.inflight_tokens())
        return original(host, path, body)

    rig.native.answer = observe  # type: ignore[method-assign]
    body = chat_body(max_tokens=7, n=3)
    await _call(rig, snapshot_with(*NATIVE, enable=False), "chat", body)
    # Render disabled: the prompt is counted from the body's size, plus n x max_tokens.
    assert seen == [{"e1": prompt_bound("chat", body)[0] + 21}]


# -- engine controls ------------------------------------------------------------------------------

CONTROLS = [
    ("kv_transfer_params", {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_block_ids": [1]}),
    ("ec_transfer_params", {"x": 1}),
    ("vllm_xargs", {"k": "v"}),
    ("extra_args", {"k": 1}),
]


@pytest.mark.parametrize("path", ["token_only", "local", "native"])
@pytest.mark.parametrize(("field", "value"), CONTROLS)
async def test_it_refuses_engine_controls_naming_the_field(rig: Rig, path: str, field: str, value: Any) -> None:
    for kind, body in (("chat", chat_body()), ("completions", {"model": MODEL, "prompt": "x"})):
        with pytest.raises(RequestError) as info:
            await _call(rig, _path(rig, path), kind, {**body, field: value})
        assert (info.value.status, info.value.param) == (400, field)
        assert field in info.value.message
    _nothing_sent(rig)


@pytest.mark.parametrize(("field", "value"), CONTROLS)
@pytest.mark.parametrize(
    ("kind", "body"),
    [("responses", {"model": MODEL, "input": "x"}),
     ("messages", {"model": MODEL, "messages": [], "max_tokens": 5})],
)
async def test_it_refuses_engine_controls_on_responses_and_messages(
    rig: Rig, kind: str, body: dict[str, Any], field: str, value: Any
) -> None:
    with pytest.raises(RequestError) as info:
        await _call(rig, snapshot_with(*NATIVE), kind, {**body, field: value})
    assert info.value.param == field
    _nothing_sent(rig)


async def test_a_null_engine_control_and_priority_zero_pass(rig: Rig) -> None:
    body = chat_body(kv_transfer_params=None, vllm_xargs=None, priority=0)
    await _call(rig, snapshot_with(*NATIVE), "chat", body)
    (gen,) = rig.upstreams.calls_of("generate")
    assert gen.body["kv_transfer_params"] is None


@pytest.mark.parametrize("path", ["token_only", "native"])
async def test_priority_needs_a_key_that_allows_it(rig: Rig, path: str) -> None:
    with pytest.raises(RequestError) as info:
        await _call(rig, _path(rig, path), "chat", chat_body(priority=-5))
    assert (info.value.status, info.value.param) == (400, "priority")
    _nothing_sent(rig)
    with pytest.raises(RequestError):
        await _call(rig, _path(rig, path), "chat", chat_body(priority="-5"))  # the same integer
    allowed = RequestContext.granted("rc", KeyGrant(KeyPolicy(allow_priority=True)))
    await _call(rig, _path(rig, path), "chat", chat_body(priority=-5), allowed)
    sent = rig.native.calls[0][2] if path == "native" else rig.upstreams.calls_of("render")[0].body
    assert sent["priority"] == -5


async def test_kv_transfer_params_never_come_back(rig: Rig) -> None:
    def native_with_kv(host: str, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, json={"id": "n", "choices": [], "kv_transfer_params": {"remote_host": "10.0.0.9"}})

    rig.native.answer = native_with_kv  # type: ignore[method-assign]
    out = await _call(rig, snapshot_with(*NATIVE, enable=False), "chat", chat_body())
    assert out["kv_transfer_params"] is None

    def derender_with_kv(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        answer = FakeUpstreams()._derender(request, body)
        data = answer.json() if answer.content else {}
        return httpx.Response(200, json={**data, "kv_transfer_params": {"remote_port": 5600}})

    rig.upstreams.override("render", "derender", derender_with_kv)
    out = await _call(rig, snapshot_with(*NATIVE), "chat", chat_body(), "kv2")
    assert out["kv_transfer_params"] is None


# -- vocabulary -----------------------------------------------------------------------------------


def _unknown_vocab(snapshot: FleetSnapshot) -> FleetSnapshot:
    return replace(snapshot, models={MODEL: replace(snapshot.models[MODEL], vocab_size=None)})


async def test_an_unknown_vocabulary_is_503_before_render(rig: Rig) -> None:
    for kind, body in (("chat", chat_body()), ("completions", {"model": MODEL, "prompt": [1, 2]})):
        with pytest.raises(VocabularyUnknown) as info:
            await _call(rig, _unknown_vocab(snapshot_with(*NATIVE)), kind, body)
        assert info.value.status == 503
        assert info.value.body()["error"]["type"] == "ServiceUnavailableError"
    _nothing_sent(rig)


async def test_the_native_path_does_not_need_the_vocabulary(rig: Rig) -> None:
    out = await _call(rig, _unknown_vocab(snapshot_with(*NATIVE, enable=False)), "chat", chat_body())
    assert out["served_by"] == "e1"


def _rendered_with(**sampling: Any) -> Any:
    def render(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        out = FakeUpstreams._generate_request("chatcmpl-v", [1, 2, 3], body, True)
        out["sampling_params"] = {**out["sampling_params"], **sampling}
        return httpx.Response(200, json=out)

    return render


OOV = VOCAB_SIZE


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop_token_ids", [5, OOV]),
        ("allowed_token_ids", [-1]),
        ("logprob_token_ids", [OOV + 7]),
        ("logit_bias", {str(OOV): 5.0}),
        ("bad_words_token_ids", [[1], [OOV]]),
        ("prompt_logprob_token_ids", [[1, -1], [OOV, -1]]),
        ("trace_decode_token_ids", [OOV]),
    ],
)
async def test_every_rendered_id_field_is_checked_with_obfuscation_off(rig: Rig, field: str, value: Any) -> None:
    rig.upstreams.override("render", "render", _rendered_with(**{field: value}))
    with pytest.raises(RequestError) as info:
        await _call(rig, snapshot_with(*NATIVE), "chat", chat_body())
    assert (info.value.status, info.value.param) == (400, field)
    assert rig.upstreams.calls_of("generate") == []
    assert rig.scheduler.admission.inflight_tokens() == {}


async def test_padding_in_prompt_logprob_rows_is_not_an_id(rig: Rig) -> None:
    rig.upstreams.override("render", "render", _rendered_with(prompt_logprob_token_ids=[[1, -1], [2, 3]]))
    await _call(rig, snapshot_with(*NATIVE), "chat", chat_body())
    assert len(rig.upstreams.calls_of("generate")) == 1


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "prompt": [1, OOV]},
        {"model": MODEL, "prompt": [[1], [-2]]},
        {"model": MODEL, "prompt": "x", "logit_bias": {str(OOV + 1): 1}},
        {"model": MODEL, "prompt": "x", "allowed_token_ids": [OOV]},
    ],
)
async def test_client_id_fields_are_checked_on_the_native_path_too(rig: Rig, body: dict[str, Any]) -> None:
    with pytest.raises(RequestError) as info:
        await _call(rig, snapshot_with(*NATIVE, enable=False), "completions", body)
    assert info.value.status == 400
    _nothing_sent(rig)


async def test_a_local_fallback_prompt_outside_the_vocabulary_is_refused(rig: Rig) -> None:
    rig.upstreams.override("render", "render", _render_down)
    snap = snapshot_with(*NATIVE, model_path=model_dir())
    vocab = snap.models[MODEL].vocab_size
    assert vocab is not None
    with pytest.raises(RequestError) as info:
        await _call(rig, snap, "completions", {"model": MODEL, "prompt": [1, vocab]})
    assert info.value.param == "prompt"
    assert rig.upstreams.calls_of("generate") == []


REFUSALS = [  # (what request_checks is asked, the status and param its refusal carries)
    (lambda model: request_checks.check_body("chat", chat_body(max_tokens=0), model, RequestLimits()), 400,
     "max_tokens"),
    (lambda model: request_checks.check_body("chat", chat_body(n=129), model, RequestLimits()), 400, "n"),
    (lambda model: request_checks.check_body("chat", chat_body(temperature="hot"), model, RequestLimits()), 400,
     "body.temperature"),
    (lambda model: request_checks.check_body("messages", {"model": MODEL, "messages": []}, model, RequestLimits()),
     400, "max_tokens"),
    (lambda model: request_checks.check_prompt_ids([1, VOCAB_SIZE], VOCAB_SIZE, param="prompt"), 400, "prompt"),
    (lambda model: request_checks.require_vocab(replace(model, vocab_size=None)), 503, None),
]


@pytest.mark.parametrize(("refuse", "status", "param"), REFUSALS,
                         ids=["max_tokens", "n", "schema", "messages", "vocabulary", "vocab-unknown"])
def test_it_documents_one_error_shape_per_refusal(refuse: Any, status: int, param: str | None) -> None:
    # Each refusal the checks raise themselves is a MotorError with the OpenAI error object.
    model = ModelView(MODEL, "/m", 2048, VOCAB_SIZE)
    with pytest.raises(MotorError) as info:
        refuse(model)
    error = info.value.body()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (status, param) and error["type"] and error["message"]
    # And the largest request inside every bound is not refused.
    request_checks.check_body("chat", chat_body(max_tokens=2048, n=128), model, RequestLimits())
