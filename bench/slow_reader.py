"""Memory per stream under slow readers: what a stream holds while its client reads nothing.

The fake render sidecar, engines and derender of the component tests (``tests/serving/fakes.py``)
run in a process of their own (``bench/fake_upstream_server.py``, uvicorn on 127.0.0.1), and the
coordinator's pipeline reaches them over real sockets with the production upstream client
(``serving.pipeline.http11.Http11Client``), so what is measured is what the coordinator holds
in production: its connections' read buffers (bounded by ``HIGH_WATER`` + ``READ_SIZE``), the
merge queue, the coalescing buffer and the derender sessions; the engines' unsent output waits
in their own process and the kernel, as it would behind a real engine. (Until 2026-12 this
bench ran the fakes in-process behind ``httpx.MockTransport``, whose unbounded buffering it
measured instead of the client's.)

``--streams`` concurrent streaming completions (``--prompts`` prompts each, ``--tokens`` tokens
per prompt) are opened; each client reads one frame and then stops reading. Once every producer is
blocked (neither the engines' sent events nor the derender calls move over a whole second), the
Python heap held (``tracemalloc``, current minus the baseline before the streams opened) is divided
by the streams, with derender coalescing off and on. For scale, the row also gives what one
stream's whole SSE output weighs once read. The streams then read to the end, so the run also
checks that everything completes. ``--top N`` prints the N largest allocation sites held (by
traceback) at the first row's blocked point.

    python3 -m toolchain exec bench/slow_reader.py [--streams 1,16,64] [--prompts 2] [--tokens 1000]
                                                   [--top 0] [--loop asyncio]
                                                   [--write]

Reports numbers only; nothing here asserts on memory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import gc
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any, Iterator

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import command_line, loadavg, machine, write_section  # noqa: E402
from serving.pipeline.derender.coalesce import MAX_PENDING  # noqa: E402
from serving.pipeline.engine.client import EngineClient  # noqa: E402
from serving.pipeline.http11 import HIGH_WATER, READ_SIZE, Http11Client  # noqa: E402
from serving.pipeline.placement.scheduler import LoadTracker, Scheduler  # noqa: E402
from serving.pipeline.render.client import RenderClient  # noqa: E402
from serving.pipeline.service import EventStream, ServingPipeline  # noqa: E402
from serving.pipeline.streaming.fanout import MERGE_QUEUE_SIZE  # noqa: E402
from tests.serving.fakes import MODEL, fleet_snapshot, instance  # noqa: E402

SECTION = "## bench/slow_reader.py"
# Blocked: nothing moved over this many polls of POLL_S each.
POLL_S = 0.25
STILL_POLLS = 4


@contextlib.contextmanager
def fake_upstreams(tokens: int) -> Iterator[dict[str, str]]:
    """Start ``bench/fake_upstream_server.py``; yields the base URL of each fake host."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "fake_upstream_server.py"), "--tokens", str(tokens)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ports = json.loads(proc.stdout.readline())
        yield {host: f"http://127.0.0.1:{port}" for host, port in ports.items()}
    finally:
        proc.terminate()
        proc.wait(10)


async def stats(client: Http11Client, urls: dict[str, str]) -> tuple[int, int]:
    got = (await client.get(urls["render"] + "/stats")).json()
    return got["events_sent"], got["derender_calls"]


async def measure(streams: int, args: argparse.Namespace, coalesce: bool, urls: dict[str, str],
                  top: int = 0) -> dict[str, float]:
    # Token capacity for every stream at once: admission is not what this measures.
    big = [dataclasses.replace(instance(n), url=urls[n], token_capacity=10**9) for n in ("e1", "e2")]
    snap: Any = fleet_snapshot(*big)
    snap = dataclasses.replace(snap, render=dataclasses.replace(snap.render, base_url=urls["render"],
                                                                derender_coalesce=coalesce))
    client = Http11Client(httpx.Timeout(60.0, connect=2.0))
    pipeline = ServingPipeline(snap, RenderClient(client, urls["render"], 60.0), EngineClient(client),
                               Scheduler(LoadTracker()))
    body = {"model": MODEL, "prompt": [f"p{i}" for i in range(args.prompts)], "stream": True,
            "max_tokens": args.tokens}
    sent0, _ = await stats(client, urls)  # its connection is kept: opened before the baseline
    gc.collect()
    before = tracemalloc.take_snapshot() if top else None
    base = tracemalloc.get_traced_memory()[0]
    opened: list[EventStream] = []
    for s in range(streams):
        st = await pipeline.completions(dict(body), f"slow{s}")
        assert isinstance(st, EventStream)
        opened.append(st)
    readers = [st.frames() for st in opened]
    for r in readers:
        await r.__anext__()
    # Let every producer run until it blocks: nothing sent by the engines nor derendered for a while.
    last, still = (-1, -1), 0
    while still < STILL_POLLS:
        await asyncio.sleep(POLL_S)
        now = await stats(client, urls)
        still = still + 1 if now == last else 0
        last = now
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    if before is not None:
        print_top(before, tracemalloc.take_snapshot(), top, streams)
    sent_blocked = last[0] - sent0
    sizes = []
    for r in readers:
        size = 0
        async for frame in r:
            size += len(frame)
        sizes.append(size)
    sent_all = (await stats(client, urls))[0] - sent0
    await client.aclose()
    total_events = streams * args.prompts * args.tokens  # no usage event: include_usage is not asked
    return {"held_per_stream": held / streams, "events_sent_per_stream": sent_blocked / streams,
            "events_per_stream": total_events / streams, "output_bytes_per_stream": sum(sizes) / len(sizes),
            "complete": float(sent_all == total_events)}


def print_top(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, top: int, streams: int) -> None:
    """The ``top`` largest sites of memory held, by traceback (innermost frames first)."""
    keep = [tracemalloc.Filter(False, tracemalloc.__file__)]
    diff = after.filter_traces(keep).compare_to(before.filter_traces(keep), "traceback")
    print(f"-- top {top} allocation sites held ({streams} streams), KiB per stream:")
    for stat in diff[:top]:
        print(f"{stat.size_diff / 1024 / streams:8.1f} KiB {stat.count_diff / streams:7.1f} blocks")
        for line in stat.traceback.format(limit=6, most_recent_first=True):
            print("    " + line)


def run(main: Any, loop: str) -> Any:
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--top", type=int, default=0, help="print the N largest allocation sites held")
    parser.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default="asyncio",
        help="the coordinator's event loop: asyncio's under Daphne (the default), uvloop under MOTOR_SERVER=uvicorn",
    )
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    import logging

    logging.disable(logging.INFO)  # one log line per request outcome would be measured too
    tracemalloc.start(12 if args.top else 1)
    rows = []
    with fake_upstreams(args.tokens) as urls:
        for streams in [int(x) for x in args.streams.split(",")]:
            for coalesce in (False, True):
                r = run(measure(streams, args, coalesce, urls, args.top), args.loop)
                print(streams, coalesce, r, flush=True)
                rows.append((streams, coalesce, r))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION, "",
        f"- date: {now}",
        f"- machine: {machine()}; load average {loadavg()}",
        f"- command: `{command_line()}` (from the repository root)",
        f"- event loop: {args.loop}",
        f"- workload: streaming completions with {args.prompts} prompts x {args.tokens} tokens each (one engine "
        f"stream per prompt), against the fake upstreams served over 127.0.0.1 by a process of their own "
        f"(`bench/fake_upstream_server.py`), reached with the production client (`Http11Client`); each client "
        f"reads one frame, then nothing until nothing moves; bounds: per connection HIGH_WATER {HIGH_WATER} + "
        f"READ_SIZE {READ_SIZE} bytes: MERGE_QUEUE_SIZE {MERGE_QUEUE_SIZE}, coalesce MAX_PENDING "
        f"{MAX_PENDING} raw events per engine stream",
        "- held / stream: tracemalloc current heap with every producer blocked, minus the heap before the streams "
        "opened, per stream (request state, engine and derender clients' buffers, queued chunks)",
        "",
        "| streams | coalescing | held / stream (KiB) | engine events sent while blocked / stream | events / stream "
        "| whole SSE output / stream (KiB) | completed after reading |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for streams, coalesce, r in rows:
        lines.append(
            f"| {streams} | {'on' if coalesce else 'off'} | {r['held_per_stream'] / 1024:.1f} | "
            f"{r['events_sent_per_stream']:.0f} | {r['events_per_stream']:.0f} | "
            f"{r['output_bytes_per_stream'] / 1024:.1f} | {'yes' if r['complete'] else 'NO'} |"
        )
    lines += [
        "",
        "- each prompt's producer stops with one chunk in its derender or blocked on the merge queue; the engines' "
        "sent events wait in the connection (up to HIGH_WATER + READ_SIZE bytes) and the kernel's socket buffers. "
        "Coalescing off reads one network chunk at a time, on reads all that arrived and merges it (a derender call "
        "covers at most MAX_PENDING raw events)",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
