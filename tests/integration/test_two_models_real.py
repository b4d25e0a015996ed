"""Two served models in one fleet, on real parts, called with the official openai client.

Model ``tiny`` (ChatML, 4,096 tokens) is the session's: its real render sidecar and first real
engine. Model ``tiny-b`` (``tinymodel.llama``: a Llama 3 style template, 3,000 tokens) gets its
own real sidecar and engine here, started through ``stack.extra_model_specs`` as ``make run``
with MOTOR_SECOND_MODEL=1 starts them. The coordinator (Daphne) reaches every tier through a
proxy that keeps what it forwards, so a test can say which tier a request reached: a request is
rendered, generated and derendered only by its own model's tiers.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
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

# Starting the second model's sidecar and engine beside the session's tiers takes minutes on a
# busy 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ADMIN_KEY = "mk-test-" + uuid.uuid4().hex[:12]
A, B = "tiny", "tiny-b"
MESSAGES = [{"role": "user", "content": "Write a function that returns the sum of a list"}]
REQUEST_LINE = re.compile(rb"(GET|POST) (/[^ ]*) HTTP/1\.1\r\n")


@dataclass(frozen=True)
class Tier:
    direct: str  # the real process, for the reference calls
    proxy: CuttingProxy  # what the coordinator's records name

    def calls(self) -> list[str]:
        """Every request the coordinator sent this tier so far: ``METHOD /path``."""
        return [
            f"{m.group(1).decode()} {m.group(2).decode()}"
            for sent in self.proxy.sent() for m in REQUEST_LINE.finditer(sent)
        ]


@dataclass(frozen=True)
class Fleet:
    url: str
    render: dict[str, Tier]
    engine: dict[str, Tier]


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.fail(f"{name} is not set; run the suite with `make test`", pytrace=False)
    return value


def _model_b(base: stack.StackConfig) -> tuple[list[ProcessSpec], stack.ExtraModel]:
    second = stack.ExtraModel(B, _env("MOTOR_MODEL_B_DIR"), free_port(), (free_port(),))
    log_dir = base.log_dir / "two-models"
    log_dir.mkdir(parents=True, exist_ok=True)
    return together(stack.extra_model_specs(replace(base, extra_models=(second,), log_dir=log_dir))), second


# Begun in the background while the tests before this module run (tests/integration/early.py).
MODEL_B = early.rig("model-b", _model_b, fixture="fleet", module=str(Path(__file__).resolve()))


@pytest.fixture(scope="module")
def fleet(tiers: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    log_dir = tiers.log_dir / "two-models"
    with contextlib.ExitStack() as running:
        second, _ = running.enter_context(MODEL_B.running(tiers))
        b_render, (b_engine,) = second.render_port, second.engine_ports
        ports = {("render", A): tiers.render_port, ("engine", A): tiers.engine_ports[0],
                 ("render", B): b_render, ("engine", B): b_engine}
        proxies = {key: running.enter_context(CuttingProxy(port, Cut())) for key, port in ports.items()}
        cfg = replace(
            tiers,
            render_port=proxies["render", A].port,
            engine_ports=(proxies["engine", A].port,),
            extra_models=(replace(second, render_port=proxies["render", B].port, engine_ports=(proxies["engine", B].port,)),),
            coordinator_port=free_port(),
            database_url=f"sqlite:///{tmp_path_factory.mktemp('two-models') / 'coordinator.sqlite3'}",
            log_dir=log_dir,
            extra_env={"MOTOR_DEMO_ADMIN_KEY": ADMIN_KEY},
        )
        stack.prepare_database(cfg)
        running.enter_context(Supervisor([stack.coordinator_spec(cfg)]))

        def tier(kind: str, model: str) -> Tier:
            return Tier(f"http://127.0.0.1:{ports[kind, model]}", proxies[kind, model])

        yield Fleet(
            url=cfg.coordinator_url,
            render={m: tier("render", m) for m in (A, B)},
            engine={m: tier("engine", m) for m in (A, B)},
        )


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key=API_KEY, max_retries=0)


def _chat(client: openai.OpenAI, model: str, **extra: Any) -> Any:
    args: dict[str, Any] = {"max_tokens": 12, "temperature": 0, "extra_body": {"return_token_ids": True}, **extra}
    return client.chat.completions.create(model=model, messages=MESSAGES, **args)


def test_models_lists_both(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [A, B]


@pytest.mark.parametrize("model", [A, B])
def test_each_model_is_rendered_by_its_own_sidecar_and_answers_as_its_own_engine(
    client: openai.OpenAI, fleet: Fleet, model: str
) -> None:
    ours = _chat(client, model).model_dump()
    rendered = httpx.post(
        fleet.render[model].direct + "/v1/chat/completions/render",
        json={"model": model, "messages": MESSAGES, "max_tokens": 12}, timeout=60,
    ).json()
    assert ours["prompt_token_ids"] == rendered["token_ids"]
    native = httpx.post(
        fleet.engine[model].direct + "/v1/chat/completions",
        json={"model": model, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "return_token_ids": True},
        timeout=120,
    ).json()
    assert ours["prompt_token_ids"] == native["prompt_token_ids"]
    assert ours["choices"][0]["message"]["content"] == native["choices"][0]["message"]["content"]
    assert ours["choices"][0]["token_ids"] == native["choices"][0]["token_ids"]
    assert ours["usage"]["prompt_tokens"] == native["usage"]["prompt_tokens"]


def test_the_two_models_tokenize_the_same_chat_differently(client: openai.OpenAI) -> None:
    a, b = (_chat(client, m, max_tokens=1).model_dump()["prompt_token_ids"] for m in (A, B))
    assert a != b
    assert max(b) < 3000  # tiny-b's vocabulary; the same text is longer ids in tiny's


@pytest.mark.parametrize("model,other", [(A, B), (B, A)])
def test_a_request_never_reaches_the_other_models_tiers(client: openai.OpenAI, fleet: Fleet, model: str, other: str) -> None:
    before = {t: t.calls() for t in (fleet.render[model], fleet.engine[model], fleet.render[other], fleet.engine[other])}
    whole = _chat(client, model)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == whole.choices[0].message.content
    assert fleet.render[other].calls() == before[fleet.render[other]]
    assert fleet.engine[other].calls() == before[fleet.engine[other]]
    own_render = fleet.render[model].calls()[len(before[fleet.render[model]]):]
    assert own_render.count("POST /v1/chat/completions/render") == 2
    assert "POST /v1/chat/completions/derender" in own_render
    own_engine = fleet.engine[model].calls()[len(before[fleet.engine[model]]):]
    assert own_engine and all(c == "POST /inference/v1/generate" for c in own_engine), own_engine


def test_an_unknown_model_is_a_404_before_any_render_call(client: openai.OpenAI, fleet: Fleet) -> None:
    before = [t.calls() for t in (*fleet.render.values(), *fleet.engine.values())]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="tiny-c", messages=MESSAGES)
    assert err.value.body == {  # type: ignore[comparison-overlap]
        "message": "The model `tiny-c` does not exist.", "type": "NotFoundError", "param": "model", "code": 404,
    }
    assert [t.calls() for t in (*fleet.render.values(), *fleet.engine.values())] == before


def _until(check: Any) -> None:
    """Retry ``check`` until it passes; the snapshot poll adopts a change within a fraction of a second."""
    deadline = time.monotonic() + 30
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_drain_retire_and_activate_through_the_rest_api_reach_traffic_without_a_restart(
    client: openai.OpenAI, fleet: Fleet
) -> None:
    api = httpx.Client(base_url=fleet.url + "/api", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)

    def status(model: str) -> int:
        try:
            _chat(client, model, max_tokens=1)
        except openai.APIStatusError as exc:
            return exc.status_code
        return 200

    try:
        # A stream admitted before the drain runs to its end after it.
        stream = client.chat.completions.create(
            model=B, messages=MESSAGES, max_tokens=48, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = iter(stream)
        first = next(chunks)
        assert api.post(f"/models/{B}/drain").json()["state"] == "draining"

        def drained() -> None:
            assert status(B) == 503

        _until(drained)
        rest = list(chunks)
        assert rest[-1].usage is not None and rest[-1].usage.completion_tokens >= 1
        finish = [c.choices[0].finish_reason for c in (first, *rest) if c.choices and c.choices[0].finish_reason]
        assert finish in (["stop"], ["length"])
        assert status(A) == 200  # the other model is not touched
        assert api.post(f"/models/{B}/retire").json()["state"] == "retired"

        def retired() -> None:
            assert status(B) == 404
            assert [m.id for m in client.models.list().data] == [A]

        _until(retired)
    finally:
        assert api.post(f"/models/{B}/activate").json()["state"] == "active"

    def back() -> None:
        assert status(B) == 200

    _until(back)
    assert [m.id for m in client.models.list().data] == [A, B]
