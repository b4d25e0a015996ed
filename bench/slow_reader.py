"""Memory per stream under slow readers: what a stream holds in the coordinator while its client reads nothing.

Measured through the server: the coordinator runs as ``make run`` starts it (Daphne, or uvicorn on
uvloop and httptools as ``MOTOR_SERVER=uvicorn``), under ``bench/traced_server.py`` (tracemalloc
on, the heap it holds written out on a signal), in front of the fake render sidecar, engines and
derender of the component tests served over 127.0.0.1 by a process of their own
(``bench/fake_upstream_server.py``, through ``tests/serving/served.py``). ``--streams`` clients
each send a streaming completion (``--prompts`` prompts of ``--tokens`` tokens) over a socket with
a 4 KiB receive buffer, and read nothing. Linux autotunes a loopback connection's send buffer to
megabytes, which a stream of real-sized frames would take thousands of tokens to fill before the
coordinator's own bound is what holds it back: the server's accepted sockets get a fixed
``--sndbuf`` instead (``bench/traced_server.py``; the kernel doubles it). ``--pad-bytes`` pads
every derendered chunk (0: frames of their real size).

Once every stream is blocked (no derender call over a whole second), the row gives, per stream:

- held: the coordinator's Python heap (tracemalloc current, after a garbage collection) minus the
  heap before the streams opened: the server's write buffer, the request's state, the engine and
  derender connections' buffers, queued chunks;
- RSS: the same difference in resident memory (coarse: the allocator keeps freed pages);
- in the kernel: what the kernel holds on the clients' connections (the server sockets' send
  queues, the clients' receive queues);
- frames derendered, engine events sent of those asked, engine streams aborted at hang-up.

Then the clients hang up, and the row checks that no engine stream is left open and the
coordinator holds no admitted tokens. ``--server`` names the servers to measure (both by default);
coalescing is measured off and on.

    python3 -m toolchain exec bench/slow_reader.py [--server daphne,uvicorn] [--streams 1,16]
                                                   [--prompts 2] [--tokens 1000] [--sndbuf 16384]
                                                   [--pad-bytes 0] [--top 0] [--depth 1]
                                                   [--coalesce off,on] [--write]

Reports numbers only; nothing here asserts on memory (tests/serving/test_silent_client.py does,
through the kernel's queues).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import command_line, loadavg, machine, write_section  # noqa: E402
from motorsite import stack  # noqa: E402
from tests.serving.fakes import MODEL  # noqa: E402
from tests.serving.served import API_KEY, Fleet, fake_fleet, signal_for_json  # noqa: E402
from tests.serving.test_silent_client import kernel_queued, silent_post  # noqa: E402

SECTION = "## bench/slow_reader.py"
# Blocked: nothing derendered over this many polls of POLL_S each.
POLL_S = 0.25
STILL_POLLS = 8  # 2 s of neither derender calls nor bytes moving (``wait_still``)
WAIT_S = 120.0


def traced_coordinator(
    fleet: Fleet, server: str, trace_file: Path, sndbuf: int, top: int, depth: int = 1,
) -> contextlib.AbstractContextManager[tuple[stack.StackConfig, int]]:
    """``fleet``'s coordinator under ``server``, run by ``bench/traced_server.py``."""
    env = {
        "MOTOR_BENCH_TRACE_FILE": str(trace_file),
        "MOTOR_BENCH_SNDBUF": str(sndbuf),
        "MOTOR_BENCH_TRACE_TOP": str(top),
        "MOTOR_BENCH_TRACE_DEPTH": str(depth),
        "MOTOR_CLIENT_STALL_S": "3600",  # the bench measures the held state, not the cut
    }
    # Traced, a coordinator starts several times slower; on a machine shared with other work that
    # can pass the supervisor's 30 s.
    return fleet.coordinator(server, env, wrapper=ROOT / "bench" / "traced_server.py", ready_timeout=120.0)


def heap(pid: int, trace_file: Path) -> dict[str, Any]:
    """The coordinator's traced heap and RSS, in bytes (``bench/traced_server.py``)."""
    return signal_for_json(pid, trace_file, WAIT_S)


def silent_client(port: int, body: bytes) -> socket.socket:
    return silent_post(port, "/v1/completions", body)


def wait_still(fleet: Fleet, port: int, clients: list[socket.socket]) -> dict[str, Any]:
    """Wait until every stream is blocked: neither a derender call nor a byte more in the kernel
    between the coordinator and its clients over ``STILL_POLLS`` polls. On a loaded machine the
    coordinator can go a second without a derender call while its streams still run (measured
    early, a stream held half its frames); the clients' queues show that it has not stopped."""
    deadline = time.monotonic() + WAIT_S
    last: dict[str, Any] = {}
    last_queued = -1
    still = 0
    while still < STILL_POLLS:
        assert time.monotonic() < deadline, "the streams never stopped"
        time.sleep(POLL_S)
        try:
            now = fleet.stats()
        except httpx.TimeoutException:
            continue  # the fakes' process is slow to answer on a loaded machine: ask again
        queued = sum(kernel_queued(port, c) for c in clients)
        moved = now["derender_calls"] != last.get("derender_calls") or queued != last_queued
        still = 0 if moved else still + 1
        last, last_queued = now, queued
    return last


def wait_released(fleet: Fleet, cfg: stack.StackConfig) -> bool:
    """No engine stream open, no admitted token left in the coordinator. (An engine stream whose end
    the coordinator had already read is not aborted: it finished.)"""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        metrics = httpx.get(cfg.coordinator_url + "/metrics").text
        inflight = [line for line in metrics.splitlines()
                    if line.startswith("motor_engine_in_flight_tokens{") and float(line.split()[-1]) != 0]
        if fleet.stats()["open_streams"] == 0 and not inflight:
            return True
        time.sleep(0.1)
    return False


def measure(fleet: Fleet, server: str, streams: int, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    trace_file = tmp / f"heap-{server}.json"
    body = json.dumps({"model": MODEL, "prompt": [f"p{i}" for i in range(args.prompts)], "stream": True,
                       "max_tokens": args.tokens}).encode()
    with traced_coordinator(fleet, server, trace_file, args.sndbuf, args.top, args.depth) as (cfg, pid):
        # Warm-up, not measured: imports, the snapshot, connections to the sidecar and, with as
        # many prompts as the measured streams, to each engine a prompt goes to (once a process).
        warm = {"model": MODEL, "prompt": [f"warm{i}" for i in range(args.prompts)], "stream": True, "max_tokens": 4}
        with httpx.Client(headers={"authorization": f"Bearer {API_KEY}"}, timeout=WAIT_S) as client:
            for _ in range(2):
                r = client.post(cfg.coordinator_url + "/v1/completions", json=warm)
                assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text[-200:]
        before = fleet.stats()
        base = heap(pid, trace_file)
        clients = [silent_client(cfg.coordinator_port, body) for _ in range(streams)]
        try:
            stats = wait_still(fleet, cfg.coordinator_port, clients)
            held = heap(pid, trace_file)
            queued = sum(kernel_queued(cfg.coordinator_port, c) for c in clients)
            # A stream refused or ended (an error) holds nothing: the row's mean would not be a held stream's.
            answered = sum(c.recv(12, socket.MSG_PEEK) == b"HTTP/1.1 200" for c in clients)
            print(f"{server} {streams} streams: {answered} answered 200, {queued / streams / 1024:.1f} KiB a stream "
                  f"in the kernel, {stats['derender_calls'] - before['derender_calls']} frames")
        finally:
            for c in clients:
                c.close()
        for site, size, count in held.get("top", []):
            print(f"{size / 1024 / streams:8.1f} KiB {count / streams:7.1f} blocks per stream  {site}")
        frames = stats["derender_calls"] - before["derender_calls"]
        released = wait_released(fleet, cfg)
        aborted = len(fleet.stats()["aborted"]) - len(before["aborted"])
    return {
        "held": (held["traced"] - base["traced"]) / streams,
        "rss": (held["rss"] - base["rss"]) / streams,
        "kernel": queued / streams,
        "events_sent": (stats["events_sent"] - before["events_sent"]) / streams,
        "events": args.prompts * args.tokens,
        "frames": frames / streams,
        "aborted": aborted / streams,
        "released": float(released),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default=",".join(stack.SERVERS))
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--sndbuf", type=int, default=16384, help="the server sockets' SO_SNDBUF")
    parser.add_argument("--pad-bytes", type=int, default=0)
    parser.add_argument("--top", type=int, default=0, help="print the N largest allocation sites held (by line)")
    parser.add_argument("--coalesce", default="off,on", help="derender coalescing: off, on or both")
    parser.add_argument("--depth", type=int, default=1, help="with --top: group by stacks of this many frames")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    servers = args.server.split(",")
    for server in servers:
        if server not in stack.SERVERS:
            parser.error(f"--server: {server!r} is not one of {', '.join(stack.SERVERS)}")
    rows = []
    load = loadavg()
    for coalesce in [{"off": False, "on": True}[x] for x in args.coalesce.split(",")]:
        with tempfile.TemporaryDirectory(prefix="motorsite-slow-reader-") as tmp_dir:
            tmp = Path(tmp_dir)
            with fake_fleet(tmp, tokens=args.tokens, pad_bytes=args.pad_bytes, coalesce=coalesce) as fleet:
                for server in servers:
                    for streams in [int(x) for x in args.streams.split(",")]:
                        r = measure(fleet, server, streams, args, tmp)
                        print(server, streams, coalesce, r, flush=True)
                        rows.append((server, streams, coalesce, r))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION, "",
        f"- date: {now}",
        f"- machine: {machine()}; load average {load} before, {loadavg()} after",
        f"- command: `{command_line()}` (from the repository root)",
        f"- workload: streaming completions with {args.prompts} prompts x {args.tokens} tokens each"
        f"{f', every derendered chunk padded by {args.pad_bytes} bytes' if args.pad_bytes else ''}, through the "
        "coordinator's server over 127.0.0.1 (`make run`'s command line under `bench/traced_server.py`, accepted "
        f"sockets' SO_SNDBUF {args.sndbuf}), in front of the fake upstreams (`bench/fake_upstream_server.py`); "
        "each client has a 4 KiB receive buffer and reads nothing",
        "- held / stream: the coordinator's tracemalloc heap with every stream blocked minus before the streams "
        "opened (the server's write buffer, request state, engine and derender connections' buffers, queued "
        "chunks); RSS / stream the same in resident memory (coarse); in the kernel: the clients' connections' "
        "send and receive queues",
        "",
        "| server | streams | coalescing | held / stream (KiB) | RSS / stream (KiB) | in the kernel / stream (KiB) "
        "| frames / stream | engine events sent / asked per stream | engine streams aborted / stream "
        "| released after hang-up |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for server, streams, coalesce, r in rows:
        lines.append(
            f"| {server} | {streams} | {'on' if coalesce else 'off'} | {r['held'] / 1024:.1f} | {r['rss'] / 1024:.0f} | "
            f"{r['kernel'] / 1024:.1f} | {r['frames']:.0f} | {r['events_sent']:.0f} / {r['events']:.0f} | "
            f"{r['aborted']:.1f} | {'yes' if r['released'] else 'NO'} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
