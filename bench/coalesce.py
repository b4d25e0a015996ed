"""Derender coalescing: derender calls per request, render sidecar CPU and TPOT, with and without.

Starts its own stack on free ports of 127.0.0.1 (logs in a temp directory): the real vLLM render
sidecar (``--parsers`` starts it with the hermes tool and qwen3 reasoning parsers, whose
streaming derender replays the whole output on every call), one ``enginesim`` engine with a
small TPOT (``--tpot-ms``, default 2 ms: chunks arrive faster than derender answers under load)
and two coordinators in front of both, one with ``derender_coalesce`` on and one with it off (with
``--stream-interval N`` a third: coalescing on and ``RenderConfig.stream_interval`` N).
Then, per concurrency level (1, 16, 64 streams by default), the same streaming chat workload runs
against each coordinator in turn and reports per request: derender calls (one per SSE chunk the
coordinator writes, each one derender call), the render sidecar's CPU time, TTFT, TPOT and E2E.

    python3 -m toolchain exec bench/coalesce.py [--levels 1,16,64] [--requests-per-stream 2]
                                                [--max-tokens 64] [--tpot-ms 2] [--parsers]
                                                [--stream-interval N] [--write]

Reports numbers only; nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import sqlite3
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    command_line,
    group_cpu_seconds,
    loadavg,
    machine,
    percentile,
    require_env,
    write_section,
)
from motorsite import stack, tiers  # noqa: E402
from motorsite.supervisor import ProcessSpec, Supervisor, free_port  # noqa: E402

SECTION = "## bench/coalesce.py"
SCRIPT = "bench/coalesce.py"
API_KEY = "sk-bench-" + uuid.uuid4().hex[:12]
TIMEOUT = httpx.Timeout(300.0)


@dataclass
class Run:
    chunks: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    errors: int = 0
    render_cpu: float = 0.0
    requests: int = 0


async def one(client: httpx.AsyncClient, url: str, i: int, args: argparse.Namespace, run: Run) -> None:
    body = {"model": "tiny", "stream": True, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"request {i} {uuid.uuid4().hex[:6]}"}],
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    tokens = 0
    async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        if response.status_code != 200:
            run.errors += 1
            await response.aread()
            if run.errors == 1:
                print(f"!! HTTP {response.status_code}: {response.text[:300]}", file=sys.stderr)
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                run.errors += 1
                if run.errors == 1:
                    print(f"!! error event: {line[:300]}", file=sys.stderr)
                return
            chunks += 1  # every chunk the coordinator writes is one derender call's answer
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage") and not chunk.get("choices"):
                tokens = chunk["usage"]["completion_tokens"]
    e2e = time.perf_counter() - t0
    run.chunks.append(chunks)
    run.e2e.append(e2e)
    if ttft is not None:
        run.ttft.append(ttft)
    if ttft is not None and tokens > 1:
        run.tpot.append((e2e - ttft) / (tokens - 1))


async def workload(url: str, streams: int, args: argparse.Namespace, render_pgid: int | None) -> Run:
    run = Run()
    async with httpx.AsyncClient(timeout=TIMEOUT, trust_env=False,
                                 limits=httpx.Limits(max_connections=streams + 4)) as client:
        await asyncio.gather(*(one(client, url, -k - 1, args, Run()) for k in range(min(streams, 4))))  # warm-up
        cpu0 = group_cpu_seconds(render_pgid)
        total = streams * args.requests_per_stream
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(total):
            queue.put_nowait(i)

        async def worker() -> None:
            while not queue.empty():
                await one(client, url, queue.get_nowait(), args, run)

        await asyncio.gather(*(worker() for _ in range(streams)))
        run.render_cpu = group_cpu_seconds(render_pgid) - cpu0
        run.requests = total
    return run


def pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.2f}"


def table(rows: list[tuple[int, str, Run]]) -> str:
    out = ["| streams | coalescing | derender calls / request (p50) | sidecar CPU ms / request | TTFT p50 ms | "
           "TPOT p50 ms | TPOT p99 ms | E2E p50 ms | requests ok / err |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for streams, mode, run in rows:
        calls = percentile([float(c) for c in run.chunks], 0.5) if run.chunks else None
        cpu = run.render_cpu / max(run.requests, 1)
        out.append(
            f"| {streams} | {mode} | {'–' if calls is None else f'{calls:.0f}'} | {cpu * 1000:.1f} | "
            f"{_ms(pct(run.ttft, 0.5))} | {_ms(pct(run.tpot, 0.5))} | {_ms(pct(run.tpot, 0.99))} | {_ms(pct(run.e2e, 0.5))} | "
            f"{len(run.e2e)} / {run.errors} |"
        )
    return "\n".join(out)


def write_results(text: str) -> None:
    write_section(SECTION, text)


def coordinator(cfg: stack.StackConfig, db: Path, coalesce: bool, interval: int = 1) -> stack.StackConfig:
    cfg = replace(cfg, coordinator_port=free_port(), database_url=f"sqlite:///{db}", log_dir=cfg.log_dir / db.stem)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    stack.prepare_database(cfg)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE serving_renderconfig SET derender_coalesce = ?, stream_interval = ?", (coalesce, interval))
    return cfg


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,16,64", help="concurrent streams per run (default 1,16,64)")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tpot-ms", type=float, default=2.0, help="enginesim's time per output token")
    parser.add_argument("--parsers", action="store_true", help="render sidecar with tool and reasoning parsers")
    parser.add_argument("--stream-interval", type=int, default=0,
                        help="also measure a coordinator with coalescing on and this stream_interval")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    tmp = Path(tempfile.mkdtemp(prefix="motorsite-bench-coalesce-"))
    print(f"logs: {tmp}")
    cfg = stack.StackConfig(
        model_dir=require_env("MOTOR_MODEL_DIR", SCRIPT), render_python=require_env("MOTOR_RENDER_PYTHON", SCRIPT),
        engine_python=require_env("MOTOR_ENGINE_PYTHON", SCRIPT), engines="sim", render_port=free_port(),
        engine_ports=(free_port(),), prefill_ports=(), decode_ports=(), api_keys=(API_KEY,), log_dir=tmp,
    )
    argv, env = tiers.render_sidecar_command(
        python=cfg.render_python, model_dir=cfg.model_dir, served_model_name=cfg.served_model_name,
        port=cfg.render_port, workers=cfg.render_workers, parsers=args.parsers, max_model_len=cfg.max_model_len,
    )
    render = ProcessSpec(
        name="render", argv=argv, env=env, log_path=tmp / "render.log", ports=[(stack.HOST, cfg.render_port)],
        ready_post=tiers.render_ready_request(cfg.served_model_name),
        ready_base_url=f"http://{stack.HOST}:{cfg.render_port}", ready_timeout=120.0,
    )
    (engine,) = stack.engine_specs(cfg)
    engine = replace(engine, argv=[*engine.argv, "--tpot-ms", str(args.tpot_ms)])
    on = coordinator(cfg, tmp / "on.sqlite3", True)
    off = coordinator(cfg, tmp / "off.sqlite3", False)
    modes = [("on", on), ("off", off)]
    if args.stream_interval > 1:
        modes.append((f"on, interval {args.stream_interval}",
                      coordinator(cfg, tmp / "interval.sqlite3", True, args.stream_interval)))
    rows: list[tuple[int, str, Run]] = []
    load_before = loadavg()
    with contextlib.ExitStack() as exits:
        tier_sup = exits.enter_context(Supervisor([render, engine]))
        for _, c in modes:
            exits.enter_context(Supervisor([stack.coordinator_spec(c)]))
        render_pgid = tier_sup.pids.get("render")
        for streams in levels:
            # Alternate which mode goes first per level, so drift hits both alike.
            order = modes if streams % 2 == 0 else modes[::-1]
            for mode, c in order:
                print(f"{streams} streams, coalescing {mode} ...", flush=True)
                run = asyncio.run(workload(f"{c.coordinator_url}/v1/chat/completions", streams, args, render_pgid))
                rows.append((streams, mode, run))
    rows.sort(key=lambda r: (r[0], r[1] != "off", r[1]))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([
        SECTION, "",
        f"- date: {now}",
        f"- machine: {machine()}; load average {load_before} before, {loadavg()} after (shared machine: compare "
        "rows of one level, not runs)",
        f"- command: `{command_line()}` (from the repository root)",
        f"- workload: streaming chat, max_tokens {args.max_tokens}, ignore_eos, temperature 0, "
        f"{args.requests_per_stream} requests per stream; enginesim with --tpot-ms {args.tpot_ms}; render sidecar "
        f"{'with hermes + qwen3 parsers' if args.parsers else 'without parsers'} ({cfg.render_workers} workers); "
        f"{len(modes)} coordinators ({' / '.join(m for m, _ in modes)}) on the same sidecar and engine",
        "- derender calls / request: SSE chunks the coordinator wrote (one derender call each, the usage chunk "
        "included); sidecar CPU: utime+stime of its process group over the measured requests, per request",
        "",
        table(rows),
        "",
        "- with coalescing, TPOT is the average per token; the client gets the tokens in fewer, larger chunks "
        "(that is the trade: chunk granularity for sidecar load). Without it, derender is one call per token and "
        "the sidecar becomes the bottleneck as streams multiply",
    ]) + "\n"
    print(text)
    if args.write:
        write_results(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
