"""Derender coalescing: derender calls per request, render sidecar CPU and TPOT, with and without.

Starts its own stack on free ports of 127.0.0.1 (logs in a temp directory): the real vLLM render
sidecar (``--parsers`` starts it with the hermes tool and qwen3 reasoning parsers, whose
streaming derender replays the whole output on every call), one ``enginesim`` engine with a
small TPOT (``--tpot-ms``, default 2 ms: chunks arrive faster than derender answers under load)
and two coordinators in front of both, one with ``derender_coalesce`` on and one with it off (with
``--stream-interval N`` another: coalescing on and ``RenderConfig.stream_interval`` N; with
``--uvicorn`` another: coalescing on, under uvicorn as ``MOTOR_SERVER=uvicorn`` serves it; with
``--stream-interval-ms 10,25`` one per value: coalescing on and ``RenderConfig.stream_interval_ms``
that many ms; with ``--local-detokenize`` another: coalescing on and
``RenderConfig.local_stream_detokenize``, the coordinator derendering the plain chats itself, so
its "derender calls" column counts chunks the coordinator derendered, none of them sidecar calls;
``--skip-off`` leaves out the coordinator with coalescing off).
Then, per concurrency level (1, 16, 64 streams by default), the same streaming chat workload runs
against each coordinator in turn and reports per request: derender calls (one per SSE chunk the
coordinator writes, each one derender call), the render sidecar's CPU time, TTFT, TPOT and E2E;
and per engine token: derender calls and the coordinator's plus the sidecar's CPU, with the gap
between a request's consecutive content chunks as the client receives them (p50 / p99).
The engine alone runs beside them at each level: the same chats, rendered before any timing,
streamed from enginesim's ``/inference/v1/generate`` by the same client at the same concurrency,
the baseline of issue 11's "TPOT p99 within 1.5x of the engine alone" (its own column).

    python3 -m toolchain exec bench/coalesce.py [--levels 1,16,64] [--requests-per-stream 2]
                                                [--max-tokens 64] [--tpot-ms 2] [--parsers]
                                                [--stream-interval N] [--stream-interval-ms 10,25]
                                                [--local-detokenize] [--skip-off] [--uvicorn] [--write]

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
from typing import Any

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
    tree_cpu_seconds,
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
    coordinator_cpu: float | None = None  # None: no coordinator on this path
    requests: int = 0
    tokens: list[int] = field(default_factory=list)  # completion tokens per request
    gaps: list[float] = field(default_factory=list)  # between a request's content chunks, as received
    seconds: float = 0.0  # wall time of the measured requests


ENGINE_ALONE = "engine alone"


def chat(i: int, args: argparse.Namespace) -> dict[str, Any]:
    return {"model": "tiny", "stream": True, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"request {i} {uuid.uuid4().hex[:6]}"}],
            "stream_options": {"include_usage": True}}


def render_all(render_url: str, count: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The engine-alone requests: chats rendered by the sidecar into generate bodies, before any timing."""
    with httpx.Client(timeout=TIMEOUT, trust_env=False) as client:
        bodies = []
        for i in range(count):
            reply = client.post(f"{render_url}/v1/chat/completions/render", json=chat(i, args))
            reply.raise_for_status()
            bodies.append(reply.json())
    return bodies


async def one_generate(client: httpx.AsyncClient, url: str, body: dict[str, Any], run: Run) -> None:
    """One streamed generate on the engine itself, timed as ``one`` times a chat."""
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            run.errors += 1
            await response.aread()
            if run.errors == 1:
                print(f"!! HTTP {response.status_code}: {response.text[:300]}", file=sys.stderr)
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            n = sum(len(c.get("token_ids") or []) for c in event.get("choices") or [])
            if n and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += n
    e2e = time.perf_counter() - t0
    run.e2e.append(e2e)
    if ttft is not None:
        run.ttft.append(ttft)
    if ttft is not None and tokens > 1:
        run.tpot.append((e2e - ttft) / (tokens - 1))


async def one(client: httpx.AsyncClient, url: str, i: int, args: argparse.Namespace, run: Run) -> None:
    body = chat(i, args)
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    tokens = 0
    last: float | None = None
    gaps: list[float] = []
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
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
            if chunk.get("usage") and not chunk.get("choices"):
                tokens = chunk["usage"]["completion_tokens"]
    e2e = time.perf_counter() - t0
    run.chunks.append(chunks)
    run.tokens.append(tokens)
    run.gaps.extend(gaps)
    run.e2e.append(e2e)
    if ttft is not None:
        run.ttft.append(ttft)
    if ttft is not None and tokens > 1:
        run.tpot.append((e2e - ttft) / (tokens - 1))


async def workload(
    url: str, streams: int, args: argparse.Namespace, render_pgid: int | None,
    bodies: list[dict[str, Any]] | None = None, coordinator_pid: int | None = None,
) -> Run:
    """``streams`` workers over ``streams * requests_per_stream`` chats to a coordinator at ``url``, or,
    with ``bodies`` (rendered, one per request and warm-up), generate calls to the engine at ``url``."""
    run = Run()
    warm = min(streams, 4)

    async def request(i: int, into: Run) -> None:
        try:
            if bodies is None:
                await one(client, url, i, args, into)
            else:
                await one_generate(client, url, bodies[i], into)
        except httpx.HTTPError as exc:  # counted, not fatal: the other streams' numbers still stand
            into.errors += 1
            if into.errors == 1:
                print(f"!! {type(exc).__name__}: {exc}", file=sys.stderr)

    async with httpx.AsyncClient(timeout=TIMEOUT, trust_env=False,
                                 limits=httpx.Limits(max_connections=streams + 4)) as client:
        await asyncio.gather(*(request(k, Run()) for k in range(warm)))
        cpu0, coord0 = group_cpu_seconds(render_pgid), tree_cpu_seconds(coordinator_pid)
        total = streams * args.requests_per_stream
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(warm, warm + total):
            queue.put_nowait(i)

        async def worker() -> None:
            while not queue.empty():
                await request(queue.get_nowait(), run)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        run.seconds = time.perf_counter() - t0
        run.render_cpu = group_cpu_seconds(render_pgid) - cpu0
        if coordinator_pid is not None:
            run.coordinator_cpu = tree_cpu_seconds(coordinator_pid) - coord0
        run.requests = total
    return run


def pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.2f}"


def table(rows: list[tuple[int, str, Run]]) -> str:
    out = ["| streams | coalescing | derender calls / request (p50) | sidecar CPU ms / request | coordinator CPU ms / "
           "request | TTFT p50 ms | TPOT p50 ms | TPOT p99 ms | TPOT p99 / engine alone | E2E p50 ms | requests ok / err |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    alone = {streams: pct(run.tpot, 0.99) for streams, mode, run in rows if mode == ENGINE_ALONE}
    for streams, mode, run in rows:
        calls = percentile([float(c) for c in run.chunks], 0.5) if run.chunks else None
        cpu = run.render_cpu / max(run.requests, 1)
        coord = "–" if run.coordinator_cpu is None else f"{run.coordinator_cpu / max(run.requests, 1) * 1000:.1f}"
        p99, base = pct(run.tpot, 0.99), alone.get(streams)
        ratio = f"{p99 / base:.2f}×" if p99 is not None and base else "–"
        out.append(
            f"| {streams} | {mode} | {'–' if calls is None else f'{calls:.0f}'} | {cpu * 1000:.1f} | {coord} | "
            f"{_ms(pct(run.ttft, 0.5))} | {_ms(pct(run.tpot, 0.5))} | {_ms(p99)} | {ratio} | {_ms(pct(run.e2e, 0.5))} | "
            f"{len(run.e2e)} / {run.errors} |"
        )
    return "\n".join(out)


def cadence_table(rows: list[tuple[int, str, Run]]) -> str:
    """Per engine token: derender calls, coordinator + sidecar CPU; the chunk gap a client sees."""
    out = ["| streams | coordinator | derender calls / engine token | coordinator + sidecar CPU µs / output token | "
           "chunk gap p50 ms | chunk gap p99 ms | TTFT p50 ms | E2E p50 ms | output tokens / s | derender calls / s | "
           "sidecar CPU s / s | coordinator CPU s / s |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for streams, mode, run in rows:
        if mode == ENGINE_ALONE or not run.tokens:
            continue
        tokens = max(sum(run.tokens), 1)
        cpu = run.render_cpu + (run.coordinator_cpu or 0.0)
        wall = max(run.seconds, 1e-9)
        out.append(
            f"| {streams} | {mode} | {sum(run.chunks) / tokens:.3f} | {cpu / tokens * 1e6:.0f} | "
            f"{_ms(pct(run.gaps, 0.5))} | {_ms(pct(run.gaps, 0.99))} | {_ms(pct(run.ttft, 0.5))} | "
            f"{_ms(pct(run.e2e, 0.5))} | {sum(run.tokens) / wall:.0f} | {sum(run.chunks) / wall:.0f} | "
            f"{run.render_cpu / wall:.2f} | {(run.coordinator_cpu or 0.0) / wall:.2f} |"
        )
    return "\n".join(out)


def write_results(text: str) -> None:
    write_section(SECTION, text)


def coordinator(
    cfg: stack.StackConfig, db: Path, coalesce: bool, interval: int = 1, interval_ms: int = 0, local: bool = False
) -> stack.StackConfig:
    cfg = replace(cfg, coordinator_port=free_port(), database_url=f"sqlite:///{db}", log_dir=cfg.log_dir / db.stem)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    stack.prepare_database(cfg)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE serving_renderconfig SET derender_coalesce = ?, stream_interval = ?, stream_interval_ms = ?, "
                     "local_stream_detokenize = ?", (coalesce, interval, interval_ms, local))
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
    parser.add_argument("--stream-interval-ms", default="",
                        help="also a coordinator with coalescing on and this stream_interval_ms, per comma-separated value")
    parser.add_argument("--skip-off", action="store_true", help="no coordinator with coalescing off")
    parser.add_argument("--local-detokenize", action="store_true",
                        help="also a coordinator with coalescing on and local_stream_detokenize on")
    parser.add_argument("--uvicorn", action="store_true",
                        help="also a coordinator with coalescing on under uvicorn (MOTOR_SERVER=uvicorn)")
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
        ready_base_url=f"http://{stack.HOST}:{cfg.render_port}", ready_timeout=300.0,
    )
    (engine,) = stack.engine_specs(cfg)
    engine = replace(engine, argv=[*engine.argv, "--tpot-ms", str(args.tpot_ms)])
    on = coordinator(cfg, tmp / "on.sqlite3", True)
    modes = [("on", on)]
    if not args.skip_off:
        modes.append(("off", coordinator(cfg, tmp / "off.sqlite3", False)))
    if args.uvicorn:
        modes.append(("on, uvicorn", replace(coordinator(cfg, tmp / "uvicorn.sqlite3", True), server="uvicorn")))
    if args.stream_interval > 1:
        modes.append((f"on, interval {args.stream_interval}",
                      coordinator(cfg, tmp / "interval.sqlite3", True, args.stream_interval)))
    for ms in (int(v) for v in args.stream_interval_ms.split(",") if v):
        modes.append((f"on, interval {ms} ms", coordinator(cfg, tmp / f"interval-{ms}ms.sqlite3", True, 1, ms)))
    if args.local_detokenize:
        modes.append(("on, local detokenize", coordinator(cfg, tmp / "local.sqlite3", True, local=True)))
    rows: list[tuple[int, str, Run]] = []
    load_before = loadavg()
    with contextlib.ExitStack() as exits:
        tier_sup = exits.enter_context(Supervisor([render, engine]))
        coordinator_pids = {}
        for mode, c in modes:
            # Django's start takes over the default 30 s on a loaded shared machine.
            spec = replace(stack.coordinator_spec(c), ready_timeout=180.0)
            coordinator_pids[mode] = exits.enter_context(Supervisor([spec])).pids["coordinator"]
        render_pgid = tier_sup.pids.get("render")
        generate_url = f"{cfg.engine_urls[0]}/inference/v1/generate"
        for streams in levels:
            bodies = render_all(f"http://{stack.HOST}:{cfg.render_port}", streams * args.requests_per_stream + 4, args)
            paths = [(m, f"{c.coordinator_url}/v1/chat/completions", None) for m, c in modes]
            paths.append((ENGINE_ALONE, generate_url, bodies))
            # Alternate which path goes first per level, so drift hits them alike.
            for mode, url, rendered in (paths if streams % 2 == 0 else paths[::-1]):
                print(f"{streams} streams, {mode} ...", flush=True)
                run = asyncio.run(workload(url, streams, args, render_pgid, rendered, coordinator_pids.get(mode)))
                rows.append((streams, mode, run))
    order = [ENGINE_ALONE, "off", *(m for m, _ in modes if m != "off")]
    rows.sort(key=lambda r: (r[0], order.index(r[1])))
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
        "included); sidecar CPU: utime+stime of its process group over the measured requests, per request; "
        "coordinator CPU: the same of the coordinator's process tree",
        "",
        table(rows),
        "",
        cadence_table(rows),
        "",
        "- with coalescing, TPOT is the average per token; the client gets the tokens in fewer, larger chunks "
        "(that is the trade: chunk granularity for sidecar load). Without it, derender is one call per token and "
        "the sidecar becomes the bottleneck as streams multiply",
        f"- {ENGINE_ALONE}: the same chats rendered up front, streamed from enginesim's /inference/v1/generate by "
        "this client at the same concurrency (no coordinator, no derender)",
    ]) + "\n"
    print(text)
    if args.write:
        write_results(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
