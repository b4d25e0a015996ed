"""Run an ASGI server's command line (``daphne ...`` or ``uvicorn ...``) for ``bench/slow_reader.py``,
with tracemalloc from the first SIGUSR1 on: on each SIGUSR1 the process collects garbage and writes
to ``MOTOR_BENCH_TRACE_FILE``, as JSON, its resident set and the Python heap allocated since the
first signal and still held (``tracemalloc`` current, bytes; 0 at the first). Tracing from start-up
would slow Django's imports tenfold; what a measurement needs is what was allocated after its baseline.

With ``MOTOR_BENCH_SNDBUF`` set, every connection the server accepts gets that kernel send buffer;
with ``MOTOR_BENCH_TRACE_TOP`` (N), the file also lists the N largest allocation sites held (by line,
or by stack of ``MOTOR_BENCH_TRACE_DEPTH`` frames).

    python bench/traced_server.py daphne -b 127.0.0.1 -p 8000 motorsite.asgi:application
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import runpy
import signal
import socket
import sys
import tracemalloc
from pathlib import Path
from types import FrameType
from typing import Any


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _dump(signum: int, frame: FrameType | None) -> None:
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0
    out = Path(os.environ["MOTOR_BENCH_TRACE_FILE"])
    tmp = out.with_suffix(".tmp")
    top = []
    if tracemalloc.is_tracing() and os.environ.get("MOTOR_BENCH_TRACE_TOP"):
        depth = int(os.environ.get("MOTOR_BENCH_TRACE_DEPTH", "1"))
        stats = tracemalloc.take_snapshot().statistics("lineno" if depth == 1 else "traceback")
        top = [[" > ".join(str(f) for f in s.traceback), s.size, s.count]  # caller > callee
               for s in stats[: int(os.environ["MOTOR_BENCH_TRACE_TOP"])]]
    tmp.write_text(json.dumps({"traced": traced, "rss": _rss_bytes(), "top": top}))
    if not tracemalloc.is_tracing():
        tracemalloc.start(int(os.environ.get("MOTOR_BENCH_TRACE_DEPTH", "1")))
    tmp.replace(out)  # the bench reads a whole file or none


def _pin_send_buffers(size: int) -> None:
    """Give every accepted connection a fixed kernel send buffer of ``size`` bytes.

    Linux autotunes a loopback connection's send buffer to megabytes, so a client that reads
    nothing would take megabytes of frames before the coordinator's own bound is what holds the
    stream back; pinned, a few kilobytes do, and the frames can keep their real size.
    """

    def pin(sock: Any) -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)

    accept = socket.socket.accept

    def accept_pinned(self: socket.socket) -> Any:  # Twisted's listening port (Daphne)
        conn, address = accept(self)
        pin(conn)
        return conn, address

    socket.socket.accept = accept_pinned  # type: ignore[method-assign]
    if sys.argv[1] == "uvicorn":  # uvloop accepts in C: the protocol pins its transport's socket
        from uvicorn.protocols.http import httptools_impl

        made = httptools_impl.HttpToolsProtocol.connection_made

        def connection_made(self: Any, transport: Any) -> None:
            pin(transport.get_extra_info("socket"))
            made(self, transport)

        httptools_impl.HttpToolsProtocol.connection_made = connection_made  # type: ignore[method-assign]


def main() -> None:
    module = sys.argv[1]
    signal.signal(signal.SIGUSR1, _dump)
    if os.environ.get("MOTOR_BENCH_SNDBUF"):
        _pin_send_buffers(int(os.environ["MOTOR_BENCH_SNDBUF"]))
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
