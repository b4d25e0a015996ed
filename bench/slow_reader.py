"""Memory per stream under slow readers: what a stream holds while its client reads nothing.

In one process, against the fake render / engine / derender upstreams of the component tests
(``tests/serving/fakes.py``, ``httpx.MockTransport``), ``--streams`` concurrent streaming
completions (``--prompts`` prompts each, ``--tokens`` tokens per prompt) are opened; each client
reads one frame and then stops reading. Once every producer is blocked on its bounded buffers
(no engine event read for a full pause), the Python heap held (``tracemalloc``, current minus the
baseline before the streams opened) is divided by the streams, with derender coalescing off and
on. For scale, the row also gives what one stream's whole SSE output weighs once read. The
streams then read to the end, so the run also checks that everything completes.

    python3 -m toolchain exec bench/slow_reader.py [--streams 1,16,64] [--prompts 2] [--tokens 1000] [--write]

Reports numbers only; nothing here asserts on memory.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import gc
import json
import sys
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any, AsyncIterator

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import command_line, loadavg, machine, write_section  # noqa: E402
from serving.pipeline.derender.coalesce import MAX_PENDING  # noqa: E402
from serving.pipeline.engine.client import EngineClient  # noqa: E402
from serving.pipeline.placement.scheduler import LoadTracker, Scheduler  # noqa: E402
from serving.pipeline.render.client import RenderClient  # noqa: E402
from serving.pipeline.service import EventStream, ServingPipeline  # noqa: E402
from serving.pipeline.streaming.fanout import MERGE_QUEUE_SIZE  # noqa: E402
from tests.serving.fakes import MODEL, RENDER_URL, FakeUpstreams, SSEBody, fleet_snapshot, instance, output_ids  # noqa: E402

SECTION = "## bench/slow_reader.py"


async def measure(streams: int, args: argparse.Namespace, coalesce: bool) -> dict[str, float]:
    upstreams = FakeUpstreams()
    pulled: Counter[str] = Counter()

    def generate(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        rid = body["request_id"]
        ids = output_ids(body["token_ids"], 0, args.tokens)

        async def agen() -> AsyncIterator[bytes]:
            # Built lazily, as a real engine would: the fake engine's memory is not the coordinator's.
            for pos, token in enumerate(ids):
                pulled[rid] += 1
                event = {"request_id": "generate-tokens-" + rid, "usage": None, "output_mode": "tokens", "choices": [{
                    "index": 0, "finish_reason": "stop" if pos == len(ids) - 1 else None, "stop_reason": None,
                    "token_ids": [token], "routed_experts": None, "sampling_mask": None, "weight_versions": None,
                    "logprobs": None}]}
                yield ("data: " + json.dumps(event, separators=(",", ":")) + "\n\n").encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=SSEBody(agen(), lambda: None))

    for host in ("e1", "e2"):
        upstreams.override(host, "generate", generate)
    # Token capacity for every stream at once: admission is not what this measures.
    big = [dataclasses.replace(instance(n), token_capacity=10**9) for n in ("e1", "e2")]
    snap: Any = fleet_snapshot(*big)
    snap = dataclasses.replace(snap, render=dataclasses.replace(snap.render, derender_coalesce=coalesce))
    async with httpx.AsyncClient(transport=httpx.MockTransport(upstreams.handler)) as client:
        pipeline = ServingPipeline(snap, RenderClient(client, RENDER_URL, 60.0), EngineClient(client),
                                   Scheduler(LoadTracker()))
        body = {"model": MODEL, "prompt": [f"p{i}" for i in range(args.prompts)], "stream": True,
                "max_tokens": args.tokens}
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        opened: list[EventStream] = []
        for s in range(streams):
            st = await pipeline.completions(dict(body), f"slow{s}")
            assert isinstance(st, EventStream)
            opened.append(st)
        readers = [st.frames() for st in opened]
        for r in readers:
            await r.__anext__()
        # Let every producer run until it blocks: no engine event read over a whole pause.
        last = -1
        while sum(pulled.values()) != last:
            last = sum(pulled.values())
            for _ in range(500):
                await asyncio.sleep(0)
        # The fakes' own call records are the test double's, not the stream's: drop them first.
        upstreams.calls.clear()
        upstreams.stream_derenders.clear()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        read_events = sum(pulled.values())
        sizes = []
        for r in readers:
            size = 0
            async for frame in r:
                size += len(frame)
            sizes.append(size)
            upstreams.calls.clear()
    total_events = streams * args.prompts * args.tokens  # no usage event: include_usage is not asked
    return {"held_per_stream": held / streams, "events_read_per_stream": read_events / streams,
            "events_per_stream": total_events / streams, "output_bytes_per_stream": sum(sizes) / len(sizes),
            "complete": float(sum(pulled.values()) == total_events)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    import logging

    logging.disable(logging.INFO)  # one log line per request outcome would be measured too
    tracemalloc.start()
    rows = []
    for streams in [int(x) for x in args.streams.split(",")]:
        for coalesce in (False, True):
            r = asyncio.run(measure(streams, args, coalesce))
            print(streams, coalesce, r, flush=True)
            rows.append((streams, coalesce, r))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION, "",
        f"- date: {now}",
        f"- machine: {machine()}; load average {loadavg()}",
        f"- command: `{command_line()}` (from the repository root)",
        f"- workload: streaming completions with {args.prompts} prompts x {args.tokens} tokens each (one engine "
        f"stream per prompt), against in-process fake upstreams; each client reads one frame, then nothing until "
        f"no producer reads anything more; bounds: MERGE_QUEUE_SIZE {MERGE_QUEUE_SIZE}, coalesce MAX_PENDING "
        f"{MAX_PENDING} raw events per engine stream",
        "- held / stream: tracemalloc current heap with every producer blocked, minus the heap before the streams "
        "opened, per stream (request state, engine and derender clients' buffers, queued chunks)",
        "",
        "| streams | coalescing | held / stream (KiB) | engine events read while blocked / stream | events / stream "
        "| whole SSE output / stream (KiB) | completed after reading |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for streams, coalesce, r in rows:
        lines.append(
            f"| {streams} | {'on' if coalesce else 'off'} | {r['held_per_stream'] / 1024:.1f} | "
            f"{r['events_read_per_stream']:.0f} | {r['events_per_stream']:.0f} | "
            f"{r['output_bytes_per_stream'] / 1024:.1f} | {'yes' if r['complete'] else 'NO'} |"
        )
    lines += [
        "",
        "- coalescing off: the producers stop after about MERGE_QUEUE_SIZE + 2 per prompt engine events and the "
        "engine stream backs up; coalescing on: the merge queue holds merged chunks (each up to MAX_PENDING events), "
        "so short outputs are read from the engine to the end while the client waits, still within a bounded heap",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
