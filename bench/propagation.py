"""Control-plane propagation: from an API drain returning to live traffic avoiding the instance.

Starts its own stack on free ports of 127.0.0.1 (logs in a temp directory): the real vLLM render
sidecar, two ``enginesim`` engines and one coordinator (Daphne, its own SQLite database, an admin
key for ``/api``). Then, per trial:

1. both instances are active (undrained) and one request is sent; the engine that served it
   (the one whose ``/sim/stats`` ``requests_received`` moved) is the trial's target, so the
   target is always an instance the scheduler was really choosing;
2. ``POST /api/instances/{id}/drain`` on the target; the clock starts when it returns;
3. chat requests are sent one at a time (each followed by a read of the target's counter, so
   every request is attributed exactly) for ``--window`` seconds;
4. the delay is the send time, relative to the drain returning, of the first request after
   which no request reached the target (0 if the very first one avoided it: the change had
   propagated before the first request could observe it). Upper bound, resolution one
   request round trip (also reported);
5. undrain, and wait until the undrain has propagated (a request reaches the target again).

    python3 -m toolchain exec bench/propagation.py [--trials 20] [--window 1.5] [--write]

``--write`` replaces this benchmark's section of ``bench/RESULTS.md`` (or appends it).
Reports numbers only; nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    RESULTS,  # noqa: E402
    bench_stack,
    command_line,
    loadavg,
    machine,
    percentile,
    require_env,
    write_section,
)
from motorsite import stack  # noqa: E402
from motorsite.supervisor import Supervisor  # noqa: E402

SECTION = "## bench/propagation.py"
CLIENT_KEY = "sk-bench-" + uuid.uuid4().hex[:12]
ADMIN_KEY = "mk-bench-" + uuid.uuid4().hex[:12]
TIMEOUT = httpx.Timeout(30.0, connect=5.0)


def _env(name: str) -> str:
    return require_env(name, "bench/propagation.py")


class Probe:
    """Sends chat requests through the coordinator and tells which sim engine served each."""

    def __init__(self, client: httpx.Client, cfg: stack.StackConfig) -> None:
        self.client = client
        self.cfg = cfg
        self.n = 0

    def counts(self) -> dict[str, int]:
        return {u: self.client.get(f"{u}/sim/stats").json()["requests_received"] for u in self.cfg.engine_urls}

    def count(self, url: str) -> int:
        return self.client.get(f"{url}/sim/stats").json()["requests_received"]

    def chat(self) -> None:
        self.n += 1
        r = self.client.post(
            f"{self.cfg.coordinator_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {CLIENT_KEY}"},
            # A distinct prompt each time: no prefix-cache affinity pulls traffic to one engine.
            json={
                "model": self.cfg.served_model_name,
                "messages": [{"role": "user", "content": f"probe {self.n} {uuid.uuid4().hex[:6]}"}],
                "max_tokens": 2,
            },
        )
        if r.status_code != 200:
            raise RuntimeError(f"chat failed: HTTP {r.status_code}: {r.text[:300]}")

    def served_by(self) -> str:
        before = self.counts()
        self.chat()
        after = self.counts()
        moved = [u for u in after if after[u] != before[u]]
        if len(moved) != 1:
            raise RuntimeError(f"could not attribute a request: counters {before} -> {after}")
        return moved[0]


def admin(client: httpx.Client, cfg: stack.StackConfig, method: str, path: str) -> httpx.Response:
    r = client.request(method, f"{cfg.coordinator_url}/api{path}", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    r.raise_for_status()
    return r


def trial(client: httpx.Client, cfg: stack.StackConfig, probe: Probe, ids: dict[str, int], window: float) -> dict[str, float]:
    target = probe.served_by()
    t_call = time.perf_counter()
    admin(client, cfg, "POST", f"/instances/{ids[target]}/drain")
    t0 = time.perf_counter()
    sends: list[tuple[float, bool]] = []  # (send time after the drain returned, reached target)
    rtts: list[float] = []
    while time.perf_counter() - t0 < window:
        before = probe.count(target)
        sent = time.perf_counter()
        probe.chat()
        hit = probe.count(target) != before
        rtts.append(time.perf_counter() - sent)
        sends.append((sent - t0, hit))
    last_hit = max((i for i, (_, hit) in enumerate(sends) if hit), default=-1)
    if last_hit == len(sends) - 1:
        raise RuntimeError(f"traffic still reached the drained instance {window}s after the drain returned")
    delay = 0.0 if last_hit < 0 else sends[last_hit + 1][0]
    # Undrain and wait until the target takes traffic again, so the next trial starts clean.
    admin(client, cfg, "POST", f"/instances/{ids[target]}/undrain")
    deadline = time.perf_counter() + 10.0
    while probe.served_by() != target:
        if time.perf_counter() > deadline:
            raise RuntimeError("the undrained instance never took traffic again")
    return {
        "delay": delay,
        "api_call": t0 - t_call,
        "requests": float(len(sends)),
        "hits": float(sum(hit for _, hit in sends)),
        "rtt": percentile(rtts, 0.5) or 0.0,
    }


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.1f}"


def section(args: argparse.Namespace, rows: list[dict[str, float]], load: tuple[str, str], notes: list[str]) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION,
        "",
        f"- date: {now}",
        f"- machine: {machine()}; load average (1/5/15 min) {load[0]} before, {load[1]} after "
        "(the machine may be shared)",
        f"- command: `{command_line()}` (run from the repository root)",
        f"- setup: one coordinator (Daphne, SQLite, in-memory channel layer), the real render sidecar, "
        f"two enginesim engines; {args.trials} trials; each drains (`POST /api/instances/{{id}}/drain`, "
        "admin key) the instance that served the request just before, then sends non-streaming chat "
        f"requests one at a time for {args.window}s, attributing each via the sims' `/sim/stats`",
        "- delay: send time (after the drain call returned) of the first request after which none "
        "reached the drained instance; 0 = the first request already avoided it. An upper bound with "
        "a resolution of one request round trip",
        "",
        "| metric (ms) | p50 | p99 | max |",
        "|---|---:|---:|---:|",
    ]
    for label, key in (
        ("propagation delay", "delay"),
        ("drain API call (request → response)", "api_call"),
        ("probe request round trip (resolution)", "rtt"),
    ):
        values = [r[key] for r in rows]
        lines.append(
            f"| {label} | {_ms(percentile(values, 0.5))} | {_ms(percentile(values, 0.99))} | {_ms(max(values))} |"
        )
    hits = sum(r["hits"] for r in rows)
    reqs = sum(r["requests"] for r in rows)
    lines += [
        "",
        f"- {int(reqs)} requests after drains returned, {int(hits)} of them reached the drained instance; "
        f"max delay {'under' if max(r['delay'] for r in rows) < 1.0 else 'NOT under'} the one-second target",
        "- coordinators poll the control version every `MOTOR_SNAPSHOT_POLL_MS` (default 250 ms), so "
        "a drain is not read-your-writes: requests in the first poll interval after it returned may "
        "still reach the instance; the delay is bounded by that interval plus one snapshot rebuild",
        *[f"- {n}" for n in notes],
    ]
    return "\n".join(lines) + "\n"


def write_results(text: str) -> None:
    write_section(SECTION, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--window", type=float, default=1.5, help="seconds of traffic observed after each drain")
    parser.add_argument("--write", action="store_true", help=f"write the section into {RESULTS.relative_to(ROOT)}")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="motorsite-bench-prop-"))
    cfg = bench_stack(
        "bench/propagation.py", engines="sim", engine_count=2, api_key=CLIENT_KEY, log_dir=tmp,
        database_url=f"sqlite:///{tmp / 'coordinator.sqlite3'}", extra_env={"MOTOR_DEMO_ADMIN_KEY": ADMIN_KEY},
    )
    print(f"logs: {tmp}", flush=True)
    rows: list[dict[str, float]] = []
    notes: list[str] = []
    with contextlib.ExitStack() as exits:
        print("starting render sidecar and two enginesim engines ...", flush=True)
        exits.enter_context(Supervisor([stack.render_spec(cfg), *stack.engine_specs(cfg)]))
        stack.prepare_database(cfg)
        print("starting coordinator ...", flush=True)
        exits.enter_context(Supervisor([stack.coordinator_spec(cfg)]))
        client = exits.enter_context(httpx.Client(timeout=TIMEOUT, trust_env=False))
        ids = {i["url"].rstrip("/"): i["id"] for i in admin(client, cfg, "GET", "/instances").json()}
        missing = [u for u in cfg.engine_urls if u not in ids]
        if missing:
            sys.exit(f"instances not registered: {missing} (have {ids})")
        probe = Probe(client, cfg)
        served = [probe.served_by() for _ in range(10)]  # warm-up: connections, first-request paths
        notes.append(
            "warm-up share per engine: "
            + ", ".join(f"engine-{n + 1} {served.count(u)}/10" for n, u in enumerate(cfg.engine_urls))
        )
        load_before = loadavg()
        for n in range(args.trials):
            row = trial(client, cfg, probe, ids, args.window)
            rows.append(row)
            print(f"trial {n + 1}/{args.trials}: delay {_ms(row['delay'])} ms, hits {int(row['hits'])}", flush=True)
        load_after = loadavg()
        print("stopping the stack ...", flush=True)
    text = section(args, rows, (load_before, load_after), notes)
    print()
    print(text)
    if args.write:
        write_results(text)
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    if not args.keep_logs:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
