"""What the transport alone costs a derender-sized call: loopback TCP against a unix socket.

A real sidecar's CPU per call (0.6-1.4 ms) is mostly vLLM's FastAPI app, and on a loaded 2-core
machine its round-to-round noise is larger than what the transport changes. This takes the app
out: two uvicorn servers (the sidecar's server, with uvloop and httptools) of one trivial ASGI app
that reads a derender request's body and answers a derender answer's bytes, one on 127.0.0.1 and
one on a unix socket (``--uds``), and the coordinator's own client (``Http11Client``) calling each
in interleaved rounds (the order turns every round), one call at a time. Reported per call: the
server's CPU (``/proc/*/task/*/schedstat``) and the client's (this process's), and each round's
unix/TCP ratio.

    python3 -m toolchain exec bench/uds_transport.py [--calls 4000] [--rounds 12] [--write]

``--write`` replaces this benchmark's section of ``bench/RESULTS.md``. Numbers only.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HEADING = "## bench/uds_transport.py"
# A streamed derender call's sizes as the coordinator sends and receives them: a one-token event
# with the stream state (about 0.6 KiB) and a one-chunk answer (about 0.4 KiB).
REQUEST = {"stream": True, "model": "tiny", "generate_chunk": {"token_ids": [1234], "finish_reason": None},
           "prompt_tokens": 21, "stream_state": "x" * 480}
ANSWER = b'{"chunk": {"id": "chatcmpl-0", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": ' \
         b'{"content": " lighthouse"}, "finish_reason": null}]}, "stream_state": "' + b"y" * 240 + b'"}'


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Read the whole body, answer ``ANSWER``: uvicorn's share of a call, no framework."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]})
    await send({"type": "http.response.body", "body": ANSWER})


def main() -> int:
    from bench.common import free_port, loadavg, publish
    from motorsite import unix_http
    from motorsite.supervisor import ProcessSpec, Supervisor

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=4000, help="calls per transport and round")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="motor-uds-t-"))
    port, sock = free_port(), str(tmp / "t.sock")
    serve = [sys.executable, "-m", "uvicorn", "bench.uds_transport:app", "--app-dir", str(ROOT), "--no-access-log",
             "--log-level", "warning", "--loop", "uvloop", "--http", "httptools"]
    specs = [
        ProcessSpec(name="tcp", argv=[*serve, "--host", "127.0.0.1", "--port", str(port)], log_path=tmp / "tcp.log",
                    ports=[("127.0.0.1", port)], ready_post=("/", {}), ready_base_url=f"http://127.0.0.1:{port}"),
        ProcessSpec(name="unix", argv=[*serve, "--uds", sock], log_path=tmp / "unix.log", unix_sockets=[sock],
                    ready_post=("/", {}), ready_base_url=unix_http.base_url(sock)),
    ]
    with Supervisor(specs) as servers:
        urls = {"tcp": f"http://127.0.0.1:{port}/v1/chat/completions/derender",
                "unix": unix_http.base_url(sock) + "/v1/chat/completions/derender"}
        before = loadavg()
        rounds = asyncio.run(measure(urls, dict(servers.pids), args))
        after = loadavg()
    publish(HEADING, report(rounds, (before, after), args), write=args.write)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


async def measure(urls: dict[str, str], pids: dict[str, int], args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Per transport, per round: (server µs, client µs) per call."""
    from bench.sidecar_options import run_ns
    from serving.pipeline.http11 import Http11Client

    client = Http11Client()
    rounds: dict[str, list[tuple[float, float]]] = {n: [] for n in urls}
    try:
        for url in urls.values():  # warm-up
            for _ in range(500):
                await client.post(url, json=REQUEST)
        names = list(urls)
        for r in range(args.rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                s0, c0 = run_ns(pids[n]), time.process_time()
                for _ in range(args.calls):
                    await client.post(urls[n], json=REQUEST)
                rounds[n].append(((run_ns(pids[n]) - s0) / 1e3 / args.calls, (time.process_time() - c0) * 1e6 / args.calls))
    finally:
        await client.aclose()
    return rounds


def report(rounds: dict[str, list[tuple[float, float]]], load: tuple[str, str], args: argparse.Namespace) -> str:
    from bench.common import ratio_rows, section_head

    lines = section_head(HEADING, load, "2 cores shared by both servers, this client, and other work")
    lines += [
        f"- workload: per transport and round {args.calls} derender-sized POSTs (a {len(str(REQUEST))}-byte body, a "
        f"{len(ANSWER)}-byte answer) to uvicorn (uvloop, httptools) with a trivial ASGI app, one at a time, through "
        f"`Http11Client`; {args.rounds} rounds, the order turning each round",
        "",
        "| transport | server CPU / call (µs), median round | client CPU / call (µs), median round | "
        "server + client (µs) | vs tcp, median (range) of rounds |",
        "|---|---:|---:|---:|---:|",
    ]
    return "\n".join(lines + ratio_rows(rounds, "tcp", 1))


if __name__ == "__main__":
    sys.exit(main())
