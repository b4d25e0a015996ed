"""What one streaming derender call costs the render sidecar, by what it carries and how often.

Issue 11 counts motorsite's render sidecar with its coordinator, and a streamed answer costs one
derender call per chunk: at one request at a time that is one call per token, the bulk of the
sidecar's CPU per stream (``bench/peers.py``). This measures the call alone, with nothing else
running: the real ``vllm launch render`` sidecar on a free port of 127.0.0.1 and the
coordinator's own client (``RenderClient`` over ``Http11Client``), one call at a time.

What a call carries (``serving/pipeline/derender/payload.py``):

    first     a choice's first call: the whole chat request and the prompt's ids, no state
    plain     a later call on the plain path that reads the request (its event finishes the
              choice or has logprobs, or the request sets an option away from derender's
              defaults): the state and the request without its messages
    bare      any other later call on the plain path: the state and no ``chat_request`` at all
              (``request_unread`` / ``reads_request``): most of a stream's calls

each back to back and with ``--gap-ms`` between calls (an engine's time per output token: the
sidecar idles between the calls of a real stream). Reported per call: the sidecar's CPU (utime +
stime of its process tree, less its idle rate), this client's CPU and the wall time; one render
call per prompt for scale. Rounds interleave the variants.

    python3 -m toolchain exec bench/derender_cost.py [--calls 400] [--rounds 3] [--gap-ms 4]
                                                     [--prompt-words 0] [--render-workers 4] [--write]

``--prompt-words N`` appends N words to the user message: a long prompt makes the first call
carry that many more ids and that much more message, on the first token's path.

``--render-workers`` is the sidecar's ``--renderer-num-workers`` (``RenderConfig.renderer_num_workers``,
4 by default as in the RFC): the thread pool that every derender call goes through.

``--write`` replaces this benchmark's section of ``bench/RESULTS.md``. Numbers only; nothing here
asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_stack, loadavg, publish, section_head, tidy, tree_cpu_seconds  # noqa: E402
from bench.derender_sample import BODY, EVENT  # noqa: E402
from motorsite import stack  # noqa: E402
from motorsite.supervisor import Supervisor  # noqa: E402
from serving.pipeline.derender.payload import slim_request  # noqa: E402
from serving.pipeline.http11 import Http11Client  # noqa: E402
from serving.pipeline.render.client import CHAT_DERENDER, RenderClient  # noqa: E402

HEADING = "## bench/derender_cost.py"
VARIANTS = ("first", "plain", "bare")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Cost:
    calls: int = 0
    sidecar: float = 0.0
    client: float = 0.0
    wall: float = 0.0

    def row(self, idle_rate: float) -> tuple[float, float, float]:
        """(sidecar, client, wall) ms per call; the sidecar's idle rate over the wall time taken out."""
        n = max(self.calls, 1)
        return (1000 * max(self.sidecar - idle_rate * self.wall, 0.0) / n, 1000 * self.client / n, 1000 * self.wall / n)


def chat_body(prompt_words: int) -> dict[str, Any]:
    """``BODY`` with ``prompt_words`` more words in its user message."""
    user = BODY["messages"][1]["content"] + " cats" * prompt_words
    return {**BODY, "messages": [BODY["messages"][0], {"role": "user", "content": user}]}


async def measure(render_url: str, render_pid: int, args: argparse.Namespace) -> tuple[dict[tuple[str, float], Cost], Cost, float]:
    client = Http11Client()
    render = RenderClient(client, render_url, 60.0)
    body = chat_body(args.prompt_words)
    try:
        ids = (await render.render_chat(body, uuid.uuid4().hex))["token_ids"]
        args.prompt_tokens = len(ids)
        _, state = await render.derender_chunk(
            "chat", EVENT, stream_state=None, prompt_tokens=len(ids), prompt_token_ids=ids, request=body, model="tiny",
        )
        slim = slim_request("chat", body)
        bodies: dict[str, dict[str, Any]] = {
            "first": {"prompt_token_ids": ids, "chat_request": body, "stream_state": None},
            "plain": {"chat_request": slim, "stream_state": state},
            "bare": {"stream_state": state},
        }

        async def call(variant: str) -> None:
            await render._post_derender(CHAT_DERENDER, {
                "stream": True, "model": "tiny", "generate_chunk": EVENT, "prompt_tokens": len(ids), **bodies[variant],
            }, {})

        gaps = (0.0, args.gap_ms / 1000)
        costs = {(v, g): Cost() for v in VARIANTS for g in gaps}
        renders = Cost()
        for variant in VARIANTS:  # warm-up: connections, caches
            for _ in range(20):
                await call(variant)
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for gap in gaps:
                for variant in order:
                    c = costs[(variant, gap)]
                    s0, c0, t0 = tree_cpu_seconds(render_pid), own_cpu_seconds(), time.perf_counter()
                    for _ in range(args.calls):
                        await call(variant)
                        if gap:
                            await asyncio.sleep(gap)
                    c.sidecar += tree_cpu_seconds(render_pid) - s0
                    c.client += own_cpu_seconds() - c0
                    c.wall += time.perf_counter() - t0
                    c.calls += args.calls
            s0, c0, t0 = tree_cpu_seconds(render_pid), own_cpu_seconds(), time.perf_counter()
            for _ in range(args.calls // 4):
                await render.render_chat(body, uuid.uuid4().hex)
            renders.sidecar += tree_cpu_seconds(render_pid) - s0
            renders.client += own_cpu_seconds() - c0
            renders.wall += time.perf_counter() - t0
            renders.calls += args.calls // 4
        # The sidecar's own CPU while nobody calls it (its loop and threads), taken out of each row.
        s0, t0 = tree_cpu_seconds(render_pid), time.perf_counter()
        await asyncio.sleep(3.0)
        idle_rate = (tree_cpu_seconds(render_pid) - s0) / (time.perf_counter() - t0)
    finally:
        await client.aclose()
    return costs, renders, idle_rate


def report(costs: dict[tuple[str, float], Cost], renders: Cost, idle_rate: float, load: tuple[str, str],
           args: argparse.Namespace) -> str:
    lines = section_head(HEADING, load, "2 cores shared by the sidecar and this client")
    lines += [
        f"- workload: one call at a time, {args.calls} per cell and round, {args.rounds} interleaved rounds, after 20 "
        f"warm-up calls per variant; a {args.prompt_tokens}-token prompt; a one-token engine event; the coordinator's "
        "own client (`RenderClient`); "
        f"sidecar with --renderer-num-workers {args.render_workers}; it idled at {1000 * idle_rate:.1f} ms CPU per "
        "second, taken out of its column",
        "",
        "| call carries | gap between calls (ms) | sidecar CPU / call (ms) | client CPU / call (ms) | wall / call (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for (variant, gap), c in costs.items():
        sidecar, client, wall = c.row(idle_rate)
        lines.append(f"| {variant} | {gap * 1000:g} | {sidecar:.3f} | {client:.3f} | {wall:.3f} |")
    sidecar, client, wall = renders.row(idle_rate)
    lines.append(f"| (a render call, for scale) | 0 | {sidecar:.3f} | {client:.3f} | {wall:.3f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400, help="calls per cell and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=4.0, help="the spaced rows' pause between calls")
    parser.add_argument("--prompt-words", type=int, default=0, help="words appended to the user message")
    parser.add_argument("--render-workers", type=int, default=4, help="the sidecar's --renderer-num-workers")
    parser.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="motorsite-derender-cost-"))
    (tmp / "logs").mkdir()
    cfg = bench_stack("bench/derender_cost.py", engines="sim", engine_count=0, api_key="sk-unused-" + "0123456789abcdef",
                      log_dir=tmp / "logs", database_url=f"sqlite:///{tmp / 'unused.sqlite3'}",
                      render_workers=args.render_workers)
    with Supervisor([stack.render_spec(cfg)]) as tiers:
        before = loadavg()
        costs, renders, idle_rate = asyncio.run(
            measure(f"http://{stack.HOST}:{cfg.render_port}", tiers.pids["render"], args)
        )
        after = loadavg()
    publish(HEADING, report(costs, renders, idle_rate, (before, after), args), write=args.write)
    tidy(tmp, keep=False, logs=tmp / "logs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
