"""Does a stream whose client stopped reading for minutes still get the tail of a finished answer?

A uvicorn server with vLLM's keep-alive (5 s) streams ``--events`` SSE events and finishes; the
production upstream client (``Http11Client``) reads one piece, then nothing for ``--hold``
seconds, then reads to the end. The server closed the connection 5 s after the answer left it, so
the kernel holds the unsent tail in an orphaned socket whose zero-window probes back off; once
they reach two minutes it kills the socket, and the next read here gets a reset. The run is made
twice side by side, in two processes: with the client's periodic read on a paused connection
(``http11_wire.PAUSE_MAX_S``, production) and with it switched off (the client before 2026-12-03).

    python3 -m toolchain exec bench/orphaned_tail.py [--hold 450] [--events 3000] [--write]

Takes ``--hold`` seconds plus a few; reports what arrived, asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import command_line, loadavg, machine, write_section  # noqa: E402

SECTION = "## bench/orphaned_tail.py"
EVENT = b"data: " + b"x" * 200 + b"\n\n"


def sse_app(events: int) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(events):
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def one_run(hold_s: float, events: int, periodic_read: bool) -> dict[str, Any]:
    import uvicorn

    from serving.pipeline import http11_wire
    from serving.pipeline.http11 import Http11Client

    if not periodic_read:
        http11_wire.PAUSE_MAX_S = float("inf")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(sse_app(events), log_level="warning", lifespan="off", timeout_keep_alive=5))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    client = Http11Client()
    got, error = 0, ""
    try:
        async with client.stream("POST", f"http://127.0.0.1:{sock.getsockname()[1]}/", json={}) as reply:
            pieces = reply.aiter_raw()
            got += len(await pieces.__anext__())
            await asyncio.sleep(hold_s)
            async for piece in pieces:
                got += len(piece)
    except Exception as exc:  # the finding: reported, not raised
        error = repr(exc)
    await client.aclose()
    server.should_exit = True
    await serving
    return {"periodic_read": periodic_read, "got": got, "expected": events * len(EVENT), "error": error}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold", type=float, default=450.0)
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--variant", choices=["on", "off"], help=argparse.SUPPRESS)  # one side, as a child
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(asyncio.run(one_run(args.hold, args.events, args.variant == "on"))))
        return 0
    started = time.monotonic()
    children = [
        subprocess.Popen([sys.executable, __file__, "--hold", str(args.hold), "--events", str(args.events),
                          "--variant", v], stdout=subprocess.PIPE, text=True)
        for v in ("on", "off")
    ]
    rows = [json.loads(child.communicate()[0]) for child in children]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION, "",
        f"- date: {now}",
        f"- machine: {machine()}; load average {loadavg()}",
        f"- command: `{command_line()}` (from the repository root; {time.monotonic() - started:.0f} s)",
        f"- workload: uvicorn (keep-alive 5 s, as vLLM) streams {args.events} SSE events of {len(EVENT)} bytes and "
        f"finishes; the production client reads one piece, nothing for {args.hold:.0f} s, then the rest",
        "",
        "| client | bytes read | of | outcome |",
        "|---|---:|---:|---|",
    ]
    for r in rows:
        name = "one read per PAUSE_MAX_S while paused (production)" if r["periodic_read"] else "paused until read"
        outcome = "whole answer" if r["got"] == r["expected"] and not r["error"] else f"lost the tail: {r['error']}"
        lines.append(f"| {name} | {r['got']} | {r['expected']} | {outcome} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
