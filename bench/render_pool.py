"""Render throughput with a render pool of one sidecar against two, side by side in one run.

Two real vLLM render sidecars start (``stack.render_specs``); the coordinator's own pool client
(``serving/pipeline/render/pool.py``: a ``RenderPool`` over ``Http11Client``, picking per call by
fewest outstanding calls) renders chat requests at a fixed concurrency for a fixed time, once
with a pool of the first sidecar alone and once with both, alternating the order round by round
so drift in the machine's load falls on both. Reported: renders per second, p50 and p99 latency
per call, each sidecar's CPU seconds, and the ratio two/one per round.

    python3 -m toolchain exec bench/render_pool.py [--concurrency 8] [--seconds 10] [--rounds 2] [--write]

Bounded: about (2 sidecar starts) + rounds x 2 x seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_stack, loadavg, percentile, publish, section_head, tidy, tree_cpu_seconds  # noqa: E402
from motorsite import stack  # noqa: E402
from motorsite.supervisor import Supervisor, free_port, together  # noqa: E402
from serving.pipeline.http11 import Http11Client  # noqa: E402
from serving.pipeline.render.pool import PoolState, RenderPool  # noqa: E402
from serving.pipeline.snapshot import RenderMember, RenderView  # noqa: E402

HEADING = "## bench/render_pool.py"
SCRIPT = "bench/render_pool.py"


def chat_body(i: int, words: int) -> dict[str, Any]:
    # Distinct prompts: nothing a sidecar might cache answers a later call.
    text = " ".join(f"word{(i * 7 + j) % 997}" for j in range(words))
    return {"model": "tiny", "messages": [{"role": "system", "content": "You are brief."},
                                          {"role": "user", "content": text}], "max_tokens": 16}


@dataclass
class Run:
    size: int
    calls: int = 0
    wall: float = 0.0
    latencies: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # each sidecar's CPU seconds during the run

    @property
    def rate(self) -> float:
        return self.calls / self.wall if self.wall else 0.0


async def drive(pool: RenderPool, seconds: float, concurrency: int, words: int, run: Run) -> None:
    stop = time.perf_counter() + seconds
    counter = iter(range(10**9))

    async def worker() -> None:
        while time.perf_counter() < stop:
            i = next(counter)
            start = time.perf_counter()
            await pool.render_chat(chat_body(i, words), uuid.uuid4().hex)
            run.latencies.append((time.perf_counter() - start) * 1000)
            run.calls += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.wall = time.perf_counter() - start


async def measure(urls: list[str], pids: list[int], args: argparse.Namespace) -> list[tuple[Run, Run]]:
    client = Http11Client()
    views = {n: RenderView(enable=True, base_url=urls[0], timeout_s=60.0,
                           members=tuple(RenderMember(u) for u in urls[:n])) for n in (1, 2)}
    try:
        for n in (1, 2):  # warm-up: connections, the template's first compile on each sidecar
            await drive(RenderPool(client, views[n], PoolState()), 2.0, args.concurrency, args.words, Run(n))
        pairs = []
        for r in range(args.rounds):
            runs = {}
            for n in ((1, 2) if r % 2 == 0 else (2, 1)):
                run = Run(n)
                before = [tree_cpu_seconds(p) for p in pids]
                await drive(RenderPool(client, views[n], PoolState()), args.seconds, args.concurrency, args.words, run)
                run.cpu = [tree_cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)]
                runs[n] = run
            pairs.append((runs[1], runs[2]))
            print(f"round {r + 1}: one {runs[1].rate:.1f}/s, two {runs[2].rate:.1f}/s", flush=True)
        return pairs
    finally:
        await client.aclose()


def report(pairs: list[tuple[Run, Run]], args: argparse.Namespace, load: tuple[str, str]) -> str:
    lines = section_head(HEADING, load, "a shared 2-CPU machine: other sessions' tests ran beside this one, so "
                         "absolute rates move between runs; compare the ratios of one round")
    lines += [
        f"- what: chat renders through the coordinator's `RenderPool` (fewest outstanding calls) at concurrency "
        f"{args.concurrency}, {args.seconds:g} s per pool size per round, prompts of {args.words} words, two real "
        "vLLM 0.33 render sidecars (4 renderer workers each); pool sizes alternate in order round by round",
        "",
        "| round | pool | renders/s | p50 ms | p99 ms | sidecar CPU s (each) | two / one |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    ratios = []
    for r, (one, two) in enumerate(pairs, start=1):
        ratio = two.rate / one.rate if one.rate else float("nan")
        ratios.append(ratio)
        for run, cell in ((one, ""), (two, f"{ratio:.2f}x")):
            lines.append(
                f"| {r} | {run.size} | {run.rate:.1f} | {percentile(run.latencies, 0.5) or 0:.1f} | "
                f"{percentile(run.latencies, 0.99) or 0:.1f} | {' / '.join(f'{c:.1f}' for c in run.cpu[:run.size])}"
                f"{' (idle: ' + f'{run.cpu[1]:.1f}' + ')' if run.size == 1 and len(run.cpu) > 1 else ''} | {cell} |"
            )
    lines += ["", f"Median ratio two / one: {statistics.median(ratios):.2f}x over {len(ratios)} round(s)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--words", type=int, default=200)
    parser.add_argument("--write", action="store_true", help="replace this section of bench/RESULTS.md")
    parser.add_argument("--keep", action="store_true", help="keep the temporary logs")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="render-pool-"))
    cfg = bench_stack(SCRIPT, engines="sim", engine_count=0, api_key="unused", log_dir=tmp,
                      database_url=f"sqlite:///{tmp / 'db.sqlite3'}", celery=False, restart=None)
    cfg = replace(cfg, render_member_ports=(free_port(),))
    specs = stack.render_specs(cfg)
    load_before = loadavg()
    try:
        with Supervisor(together(specs)) as sup:
            urls = [f"http://{stack.HOST}:{p}" for p in (cfg.render_port, *cfg.render_member_ports)]
            pairs = asyncio.run(measure(urls, [sup.pids[s.name] for s in specs], args))
    finally:
        tidy(tmp, keep=args.keep, logs=tmp)
    publish(HEADING, report(pairs, args, (load_before, loadavg())), write=args.write)


if __name__ == "__main__":
    main()
