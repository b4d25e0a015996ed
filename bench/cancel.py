"""Client disconnect: time until every engine request is aborted and every hold released.

In this process: two ``enginesim`` union instances (real HTTP, uvicorn threads, 20 ms per output
token, no eos) behind a ``ServingPipeline`` whose render / derender is the fake sidecar of the
serving tests (in-process, so the clock measures the coordinator and the engines, not render).
For each scenario a streaming request is opened, a few chunks are read, and the client goes away
(the SSE generator is closed, which is what Django does on ``http.disconnect``). Measured from
that moment:

- coordinator released: the close returned (producers cancelled and awaited, engine streams
  closed, aborts sent) and load, token admission and open streams are all zero;
- engines idle: both simulators report no running generation and no open stream.

Scenarios: one prompt; a 4-prompt fan-out; one prompt disconnected right after a relay (the first
engine dropped the connection after 3 tokens and the stream moved to the other instance, which drops
it in turn: the stream is on its second relay when the client leaves).

    python3 -m toolchain exec bench/cancel.py [--runs 30] [--write]

Reports p50 / p99 / max per scenario; asserts nothing on timings (target: under a second).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import loadavg, machine, write_section  # noqa: E402
from bench.common import nearest_rank as pct  # noqa: E402
from enginesim import SimConfig  # noqa: E402
from enginesim.testing import LiveServer  # noqa: E402
from serving.pipeline.derender.session import StreamSettings  # noqa: E402
from serving.pipeline.engine.client import EngineClient  # noqa: E402
from serving.pipeline.placement.load import LoadTracker  # noqa: E402
from serving.pipeline.placement.scheduler import Scheduler  # noqa: E402
from serving.pipeline.render.client import RenderClient  # noqa: E402
from serving.pipeline.service import EventStream, ServingPipeline  # noqa: E402
from tests.serving.fakes import MODEL, RENDER_URL, FakeUpstreams, fleet_snapshot, instance  # noqa: E402

SECTION = "## bench/cancel.py"
TPOT_MS = 20.0


async def _idle(sims: list[LiveServer], deadline_s: float = 10.0) -> None:
    end = time.perf_counter() + deadline_s
    while any(s.engine.running or s.engine.stats.active_streams for s in sims):
        if time.perf_counter() > end:
            raise RuntimeError("an engine kept working after the client left")
        await asyncio.sleep(0.001)


async def one_run(scenario: str, sims: list[LiveServer], http: httpx.AsyncClient, n: int) -> tuple[float, float]:
    snapshot = fleet_snapshot(*(dataclasses.replace(instance(f"e{i + 1}"), url=s.url) for i, s in enumerate(sims)))
    scheduler = Scheduler(LoadTracker())
    pipeline = ServingPipeline(
        snapshot, RenderClient(http, RENDER_URL, 5.0), EngineClient(http), scheduler,
        stream_settings=StreamSettings(chunk_timeout_s=5.0),
    )
    prompt: Any = ["a", "b", "c", "d"] if scenario == "fan-out x4" else "a"
    if scenario == "after a relay":
        # Each sim drops its next request after 3 tokens: relay, relay back, then the client leaves.
        for s in sims:
            await http.post(s.url + "/sim/faults", json={"mode": "drop_after_tokens", "tokens": 3, "count": 1})
    stream = await pipeline.completions(
        {"model": MODEL, "prompt": prompt, "stream": True, "max_tokens": 500, "seed": n}, f"bench-{n}"
    )
    assert isinstance(stream, EventStream)
    frames = stream.frames()
    for _ in range(8 if scenario == "after a relay" else 4):
        await anext(frames)
    if scenario == "after a relay":
        relays = sum(s.relays for s in stream.sessions)
        assert relays >= 1, f"the relay did not happen ({relays})"
    start = time.perf_counter()
    await frames.aclose()  # the client went away
    released = time.perf_counter() - start
    assert scheduler.load.snapshot() == {} and scheduler.admission.inflight_tokens() == {}
    await _idle(sims)
    idle = time.perf_counter() - start
    for s in sims:
        await http.delete(s.url + "/sim/faults")
    return released, idle


async def run(runs: int) -> dict[str, tuple[list[float], list[float]]]:
    sims = [LiveServer(SimConfig(tpot_ms=TPOT_MS, eos_probability=0.0, seed=0)) for _ in range(2)]
    for s in sims:
        s.start()
    upstreams = FakeUpstreams()  # render + derender only; the engines are the sims
    render = httpx.MockTransport(upstreams.handler)
    out: dict[str, tuple[list[float], list[float]]] = {}
    try:
        async with httpx.AsyncClient(mounts={RENDER_URL: render}, timeout=httpx.Timeout(30.0, connect=2.0)) as http:
            for scenario in ("single prompt", "fan-out x4", "after a relay"):
                released, idle = [], []
                await one_run(scenario, sims, http, -1)  # warm-up
                for n in range(runs):
                    a, b = await one_run(scenario, sims, http, n)
                    released.append(a)
                    idle.append(b)
                out[scenario] = (released, idle)
    finally:
        for s in sims:
            s.stop()
    return out


def report(results: dict[str, tuple[list[float], list[float]]], runs: int) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION,
        "",
        f"- date: {now}",
        f"- machine: {machine(model=False, memory=False)}; load average {loadavg()} at the end (shared with other work)",
        "- command: `python3 -m toolchain exec bench/cancel.py --write` (from the repository root)",
        f"- workload: {runs} runs per scenario; streaming completions, max_tokens 500; two in-process enginesim "
        f"instances over real HTTP ({TPOT_MS:g} ms per output token, no eos); fake render/derender in process; "
        "the client reads 4 chunks (8 after a relay) and leaves (the SSE generator is closed, as on http.disconnect)",
        "- released: disconnect → close returned, load / token admission / engine streams all zero; "
        "engines idle: disconnect → both sims report no running generation and no open stream. Target: under 1 s",
        "",
        "| scenario | released p50 (ms) | released p99 (ms) | engines idle p50 (ms) | engines idle p99 (ms) | engines idle max (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for scenario, (released, idle) in results.items():
        ms = [x * 1000 for x in released]
        ims = [x * 1000 for x in idle]
        lines.append(
            f"| {scenario} | {statistics.median(ms):.2f} | {pct(ms, 0.99):.2f} | {statistics.median(ims):.2f} | "
            f"{pct(ims, 0.99):.2f} | {max(ims):.2f} |"
        )
    return "\n".join(lines) + "\n"


def write_results(text: str) -> None:
    write_section(SECTION, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    args = parser.parse_args()
    text = report(asyncio.run(run(args.runs)), args.runs)
    print(text)
    if args.write:
        write_results(text)


if __name__ == "__main__":
    main()
