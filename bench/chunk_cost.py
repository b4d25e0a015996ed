"""What one streamed chunk, or one JSON request, costs the coordinator, counted rather than timed
(issue 34).

``bench/hotpath.py`` reads CPU from /proc in 10 ms ticks on a shared machine; this script counts.
It starts the real render sidecar and one paced ``enginesim`` engine, and a coordinator from this
tree (Daphne, as ``make run``, or uvicorn with ``--server uvicorn``) and, with ``--baseline REV``,
one from a checkout of REV, each under an instrument switched on only around the measured requests:

    callgrind  valgrind's callgrind (instrumentation off until the measurement): instructions
               executed by the whole coordinator process (every thread) per stream
               (``--separate-threads``: also the event loop's thread alone, without the report
               writer's and Django's threads, whose database writes follow the clock)
    cprofile   cProfile on the event loop's thread: Python and C function calls per chunk, and
               the functions whose calls per chunk differ between the trees (``--top``)
    proc       no instrument (``--json`` only): the coordinator's CPU from /proc in 10 ms ticks,
               all threads and the event loop's (the main thread) apart, to put milliseconds
               beside the counts (run enough requests for the ticks)

Each coordinator serves ``--streams`` chat streams of 32 tokens and as many of 1 token, one at a
time (``ignore_eos``, ``include_usage``); what a chunk costs is the difference over the 31 tokens
more, counted as the frames the client got (one a derender call). The engine is paced
(``--tpot-ms``, 150 by default under callgrind, 30 under cProfile) so that each token reaches the
coordinator alone and gets its own derender call even when the instrument slows the coordinator
down; where some merged anyway (a loaded machine), the frames say so.

``--json``: each coordinator serves ``--streams`` non-streaming chat requests of 32 tokens
instead (``bench/peers.py``'s JSON request: one generate, one derender), and what is counted is
per request: instructions, or function calls and the functions whose calls per request differ.
The engine's pace does not change what the coordinator does for them (1 ms by default).
``--idle S`` adds a block of S seconds without a request: what each coordinator costs per second
of merely running (its timers and threads), which a CPU figure per request taken from /proc
(``bench/peers.py``, ``bench/hotpath.py``) charges to requests by how long they last.
``--scrapes N`` adds a block of N ``GET /metrics`` (Prometheus text): what one scrape costs.
``--local`` turns ``RenderConfig.local_stream_detokenize`` on in every coordinator's database: the
coordinator derenders a plain stream's chunks itself, and a chunk makes no sidecar call.

    python3 -m toolchain exec bench/chunk_cost.py [--tool callgrind|cprofile|proc] [--baseline REV]
                                                  [--json] [--idle S] [--scrapes N] [--streams 10] [--local]
                                                  [--tpot-ms MS] [--top 40] [--server daphne|uvicorn]

Reports numbers only; nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pstats
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import baseline_tree, bench_stack, coordinator_from, loadavg, parse_stat, tree_cpu_seconds  # noqa: E402
from motorsite import stack  # noqa: E402
from motorsite.supervisor import ProcessSpec, Supervisor, free_port  # noqa: E402
from serving.pipeline.http11 import Http11Client  # noqa: E402

API_KEY = "sk-bench-" + uuid.uuid4().hex[:12]
TIMEOUT = httpx.Timeout(600.0, connect=30.0)
LONG, SHORT = 32, 1

# Run a module as ``python -m`` would, with cProfile switched on by SIGUSR1 and written by SIGUSR2.
PROFILED = """
import cProfile, os, runpy, signal, sys
_p = cProfile.Profile()
def _on(*_a): _p.enable()
def _off(*_a):
    _p.disable(); _p.dump_stats(os.environ["BENCH_PROFILE_OUT"]); _p.clear()
signal.signal(signal.SIGUSR1, _on)
signal.signal(signal.SIGUSR2, _off)
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def instrumented(spec: ProcessSpec, tool: str, out: Path) -> ProcessSpec:
    """``spec`` (``python -m <server> ...``) run under ``tool``, its output going to ``out``."""
    python, dash_m, *rest = spec.argv
    assert dash_m == "-m", spec.argv
    if tool == "proc":
        return spec
    if tool == "callgrind":
        argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                f"--callgrind-out-file={out}", python, "-m", *rest]
        return replace(spec, argv=argv, ready_timeout=600.0)
    return replace(spec, argv=[python, "-c", PROFILED, *rest], env={**spec.env, "BENCH_PROFILE_OUT": str(out)},
                   ready_timeout=300.0)


def body(i: int, max_tokens: int, *, stream: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"Request {i:05d}: say something about the sea."}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
    }
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


async def streams(client: Http11Client, url: str, first: int, count: int, max_tokens: int) -> int:
    """Serve ``count`` streams one at a time; the number of SSE data frames the client got."""
    frames = 0
    for i in range(first, first + count):
        async with client.stream("POST", url + "/v1/chat/completions", json=body(i, max_tokens),
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            raw = b"".join([piece async for piece in r.aiter_raw()])
            if r.status_code != 200 or not raw.rstrip().endswith(b"data: [DONE]"):
                raise RuntimeError(f"{r.status_code}: {raw[-300:]!r}")
            frames += raw.count(b"data: ")
    return frames


async def jsons(client: Http11Client, url: str, first: int, count: int, max_tokens: int) -> int:
    """Serve ``count`` non-streaming requests one at a time; the number served."""
    for i in range(first, first + count):
        r = await client.post(url + "/v1/chat/completions", json=body(i, max_tokens, stream=False),
                              headers={"Authorization": f"Bearer {API_KEY}"})
        reply = r.json()
        if r.status_code != 200 or reply["usage"]["completion_tokens"] != max_tokens:
            raise RuntimeError(f"{r.status_code}: {r.content[-300:]!r}")
    return count


async def idle(client: Http11Client, url: str, first: int, seconds: int, max_tokens: int) -> int:
    """No request for ``seconds``."""
    await asyncio.sleep(seconds)
    return 0


async def scrapes(client: Http11Client, url: str, first: int, count: int, max_tokens: int) -> int:
    """``count`` reads of ``/metrics``; the bytes of the last."""
    size = 0
    for _ in range(count):
        r = await client.get(url + "/metrics")
        if r.status_code != 200:
            raise RuntimeError(f"/metrics: {r.status_code}")
        size = len(r.content)
    return size


def callgrind(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True, timeout=120)


def total_ir(path: Path) -> int:
    """The ``totals:`` instruction count of one callgrind dump."""
    for line in path.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


class Measure:
    """Switches one coordinator's instrument on around a block of streams and reads what it counted."""

    def __init__(self, tool: str, pid: int, out: Path) -> None:
        self.tool, self.pid, self.out = tool, pid, out

    def loop_cpu_seconds(self) -> float:
        """CPU seconds of the coordinator's main thread (Daphne's reactor and the event loop)."""
        own = parse_stat(Path(f"/proc/{self.pid}/task/{self.pid}/stat").read_text()).own
        return own / os.sysconf("SC_CLK_TCK")

    async def run(self, serve: Any, client: Http11Client, url: str, first: int, count: int, max_tokens: int,
                  label: str) -> tuple[int, Any]:
        if self.tool == "proc":
            cpu0, loop0 = tree_cpu_seconds(self.pid), self.loop_cpu_seconds()
            frames = await serve(client, url, first, count, max_tokens)
            return frames, (None, tree_cpu_seconds(self.pid) - cpu0, self.loop_cpu_seconds() - loop0)
        if self.tool == "callgrind":
            callgrind(self.pid, "--zero")
            callgrind(self.pid, "--instr=on")
        else:
            os.kill(self.pid, signal.SIGUSR1)
            await asyncio.sleep(0.5)
        frames = await serve(client, url, first, count, max_tokens)
        if self.tool == "callgrind":
            callgrind(self.pid, "--instr=off")
            before = set(self.out.parent.glob(self.out.name + ".*"))
            callgrind(self.pid, f"--dump={label}")
            for _ in range(600):
                new = set(self.out.parent.glob(self.out.name + ".*")) - before
                if new:
                    time.sleep(2.0)  # every thread's file, written whole
                    new = set(self.out.parent.glob(self.out.name + ".*")) - before
                    # One file per thread (``<out>.<part>-<thread>``): thread 1 runs the event loop.
                    loop = [d for d in new if d.name.endswith("-01")]
                    return frames, (loop[0] if loop else None, sum(total_ir(d) for d in new),
                                    sum(total_ir(d) for d in loop))
                time.sleep(0.2)
            raise RuntimeError("callgrind wrote no dump")
        os.kill(self.pid, signal.SIGUSR2)
        for _ in range(100):
            await asyncio.sleep(0.2)
            if self.out.exists():
                break
        await asyncio.sleep(0.5)
        dump = self.out.with_name(f"{self.out.name}.{label}")
        self.out.rename(dump)
        return frames, (dump, pstats.Stats(str(dump)))


def calls_by_function(stats: pstats.Stats) -> dict[str, tuple[int, float]]:
    """``file:name`` with the tree-specific root cut off -> (calls, own seconds)."""
    out: dict[str, tuple[int, float]] = {}
    for (file, _line, name), (_cc, nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        file = re.sub(r"^.*?/(serving|motorsite|catalog|fleet)/", r"\1/", file)
        file = re.sub(r"^.*?/site-packages/", "", file)
        file = re.sub(r"^.*?/lib/python3\.\d+/", "", file)
        key = f"{file}:{name}"
        calls, own = out.get(key, (0, 0.0))
        out[key] = (calls + nc, own + tt)
    return out


def per_chunk(long: Any, short: Any, chunks: int) -> dict[str, tuple[float, float]]:
    """Calls and own µs per extra chunk: what the 32-token block took over the 1-token block, over
    the ``chunks`` more frames it sent (31 a stream when no event merged with another)."""
    a, b = calls_by_function(long), calls_by_function(short)
    return {k: ((a.get(k, (0, 0.0))[0] - b.get(k, (0, 0.0))[0]) / chunks,
                (a.get(k, (0, 0.0))[1] - b.get(k, (0, 0.0))[1]) / chunks * 1e6) for k in a.keys() | b.keys()}


async def measure(args: argparse.Namespace, coords: dict[str, tuple[str, Measure]]) -> dict[str, dict[str, Any]]:
    client = Http11Client(TIMEOUT)
    results: dict[str, dict[str, Any]] = {name: {} for name in coords}
    serve, sizes = (jsons, (LONG,)) if args.json else (streams, (LONG, SHORT))
    try:
        for url, _m in coords.values():  # warm-up: connections, imports, caches
            for tokens in sizes:
                await serve(client, url, 900_000 + tokens * 10, 3, tokens)
        for r in range(args.repeat):
            order = list(coords) if r % 2 == 0 else list(coords)[::-1]
            for name in order:
                url, m = coords[name]
                for tokens in sizes:
                    frames, got = await m.run(serve, client, url, r * 1000 + tokens * 10, args.streams, tokens,
                                              f"{name}-{tokens}-{r}")
                    results[name].setdefault(tokens, []).append((frames, got))
                    counted = f"{got[1]:,} Ir, event loop {got[2]:,}" if args.tool == "callgrind" else ""
                    print(f"{name} {tokens} tokens round {r}: {frames} frames {counted}", flush=True)
                if args.idle:
                    _none, got = await m.run(idle, client, url, 0, args.idle, 0, f"{name}-idle-{r}")
                    results[name].setdefault("idle", []).append(got)
                if args.scrapes:
                    size, got = await m.run(scrapes, client, url, 0, args.scrapes, 0, f"{name}-scrapes-{r}")
                    results[name].setdefault("scrapes", []).append((size, got))
    finally:
        await client.aclose()
    return results


def report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> str:
    lines = [f"- streams per block: {args.streams}; blocks per tree: {args.repeat}; enginesim --tpot-ms {args.tpot_ms:g}", ""]
    n = args.streams
    if args.json:
        return report_json(args, results)
    if args.tool == "callgrind":
        lines += ["| tree | threads | Ir per 32-token stream | Ir per 1-token stream | frames per 32-token stream | "
                  "Ir per chunk (the difference over the extra frames) |", "|---|---|---:|---:|---:|---:|"]
        for name, by_tokens in results.items():
            for (f_long, got_long), (f_short, got_short) in zip(by_tokens[LONG], by_tokens[SHORT], strict=True):
                for which, i in (("all", 1), ("event loop", 2)):
                    ir_long, ir_short = got_long[i], got_short[i]
                    lines.append(f"| {name} | {which} | {ir_long / n:,.0f} | {ir_short / n:,.0f} | {f_long / n:.1f} | "
                                 f"{(ir_long - ir_short) / (f_long - f_short):,.0f} |")
        return "\n".join(lines)
    chunk = {name: per_chunk(by[LONG][-1][1][1], by[SHORT][-1][1][1], by[LONG][-1][0] - by[SHORT][-1][0])
             for name, by in results.items()}
    for name, rows in chunk.items():
        calls = sum(c for c, _ in rows.values())
        lines.append(f"- {name}: {calls:.1f} function calls per chunk (cProfile, event loop thread)")
    if len(chunk) == 2:
        lines += calls_diff(chunk, "chunk", args.top)
    return "\n".join(lines)


def calls_diff(per: dict[str, dict[str, tuple[float, float]]], unit: str, top: int) -> list[str]:
    """The functions whose calls per ``unit`` differ most between the two trees, as table lines."""
    (na, a), (nb, b) = per.items()
    keys = sorted(a.keys() | b.keys(), key=lambda k: -abs(a.get(k, (0.0, 0.0))[0] - b.get(k, (0.0, 0.0))[0]))
    lines = ["", f"| function | calls per {unit}, {na} | {nb} | own µs per {unit}, {na} | {nb} |", "|---|---:|---:|---:|---:|"]
    for k in keys[:top]:
        ca, ta = a.get(k, (0.0, 0.0))
        cb, tb = b.get(k, (0.0, 0.0))
        if abs(ca - cb) < 0.05:
            break
        lines.append(f"| `{k}` | {ca:.2f} | {cb:.2f} | {ta:.1f} | {tb:.1f} |")
    return lines


def report_json(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> str:
    """Per JSON request: instructions (callgrind), or function calls and where the trees differ (cProfile)."""
    n = args.streams
    lines = [f"- JSON requests per block: {n}; blocks per tree: {args.repeat}; enginesim --tpot-ms {args.tpot_ms:g}", ""]
    if args.tool == "proc":
        lines += ["| tree | round | ms CPU per request | event loop thread | other threads | ms CPU per scrape of /metrics |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, by_tokens in results.items():
            scraped = by_tokens.get("scrapes", [])
            for r, (_served, got) in enumerate(by_tokens[LONG]):
                scrape = f"{scraped[r][1][1] * 1000 / args.scrapes:.2f}" if r < len(scraped) else "-"
                lines.append(f"| {name} | {r} | {got[1] * 1000 / n:.2f} | {got[2] * 1000 / n:.2f} | "
                             f"{(got[1] - got[2]) * 1000 / n:.2f} | {scrape} |")
        return "\n".join(lines)
    if args.tool == "callgrind":
        lines += ["| tree | round | Ir per request, all threads | event loop thread |", "|---|---:|---:|---:|"]
        for name, by_tokens in results.items():
            for r, (_served, got) in enumerate(by_tokens[LONG]):
                lines.append(f"| {name} | {r} | {got[1] / n:,.0f} | {got[2] / n:,.0f} |")
        if args.idle:
            lines += ["", "| tree | round | Ir per second idle, all threads | event loop thread |", "|---|---:|---:|---:|"]
            for name, by_tokens in results.items():
                for r, got in enumerate(by_tokens.get("idle", [])):
                    lines.append(f"| {name} | {r} | {got[1] / args.idle:,.0f} | {got[2] / args.idle:,.0f} |")
        if args.scrapes:
            lines += ["", "| tree | round | bytes of /metrics | Ir per scrape, all threads | event loop thread |",
                      "|---|---:|---:|---:|---:|"]
            for name, by_tokens in results.items():
                for r, (size, got) in enumerate(by_tokens.get("scrapes", [])):
                    lines.append(f"| {name} | {r} | {size:,} | {got[1] / args.scrapes:,.0f} | "
                                 f"{got[2] / args.scrapes:,.0f} |")
        return "\n".join(lines)
    per = {name: {k: (c / n, t / n * 1e6) for k, (c, t) in calls_by_function(by[LONG][-1][1][1]).items()}
           for name, by in results.items()}
    for name, rows in per.items():
        lines.append(f"- {name}: {sum(c for c, _ in rows.values()):.1f} function calls per request (cProfile, event loop thread)")
    if len(per) == 2:
        lines += calls_diff(per, "request", args.top)
    return "\n".join(lines)


def set_local(db: Path) -> None:
    """``RenderConfig.local_stream_detokenize`` on in the coordinator database ``db`` (before it starts)."""
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE serving_renderconfig SET local_stream_detokenize = 1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tool", choices=("callgrind", "cprofile", "proc"), default="callgrind")
    parser.add_argument("--baseline", help="a git revision whose coordinator runs beside this tree's")
    parser.add_argument("--json", action="store_true", help="count non-streaming requests, per request")
    parser.add_argument("--idle", type=int, default=0, help="with --json: also a block of this many seconds without requests")
    parser.add_argument("--scrapes", type=int, default=0, help="with --json: also a block of this many GET /metrics")
    parser.add_argument("--local", action="store_true", help="local_stream_detokenize on in every coordinator")
    parser.add_argument("--streams", type=int, default=10, help="streams (or JSON requests) per measured block")
    parser.add_argument("--repeat", type=int, default=1, help="measured blocks per tree, alternating")
    parser.add_argument("--tpot-ms", type=float, help="the engine's pace (default 150 under callgrind, 30 under cProfile)")
    parser.add_argument("--top", type=int, default=40, help="cProfile: functions listed")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory (dumps, logs)")
    parser.add_argument("--server", choices=stack.SERVERS, default="daphne", help="the coordinators' ASGI server")
    args = parser.parse_args()
    if args.tool == "proc" and not args.json:
        parser.error("--tool proc counts JSON requests only (--json)")
    if args.tpot_ms is None:
        args.tpot_ms = 1.0 if args.json else 150.0 if args.tool == "callgrind" else 30.0

    tmp = Path(tempfile.mkdtemp(prefix="motorsite-chunkcost-"))
    (tmp / "logs").mkdir()
    cfg = bench_stack("bench/chunk_cost.py", engines="sim", engine_count=1, api_key=API_KEY, log_dir=tmp / "logs",
                      database_url=f"sqlite:///{tmp / 'now.sqlite3'}", server=args.server)
    with contextlib.ExitStack() as exits:
        engines = [replace(e, argv=[*e.argv, "--tpot-ms", str(args.tpot_ms)]) for e in stack.engine_specs(cfg)]
        exits.enter_context(Supervisor([replace(stack.render_spec(cfg), ready_timeout=300.0), *engines]))
        stack.prepare_database(cfg)
        if args.local:
            set_local(tmp / "now.sqlite3")
        specs = {"now": (instrumented(stack.coordinator_spec(cfg), args.tool, tmp / "now.out"), cfg.coordinator_url)}
        if args.baseline:
            base_cfg = replace(cfg, coordinator_port=free_port(), database_url=f"sqlite:///{tmp / 'base.sqlite3'}")
            spec = coordinator_from(baseline_tree(args.baseline, tmp, exits), base_cfg, "coordinator-base")
            if args.local:
                set_local(tmp / "base.sqlite3")
            specs["base"] = (instrumented(spec, args.tool, tmp / "base.out"), base_cfg.coordinator_url)
        sup = Supervisor([s for s, _ in specs.values()])
        exits.enter_context(sup)
        coords = {name: (url, Measure(args.tool, sup.pids[s.name], tmp / f"{name}.out")) for name, (s, url) in specs.items()}
        load = loadavg()
        results = asyncio.run(measure(args, coords))
        load_after = loadavg()
    mode = "local_stream_detokenize" if args.local else "derender in the sidecar"
    print(f"\nload average {load} before, {load_after} after; {args.tool} under {args.server}, {mode}; dumps in {tmp}")
    print(report(args, results))
    if not args.keep:
        print("(pass --keep to keep the dumps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
