"""A render sidecar on TCP against one on a unix socket, through the whole coordinator, side by side.

Issue 32 counts the sidecar's CPU with the coordinator's, and a streamed answer costs one derender
call per chunk. This starts two stacks of the same build at once, each a real ``vllm launch
render``, the engine simulator and the coordinator (Daphne): ``tcp`` as ``make run`` started them
before (the sidecar on 127.0.0.1), ``unix`` with ``StackConfig.render_socket_dir`` (the sidecar on
a unix socket, ``--uds``; the coordinator's client over ``http+unix://``). Both get the same
32-token streamed chats, one at a time, in interleaved rounds (the order turns every round).
Reported per stream: the coordinator's and the sidecar's CPU (the scheduler's run time of each
process tree, ``/proc/*/task/*/schedstat``, less its idle rate), and each round's unix/tcp ratio.

    python3 -m toolchain exec bench/sidecar_uds.py [--streams 24] [--rounds 8] [--write]

``--write`` replaces this benchmark's section of ``bench/RESULTS.md``. Numbers only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_stack, loadavg, publish, ratio_rows, section_head, tidy  # noqa: E402
from bench.sidecar_options import run_ns  # noqa: E402
from motorsite import stack  # noqa: E402
from motorsite.supervisor import Supervisor, together  # noqa: E402

HEADING = "## bench/sidecar_uds.py"
API_KEY = "sk-bench-uds-0123456789abcdef"
VARIANTS = ("tcp", "unix")
TOKENS = 32
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}],
        "max_tokens": TOKENS, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


FRAMES: list[int] = []  # data frames per stream: about one per derender call when the engine is paced


def one_stream(client: httpx.Client) -> None:
    """A 32-token streamed chat, read to its end; raises unless it had all 32 tokens."""
    usage, frames = b"", 0
    with client.stream("POST", "/v1/chat/completions", json=BODY) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            frames += line.startswith("data: {")
            if '"usage"' in line and '"completion_tokens"' in line:
                usage = line.encode()
    if f'"completion_tokens":{TOKENS}'.encode() not in usage.replace(b" ", b""):
        raise RuntimeError(f"a stream without {TOKENS} tokens: {usage[:200]!r}")
    FRAMES.append(frames)


def measure(stacks: dict[str, tuple[str, int, int]], args: argparse.Namespace) -> tuple[dict[str, list[tuple[float, float, float]]], dict[str, tuple[float, float]]]:
    """Per variant, per round: (coordinator CPU s, sidecar CPU s, wall s) for ``args.streams`` streams; and each
    variant's idle rates (coordinator, sidecar) in CPU seconds per second."""
    clients = {n: httpx.Client(base_url=url, timeout=60, trust_env=False, headers={"Authorization": f"Bearer {API_KEY}"})
               for n, (url, _, _) in stacks.items()}
    rounds: dict[str, list[tuple[float, float, float]]] = {n: [] for n in stacks}
    try:
        for n in stacks:  # warm-up: connections, caches, the first render's template
            for _ in range(8):
                one_stream(clients[n])
        names = list(stacks)
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for n in order:
                _, coord, sidecar = stacks[n]
                c0, s0, t0 = run_ns(coord), run_ns(sidecar), time.perf_counter()
                for _ in range(args.streams):
                    one_stream(clients[n])
                rounds[n].append(((run_ns(coord) - c0) / 1e9, (run_ns(sidecar) - s0) / 1e9, time.perf_counter() - t0))
        starts = {n: (run_ns(c), run_ns(s)) for n, (_, c, s) in stacks.items()}
        t0 = time.perf_counter()
        time.sleep(4.0)
        wall = time.perf_counter() - t0
        idle = {n: ((run_ns(c) - starts[n][0]) / 1e9 / wall, (run_ns(s) - starts[n][1]) / 1e9 / wall)
                for n, (_, c, s) in stacks.items()}
    finally:
        for client in clients.values():
            client.close()
    return rounds, idle


def per_stream_ms(rounds: list[tuple[float, float, float]], idle: tuple[float, float], streams: int) -> list[tuple[float, float]]:
    return [(1000 * max(c - idle[0] * w, 0.0) / streams, 1000 * max(s - idle[1] * w, 0.0) / streams) for c, s, w in rounds]


def report(rounds: dict[str, list[tuple[float, float, float]]], idle: dict[str, tuple[float, float]],
           load: tuple[str, str], args: argparse.Namespace) -> str:
    ms = {n: per_stream_ms(rounds[n], idle[n], args.streams) for n in rounds}
    lines = section_head(HEADING, load, "2 cores shared by both stacks, this client, and other work")
    lines += [
        f"- workload: per variant and round {args.streams} streamed chats of {TOKENS} tokens (usage checked), one at "
        f"a time, through the coordinator (Daphne) and its sidecar; the simulator as the engine, one token every "
        f"{args.tpot_ms:g} ms (so each token is a derender call of its own: {statistics.median(FRAMES):.0f} data frames "
        f"a stream, median); {args.rounds} rounds, the order turning each round; each process tree's idle rate taken out",
        "",
        "| variant | coordinator CPU / stream (ms), median round | sidecar CPU / stream (ms), median round | "
        "coordinator + sidecar (ms) | vs tcp, median (range) of rounds |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += ratio_rows(ms, "tcp", 2)
    lines += ["", "Per round, coordinator + sidecar ms per stream (tcp / unix): " + "; ".join(
        f"{tc + ts:.1f} / {uc + us:.1f}" for (tc, ts), (uc, us) in zip(ms["tcp"], ms["unix"], strict=True))]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=24, help="streams per variant and round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tpot-ms", type=float, default=4.0, help="the simulator's time per output token")
    parser.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="motor-uds-"))
    specs, cfgs = [], {}
    for n in VARIANTS:
        (tmp / n / "logs").mkdir(parents=True)
        cfg = bench_stack("bench/sidecar_uds.py", engines="sim", engine_count=1, api_key=API_KEY,
                          log_dir=tmp / n / "logs", database_url=f"sqlite:///{tmp / n / 'db.sqlite3'}",
                          celery=False, restart=None, render_socket_dir=(tmp / n / "run") if n == "unix" else None)
        engine = stack.engine_specs(cfg)[0]
        engine = replace(engine, name=f"engine-{n}", argv=[*engine.argv, "--eos-probability", "0", "--tpot-ms", f"{args.tpot_ms:g}"], ready_timeout=180.0)
        render = replace(stack.render_specs(cfg)[0], name=f"render-{n}", ready_timeout=300.0)
        specs += [render, engine]
        cfgs[n] = cfg
    with Supervisor(together(specs)) as tiers:
        for cfg in cfgs.values():
            stack.prepare_database(cfg)
        coordinators = [replace(stack.coordinator_spec(cfg), name=f"coordinator-{n}") for n, cfg in cfgs.items()]
        with Supervisor(coordinators) as coords:
            targets = {n: (cfg.coordinator_url, coords.pids[f"coordinator-{n}"], tiers.pids[f"render-{n}"])
                       for n, cfg in cfgs.items()}
            before = loadavg()
            rounds, idle = measure(targets, args)
            after = loadavg()
    publish(HEADING, report(rounds, idle, (before, after), args), write=args.write)
    tidy(tmp, keep=False, logs=tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
