"""Engine capabilities through the real coordinator (Daphne, as ``make run`` starts it), the real
vLLM render sidecar and simulated engines that report different versions and routes, driven
with the official ``openai`` and ``anthropic`` clients.

The operator's record grants every engine everything; the real capability probe
(``fleet.engine_probes``, run as the Celery version probe runs it, on the coordinator's
database) finds what each engine lacks, and placement and the path choice follow it:

- engine-1 reports vLLM 0.22 (below the 0.23 Token-In floor) and engine-2 serves no
  ``/inference/v1/generate``: neither is given a token-only request;
- engine-3 serves no ``/v1/messages`` nor ``/v1/responses`` of its own, engine-4 runs
  ``--tokens-only`` (no tokenizer): a Messages request that must go native finds no engine that
  can, and the client gets a clear 503 in Anthropic's shape instead of an engine's 404 or 400;
  a Responses request only an engine's own API serves gets a 400 saying so; native chat runs
  on engine-3 only.

The real engine's side: ``test_engine_probe_real.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from dataclasses import replace
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

from motorsite import stack
from motorsite.supervisor import Supervisor, free_port, together
from tests.integration.conftest import API_KEY

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ADMIN_KEY = "mk-test-" + uuid.uuid4().hex[:12]
# engine-1 .. engine-4, in port order.
SIM_ARGS = (
    ["--engine-version", "0.22.0"],
    ["--omit-route", "/inference/v1/generate"],
    ["--omit-route", "/v1/messages", "--omit-route", "/v1/responses"],
    ["--tokens-only"],
)


class Fleet:
    def __init__(self, cfg: stack.StackConfig) -> None:
        self.cfg = cfg
        self.api = httpx.Client(base_url=cfg.coordinator_url + "/api", timeout=30, trust_env=False,
                                headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        self.openai = openai.OpenAI(base_url=cfg.coordinator_url + "/v1", api_key=API_KEY, max_retries=0)
        self.anthropic = anthropic.Anthropic(base_url=cfg.coordinator_url, api_key=None, auth_token=API_KEY,
                                             max_retries=0, timeout=60.0)

    def instances(self) -> list[dict[str, Any]]:
        """The engines' records in ``SIM_ARGS`` order (by their URLs)."""
        by_url = {i["url"].rstrip("/"): i for i in self.api.get("/instances").json()}
        return [by_url[url] for url in self.cfg.engine_urls]

    def rendered(self, source: str) -> float:
        """The coordinator's count of renders by ``source`` (``render``: the sidecar; ``local``)."""
        text = httpx.get(self.cfg.coordinator_url + "/metrics", timeout=10, trust_env=False).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("motor_render_outcomes_total{") and f'source="{source}"' in line)

    def stats(self) -> list[dict[str, Any]]:
        return [httpx.get(url + "/sim/stats", timeout=10, trust_env=False).json() for url in self.cfg.engine_urls]

    def adopted(self) -> None:
        """Wait until the coordinator serves the fleet's latest control version (a snapshot poll,
        250 ms, in practice; 30 s is a watchdog, not a timing assertion)."""
        version = self.api.get("/fleet/status").json()["control_version"]
        deadline = time.monotonic() + 30
        while httpx.get(self.cfg.coordinator_url + "/healthz", timeout=10, trust_env=False).json()["fleet_version"] < version:
            assert time.monotonic() < deadline, "the coordinator never adopted the change"
            time.sleep(0.05)


def run_probe(cfg: stack.StackConfig) -> Any:
    """The real capability probe, as the Celery version probe runs it, on the coordinator's database."""
    script = ("from fleet.engine_probes import probe_engine_capabilities; import json; "
              "print(json.dumps(probe_engine_capabilities()))")
    out = subprocess.run([cfg.app_python, str(stack.ROOT / "manage.py"), "shell", "-c", script], check=True,
                         env={**os.environ, **stack.coordinator_env(cfg)}, cwd=stack.ROOT, capture_output=True,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fleet(tiers: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The session's real sidecar (``conftest.tiers``) renders; the engines are this module's simulators."""
    db = tmp_path_factory.mktemp("engine-caps") / "coordinator.sqlite3"
    cfg = replace(
        tiers, engines="sim", engine_ports=tuple(free_port() for _ in SIM_ARGS),
        prefill_ports=(), decode_ports=(), coordinator_port=free_port(), database_url=f"sqlite:///{db}",
        celery=False, restart=None, log_dir=tiers.log_dir / "engine-caps",
        extra_env={"MOTOR_DEMO_ADMIN_KEY": ADMIN_KEY},
    )
    specs = []
    for spec, extra in zip(stack.engine_specs(cfg), SIM_ARGS, strict=True):
        spec = replace(spec, argv=[*spec.argv, *extra])
        if "/inference/v1/generate" in extra:
            # No generate to be ready with: a tokenize of ids says it is up.
            spec = replace(spec, ready_post=("/tokenize", {"model": cfg.served_model_name, "prompt": [1]}))
        specs.append(replace(spec, ready_timeout=600.0))
    with Supervisor(together(specs)):
        stack.prepare_database(cfg)
        with Supervisor([replace(stack.coordinator_spec(cfg), ready_timeout=300.0)]):
            fleet = Fleet(cfg)
            for n, instance in enumerate(fleet.instances()):
                # engine-1 and -2 are kept off the native path by their record; -3 and -4 are granted it.
                native = n >= 2
                assert fleet.api.patch(f"/instances/{instance['id']}", json={
                    "cap_native_openai": native, "cap_tokenizer": True, "cap_token_generate": True,
                }).status_code == 200
            found = run_probe(cfg)
            assert all(found.values()), found
            fleet.adopted()
            yield fleet


def test_it_records_each_engines_capabilities_and_shows_them(fleet: Fleet) -> None:
    engines = fleet.instances()
    assert engines[0]["capabilities"]["version"] == "0.22.0"
    assert "older than 0.23" in engines[0]["traffic"]
    assert engines[1]["capabilities"]["routes"]["generate"] is False
    assert engines[2]["capabilities"]["routes"]["native"] == ["chat", "completions"]
    assert engines[3]["capabilities"]["tokenizer_loaded"] is False
    assert "tokens-only" in engines[3]["traffic"]


def test_it_never_gives_a_token_only_request_to_an_engine_below_the_floor_or_without_generate(fleet: Fleet) -> None:
    before, by_sidecar, local = fleet.stats(), fleet.rendered("render"), fleet.rendered("local")
    for i in range(6):
        out = fleet.openai.chat.completions.create(
            model=fleet.cfg.served_model_name, messages=[{"role": "user", "content": f"count {i}"}],
            max_tokens=4, temperature=0, stream=i % 2 == 1,
        )
        if i % 2 == 0:
            assert out.choices[0].finish_reason in ("stop", "length")
        else:
            assert [c for c in out]  # the stream ran to its end
    after = fleet.stats()
    received = [a["requests_received"] - b["requests_received"] for a, b in zip(after, before, strict=True)]
    assert received[0] == received[1] == 0
    assert received[2] + received[3] == 6
    # Each rendered by the real sidecar, none by the local fallback.
    assert (fleet.rendered("render") - by_sidecar, fleet.rendered("local") - local) == (6, 0)


@pytest.fixture
def render_off(fleet: Fleet) -> Iterator[None]:
    """Render disabled: every request takes an engine's own API (reason ``render_disabled``)."""
    config = fleet.api.get("/render-configs").json()[0]["id"]
    assert fleet.api.post(f"/render-configs/{config}/publish", json={"enable": False}).status_code == 200
    fleet.adopted()
    try:
        yield
    finally:
        assert fleet.api.post(f"/render-configs/{config}/publish", json={"enable": True}).status_code == 200
        fleet.adopted()


def test_it_answers_a_clear_error_when_no_engine_serves_the_native_route(fleet: Fleet, render_off: None) -> None:
    before = fleet.stats()
    with pytest.raises(anthropic.APIStatusError) as raised:
        fleet.anthropic.messages.create(
            model=fleet.cfg.served_model_name, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
        )
    assert raised.value.status_code == 503
    body = raised.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    assert "no engine of this model serves /v1/messages" in body["error"]["message"]

    with pytest.raises(openai.BadRequestError) as refused:
        fleet.openai.responses.create(model=fleet.cfg.served_model_name, input="hi", previous_response_id="resp_1")
    assert "with a tokenizer loaded" in refused.value.message

    out = fleet.openai.chat.completions.create(
        model=fleet.cfg.served_model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    after = fleet.stats()
    native = [{k: a["native_requests"].get(k, 0) - b["native_requests"].get(k, 0) for k in ("chat", "messages",
               "responses")} for a, b in zip(after, before, strict=True)]
    # The tokens-only engine is never asked; the chat went to the one engine that serves it.
    assert native[3] == {"chat": 0, "messages": 0, "responses": 0}
    assert native[2] == {"chat": 1, "messages": 0, "responses": 0}

