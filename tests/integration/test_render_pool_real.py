"""A render pool of two real vLLM render sidecars behind the real coordinator (Daphne on a socket),
driven with the official ``openai`` client.

The engine is the project's simulator, a token every 100 ms with no EOS, so a stream lives long
enough to lose its sidecar in the middle; its tokens are a function of the prompt (greedy
either way), so an undisturbed run's text is the reference. Nothing restarts a process here
(``restart=None``): a stream that completes after its sidecar was killed did not wait for a
restart. The pool is changed through the REST API; a fake member that reports vLLM 0.26 beside
a real 0.33 shows a mixed-version pool derendering streams only on the member that can, after
the real probe (``fleet.render_pool_probes``) recorded both.

The pool's first sidecar is the session's (``conftest.tiers``, the same command), which no test
here stops; the second is this module's own, the one a test kills.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from motorsite import stack
from motorsite.supervisor import ProcessSpec, Supervisor, free_port, together
from tests.integration import early
from tests.integration.conftest import API_KEY

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ADMIN_KEY = "mk-test-" + uuid.uuid4().hex[:12]
MAX_TOKENS = 40
IDLE_WAIT_S = 10.0


class Pool:
    def __init__(self, cfg: stack.StackConfig, pids: dict[str, int]) -> None:
        self.cfg = cfg
        self.pids = pids
        self.api = httpx.Client(base_url=cfg.coordinator_url, timeout=30, trust_env=False,
                                headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        self.config_id = self.api.get("/api/render-configs").json()[0]["id"]
        self.client = openai.OpenAI(base_url=cfg.coordinator_url + "/v1", api_key=API_KEY, max_retries=0)

    def members(self) -> list[dict[str, Any]]:
        return self.api.get(f"/api/render-configs/{self.config_id}/sidecars").json()

    def add(self, port: int) -> None:
        assert self.api.post(f"/api/render-configs/{self.config_id}/sidecars",
                             json={"host": stack.HOST, "port": port}).status_code == 201

    def remove(self, port: int) -> None:
        [member] = [m for m in self.members() if m["port"] == port]
        assert self.api.delete(f"/api/render-configs/{self.config_id}/sidecars/{member['id']}").status_code == 204

    def adopted(self) -> None:
        """Wait until the coordinator serves the fleet's latest control version (a snapshot poll,
        250 ms, in practice; 30 s is a watchdog, not a timing assertion)."""
        version = self.api.get("/api/fleet/status").json()["control_version"]
        deadline = time.monotonic() + 30
        while self.api.get("/healthz").json()["fleet_version"] < version:
            assert time.monotonic() < deadline, "the coordinator never adopted the change"
            time.sleep(0.05)

    def stream(self, word: str, *, on_chunk: Any = None) -> tuple[str, str | None]:
        text, finish = [], None
        stream = self.client.chat.completions.create(
            model=self.cfg.served_model_name, messages=[{"role": "user", "content": f"Tell a story about {word}"}],
            max_tokens=MAX_TOKENS, temperature=0, stream=True,
        )
        for i, chunk in enumerate(stream):
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
            if on_chunk is not None:
                on_chunk(i)
        return "".join(text), finish

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.cfg.coordinator_url + "/metrics", timeout=10, trust_env=False).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def assert_idle(self) -> None:
        """Nothing in flight in the coordinator, nothing running on the simulator."""
        deadline = time.monotonic() + IDLE_WAIT_S
        while True:
            metrics = httpx.get(self.cfg.coordinator_url + "/metrics", timeout=10, trust_env=False).text
            assert "# TYPE motor_engine_in_flight_tokens gauge" in metrics
            inflight = [line for line in metrics.splitlines()
                        if line.startswith("motor_engine_in_flight_tokens{") and float(line.split()[-1]) != 0]
            stats = httpx.get(self.cfg.engine_urls[0] + "/sim/stats", timeout=10, trust_env=False).json()
            if not inflight and not stats["running"] and not stats["active_streams"]:
                return
            assert time.monotonic() < deadline, (inflight, stats)
            time.sleep(0.1)


def _pool(base: stack.StackConfig) -> tuple[list[ProcessSpec], stack.StackConfig]:
    cfg = replace(
        base, engines="sim", render_member_ports=(free_port(),),
        engine_ports=(free_port(),), prefill_ports=(), decode_ports=(), coordinator_port=free_port(),
        celery=False, restart=None,
        log_dir=base.log_dir / "render-pool", extra_env={"MOTOR_DEMO_ADMIN_KEY": ADMIN_KEY},
    )
    engine = stack.engine_specs(cfg)[0]
    # A loaded machine starts a sidecar slowly: the simulator waits its turn with room to spare.
    engine = replace(engine, argv=[*engine.argv, "--tpot-ms", "100", "--eos-probability", "0"], ready_timeout=120.0)
    # The member only: ``render`` on ``render_port`` is the session's sidecar (``base``'s).
    _, member = stack.render_specs(cfg)
    return together([member, engine]), cfg


# Begun in the background while the tests before this module run (tests/integration/early.py).
POOL = early.rig("render-pool", _pool, fixture="pool", module=str(Path(__file__).resolve()))


@pytest.fixture(scope="module")
def pool(tiers: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    db = tmp_path_factory.mktemp("render-pool") / "coordinator.sqlite3"
    with POOL.running(tiers) as (cfg, own):
        assert cfg.render_port == tiers.render_port  # the session's sidecar first, this module's second
        cfg = replace(cfg, database_url=f"sqlite:///{db}")
        stack.prepare_database(cfg)
        with Supervisor([stack.coordinator_spec(cfg)]):
            yield Pool(cfg, dict(own.pids))


# -- a fake member: vLLM 0.26 on the outside, the real sidecar inside ------------------------------


class OldSidecar(ThreadingHTTPServer):
    """Reports vLLM 0.26.0 and forwards everything else to a real sidecar, recording each call."""

    def __init__(self, real: str) -> None:
        self.real = real
        self.calls: list[tuple[str, bool]] = []  # (path, stream)
        super().__init__((stack.HOST, 0), _Forward)

    @property
    def port(self) -> int:
        return self.server_address[1]


class _Forward(BaseHTTPRequestHandler):
    server: OldSidecar

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/version":
            return self._answer(200, json.dumps({"version": "0.26.0"}).encode())
        real = httpx.get(self.server.real + self.path, timeout=30, trust_env=False)
        self._answer(real.status_code, real.content)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.calls.append((self.path, bool(json.loads(body).get("stream"))))
        real = httpx.post(self.server.real + self.path, content=body, timeout=30, trust_env=False,
                          headers={"Content-Type": "application/json"})
        self._answer(real.status_code, real.content)


def probe(cfg: stack.StackConfig) -> Any:
    """The real probe of every member, run as the Celery task runs it, on the coordinator's database."""
    script = "from fleet.render_pool_probes import probe_render_pool; import json; print(json.dumps(probe_render_pool()))"
    out = subprocess.run([cfg.app_python, str(stack.ROOT / "manage.py"), "shell", "-c", script], check=True,
                         env={**os.environ, **stack.coordinator_env(cfg)}, cwd=stack.ROOT, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_mixed_version_pool_derenders_streams_only_on_the_member_that_can(pool: Pool) -> None:
    reference, finish = pool.stream("lighthouses")
    assert finish == "length" and reference
    a, b = pool.cfg.render_port, pool.cfg.render_member_ports[0]
    old = OldSidecar(f"http://{stack.HOST}:{a}")
    thread = threading.Thread(target=old.serve_forever, daemon=True)
    thread.start()
    try:
        # The old member first in the pool's order (a tie on outstanding calls goes to it), the real B after.
        pool.add(old.port)
        pool.remove(a)
        pool.remove(b)  # (a pool keeps one member: the old one is in first)
        pool.add(b)
        found = probe(pool.cfg)
        assert set(found.values()) == {True}
        members = {m["port"]: m for m in pool.members()}
        assert members[old.port]["sidecar_version"] == "0.26.0" and not members[old.port]["capabilities"]["streaming_derender"]
        assert "older than 0.27" in members[old.port]["traffic"]
        assert members[b]["capabilities"]["streaming_derender"] and members[b]["capabilities"]["routes"]["derender"]
        pool.adopted()

        text, finish = pool.stream("lighthouses")
        assert (text, finish) == (reference, "length")  # the stream stayed token-only, derendered by B
        assert [c for c in old.calls if c[0].endswith("/derender")] == []
        # The old member does serve what it can: a whole answer's render and derender.
        out = pool.client.chat.completions.create(
            model=pool.cfg.served_model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0)
        assert out.choices[0].finish_reason == "length"
        assert ("/v1/chat/completions/derender", False) in old.calls
        assert pool.metric("motor_route_decisions_total", path="native") == 0
    finally:
        if a not in {m["port"] for m in pool.members()}:
            pool.add(a)
        pool.remove(old.port)
        old.shutdown()
        old.server_close()
    pool.adopted()
    pool.assert_idle()


def test_a_stream_survives_the_loss_of_its_sidecar_without_waiting_for_a_restart(pool: Pool) -> None:
    reference, finish = pool.stream("harbours")
    assert finish == "length" and reference
    own = pool.cfg.render_member_ports[0]
    if pool.members()[0]["port"] != own:
        # This module's own sidecar leads the pool (the session's goes last): it is the one killed.
        pool.remove(pool.cfg.render_port)
        pool.add(pool.cfg.render_port)
        pool.adopted()
    first = pool.members()[0]["port"]  # ties go to the pool's first member: the stream's sidecar
    assert first == own
    pid = pool.pids["render-member-2"]
    render_ok = pool.metric("motor_render_outcomes_total", source="render")
    local = pool.metric("motor_render_outcomes_total", source="local")

    def kill_mid_stream(i: int) -> None:
        if i == 5:
            os.killpg(pid, signal.SIGKILL)

    text, finish = pool.stream("harbours", on_chunk=kill_mid_stream)
    assert (text, finish) == (reference, "length")
    with pytest.raises(httpx.ConnectError):  # gone, and nothing restarts it here
        httpx.get(f"http://{stack.HOST}:{first}/health", timeout=5, trust_env=False)
    # Once the process-wide cooldown has passed, a new request's render tries the dead member
    # first again (it leads the pool order) and fails over to the other one, not to the local tokenizer.
    time.sleep(5.5)
    out = pool.client.chat.completions.create(
        model=pool.cfg.served_model_name, messages=[{"role": "user", "content": "harbours"}], max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert pool.metric("motor_render_outcomes_total", source="render") == render_ok + 2
    assert pool.metric("motor_render_outcomes_total", source="local") == local
    pool.assert_idle()
