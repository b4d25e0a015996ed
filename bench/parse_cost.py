"""The upstream client's response parsing alone, in-process: ``http11_wire.Connection`` of this
tree against the same file at ``--baseline REV``, one kept-alive connection fed one response after
another, read by read, with no socket and no event loop turn (a fake transport).

Two responses, as uvicorn writes them: a 150-byte JSON reply (``Content-Length``) in one read, and
a 32-event SSE stream (one chunk per event) read chunk by chunk. Prints microseconds per response,
rounds interleaved so that both see the same machine.

    python3 -m toolchain exec bench/parse_cost.py [--baseline main] [--rounds 5]

Reports numbers only; nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WIRE = "serving/pipeline/http11_wire.py"


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

class FakeTransport:
    def write(self, data: bytes) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def get_extra_info(self, key: str) -> Any:
        return None


_JSON_BODY = json.dumps({"choices": [{"index": 0, "token_ids": list(range(40))}], "usage": {"prompt_tokens": 10}})
_HEAD = b"HTTP/1.1 200 OK\r\ndate: Sun, 06 Dec 2026 00:00:00 GMT\r\nserver: uvicorn\r\n"
JSON = _HEAD + b"content-length: %d\r\ncontent-type: application/json\r\n\r\n%s" % (
    len(_JSON_BODY), _JSON_BODY.encode()
)
_EVENT = b'data: {"request_id":"generate-tokens-x","choices":[{"index":0,"token_ids":[123],"finish_reason":null}]}\n\n'
SSE = [
    _HEAD + b"content-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
    *[b"%x\r\n%s\r\n" % (len(_EVENT), _EVENT)] * 32,
    b"0\r\n\r\n",
]


def run(mod: ModuleType, reads: list[bytes], n: int) -> float:
    loop = asyncio.new_event_loop()
    buf = mod._read_buffer.view
    c = mod.Connection(loop)
    c.connection_made(FakeTransport())
    t0 = time.perf_counter()
    for _ in range(n):
        c.start(b"x")  # one kept-alive connection, a response after another
        for r in reads:
            buf[: len(r)] = r
            c.buffer_updated(len(r))
            c.pieces.clear()
            c.buffered = 0
        assert c.complete
    dt = time.perf_counter() - t0
    loop.close()
    return dt / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--baseline", default="main", help="a git revision whose http11_wire.py runs beside this tree's")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_path = Path(tmp) / "base_wire.py"
        old_path.write_bytes(subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{args.baseline}:{WIRE}"], check=True, capture_output=True
        ).stdout)
        base, now = load(old_path, "base_wire"), load(ROOT / WIRE, "now_wire")
        print("| round | tree | JSON reply (us) | 32-event stream (us) |")
        print("|---:|---|---:|---:|")
        for rnd in range(args.rounds):
            for name, mod in ((f"base ({args.baseline})", base), ("now", now)):
                print(f"| {rnd + 1} | {name} | {run(mod, [JSON], 20000):.2f} | {run(mod, SSE, 2000):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
