"""What the render sidecar's own options save per derender call, side by side in one run.

Issue 32 counts the sidecar's CPU with the coordinator's, and a streamed answer costs one
derender call per chunk (``bench/derender_cost.py``: about 0.7-1 ms of sidecar CPU each). This
starts one real ``vllm launch render`` per variant at once, each as ``motorsite.stack.render_spec``
starts it plus the variant's extra arguments, and sends each the same calls in interleaved rounds
(the order turns every round), one call at a time, through the coordinator's own client
(``RenderClient`` over ``Http11Client``). Reported per call: the sidecar's CPU (utime + stime of
its process tree from /proc, less its idle rate), which holds up under other load on the machine
better than wall time does.

    python3 -m toolchain exec bench/sidecar_options.py [--calls 600] [--rounds 4] [--variants a,b]
                                                       [--write]

The variants (``VARIANTS``): ``shipped`` is what ``make run`` starts now, ``before`` the same
less ``tiers.SIDECAR_LEAN_ARGS`` (the command before this benchmark), and each other one a
candidate option of vLLM 0.33.0 on top of ``before``; ``unix`` is ``shipped`` on a unix socket (the
client's CPU, this process's, is the column that shows the coordinator's side of that).
``--write`` replaces this benchmark's section of ``bench/RESULTS.md``. Numbers only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

from bench.common import bench_stack, free_port, loadavg, publish, section_head, tidy  # noqa: E402
from bench.derender_sample import BODY, EVENT  # noqa: E402
from motorsite import stack, tiers  # noqa: E402
from motorsite.supervisor import Supervisor  # noqa: E402
from serving.pipeline.http11 import Http11Client  # noqa: E402
from serving.pipeline.render.client import CHAT_DERENDER, RenderClient  # noqa: E402

HEADING = "## bench/sidecar_options.py"
# name -> (what it is, arguments added to ``before``'s command line)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "before": ("the command before this benchmark: shipped less `SIDECAR_LEAN_ARGS`", []),
    "shipped": ("`tiers.render_sidecar_command` on 127.0.0.1 (compose, k8s; make run before issue 32's unix socket)",
                tiers.SIDECAR_LEAN_ARGS),
    # Its command takes --uds PATH in place of --host and --port; the client connects to the socket.
    "unix": ("shipped on a unix socket: what make run starts (`StackConfig.render_socket_dir`)",
             [*tiers.SIDECAR_LEAN_ARGS, "--uds"]),
    "no-docs": ("before, no OpenAPI routes", ["--disable-fastapi-docs"]),
    "no-access-log": ("before, no uvicorn access log at all", ["--disable-uvicorn-access-log"]),
    "log-warning": ("before, uvicorn logs warnings only", ["--uvicorn-log-level", "warning"]),
}


def before_argv(shipped: list[str]) -> list[str]:
    """``shipped`` without ``tiers.SIDECAR_LEAN_ARGS``."""
    lean = tiers.SIDECAR_LEAN_ARGS
    for i in range(len(shipped) - len(lean) + 1):
        if shipped[i:i + len(lean)] == lean:
            return shipped[:i] + shipped[i + len(lean):]
    raise ValueError("the shipped command has no SIDECAR_LEAN_ARGS")


def run_ns(pid: int) -> int:
    """Nanoseconds on a CPU of every thread of ``pid`` and of its children (``/proc/*/task/*/schedstat``):
    the scheduler's own clock, far finer than utime + stime's ticks."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0])
            with contextlib.suppress(OSError, ValueError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    return total


@dataclass
class Cost:
    """One variant's calls of one kind: (calls, CPU seconds, wall seconds) per round."""

    rounds: list[tuple[int, float, float]] = field(default_factory=list)

    def per_round_ms(self, idle_rate: float) -> list[float]:
        return [1000 * max(cpu - idle_rate * wall, 0.0) / max(n, 1) for n, cpu, wall in self.rounds]

    def per_call_ms(self, idle_rate: float) -> float:
        """The median round's CPU per call."""
        return statistics.median(self.per_round_ms(idle_rate))


async def stream(render: RenderClient) -> None:
    """A 32-token streamed chat's calls, as the coordinator makes them one token at a time: a render,
    the first derender (prompt ids and request), then 31 bare ones carrying the state along."""
    ids = (await render.render_chat(BODY, uuid.uuid4().hex))["token_ids"]
    _, state = await render.derender_chunk(
        "chat", EVENT, stream_state=None, prompt_tokens=len(ids), prompt_token_ids=ids, request=BODY, model="tiny",
    )
    for _ in range(31):
        _, state = await render.derender_chunk(
            "chat", EVENT, stream_state=state, prompt_tokens=len(ids), prompt_token_ids=None, request=None, model="tiny",
        )


async def measure(targets: dict[str, tuple[str, int]], args: argparse.Namespace) -> tuple[dict[str, dict[str, Cost]], dict[str, float]]:
    client = Http11Client()
    names = list(targets)
    costs: dict[str, dict[str, Cost]] = {n: {"bare": Cost(), "stream": Cost(), "client": Cost()} for n in names}
    try:
        renders = {n: RenderClient(client, url, 60.0) for n, (url, _) in targets.items()}
        bodies: dict[str, dict[str, Any]] = {}
        for n, render in renders.items():
            ids = (await render.render_chat(BODY, uuid.uuid4().hex))["token_ids"]
            _, state = await render.derender_chunk(
                "chat", EVENT, stream_state=None, prompt_tokens=len(ids), prompt_token_ids=ids, request=BODY, model="tiny",
            )
            bodies[n] = {"stream": True, "model": "tiny", "generate_chunk": EVENT, "prompt_tokens": len(ids),
                         "stream_state": state}
        for n in names:  # warm-up
            for _ in range(50):
                await renders[n]._post_derender(CHAT_DERENDER, bodies[n], {})
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            if r % 2:
                order = order[::-1]
            for n in order:
                pid = targets[n][1]
                s0, t0, c0 = run_ns(pid), time.perf_counter(), time.process_time()
                for _ in range(args.calls):
                    await renders[n]._post_derender(CHAT_DERENDER, bodies[n], {})
                costs[n]["client"].rounds.append((args.calls, time.process_time() - c0, 0.0))
                costs[n]["bare"].rounds.append((args.calls, (run_ns(pid) - s0) / 1e9, time.perf_counter() - t0))
                s0, t0 = run_ns(pid), time.perf_counter()
                streams = max(args.calls // 32, 1)
                for _ in range(streams):
                    await stream(renders[n])
                costs[n]["stream"].rounds.append((streams, (run_ns(pid) - s0) / 1e9, time.perf_counter() - t0))
        starts = {n: run_ns(targets[n][1]) / 1e9 for n in names}
        t0 = time.perf_counter()
        await asyncio.sleep(3.0)
        wall = time.perf_counter() - t0
        idle = {n: (run_ns(targets[n][1]) / 1e9 - starts[n]) / wall for n in names}
    finally:
        await client.aclose()
    return costs, idle


def report(costs: dict[str, dict[str, Cost]], idle: dict[str, float], load: tuple[str, str],
           args: argparse.Namespace) -> str:
    lines = section_head(HEADING, load, "2 cores shared by every sidecar and this client, and by other work")
    lines += [
        f"- workload: one call at a time; per variant and round {args.calls} bare streaming derender calls "
        f"(a one-token event and the stream state) and {max(args.calls // 32, 1)} 32-token streams' calls (`stream`: "
        f"a render, a first derender, 31 bare ones); {args.rounds} rounds, "
        "the order turning each round; each sidecar's idle rate taken out of its column",
        "",
        "| variant | what | arguments on top of before's | derender: sidecar CPU / call (ms), median round | "
        "vs before (or shipped), median (range) of rounds | "
        "32-token stream: sidecar CPU (ms), median round | vs before (or shipped) | derender: client CPU / call (ms) | "
        "vs shipped, median (range) of rounds |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]

    def versus(n: str, kind: str, against: str = "before") -> str:
        """Each round's ratio to ``against``'s in the same round (``shipped``'s when ``before`` did not
        run): their median and range."""
        if against == "before" and against not in costs:
            against = "shipped"
        if against not in costs:
            return "-"
        base = costs[against][kind].per_round_ms(0.0 if kind == "client" else idle[against])
        mine = costs[n][kind].per_round_ms(0.0 if kind == "client" else idle[n])
        ratios = sorted(a / b for a, b in zip(mine, base, strict=True) if b)
        return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})" if ratios else "-"

    for n, c in costs.items():
        what, extra = VARIANTS[n]
        lines.append(f"| {n} | {what} | `{' '.join(extra) or '(none)'}` | {c['bare'].per_call_ms(idle[n]):.3f} | "
                     f"{versus(n, 'bare')} | {c['stream'].per_call_ms(idle[n]):.2f} | {versus(n, 'stream')} | "
                     f"{c['client'].per_call_ms(0.0):.3f} | {versus(n, 'client', 'shipped')} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=600, help="derender calls per variant and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from VARIANTS")
    parser.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    args = parser.parse_args()
    names = [n.strip() for n in args.variants.split(",") if n.strip()]

    tmp = Path(tempfile.mkdtemp(prefix="motorsite-sidecar-options-"))
    (tmp / "logs").mkdir()
    cfg = bench_stack("bench/sidecar_options.py", engines="sim", engine_count=0, api_key="sk-unused-" + "0123456789abcdef",
                      log_dir=tmp / "logs", database_url=f"sqlite:///{tmp / 'unused.sqlite3'}")
    specs = []
    ports: dict[str, int] = {}
    urls: dict[str, str] = {}
    for n in names:
        ports[n] = free_port()
        ncfg = replace(cfg, render_port=ports[n], render_socket_dir=tmp / "run" if n == "unix" else None)
        spec = stack.render_specs(ncfg)[0]
        urls[n] = stack.render_base_url(ncfg, ports[n])
        extra = tiers.SIDECAR_LEAN_ARGS if n == "unix" else VARIANTS[n][1]  # its --uds is in spec.argv already
        specs.append(replace(spec, name=f"render-{n}", argv=before_argv(spec.argv) + extra, ready_timeout=600.0,
                             log_path=tmp / "logs" / f"{n}.log"))
    with Supervisor(specs) as sidecars:
        targets = {n: (urls[n], sidecars.pids[f"render-{n}"]) for n in names}
        before = loadavg()
        costs, idle = asyncio.run(measure(targets, args))
        after = loadavg()
    publish(HEADING, report(costs, idle, (before, after), args), write=args.write)
    tidy(tmp, keep=False, logs=tmp / "logs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
