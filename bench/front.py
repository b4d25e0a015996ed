"""The front alone: CPU per /v1 request of the ASGI application, with the pipeline stubbed out.

``first_path.py`` measures the whole coordinator on a machine the render sidecar, the engine
and the load generator share, so a few milliseconds of front overhead drown in its noise. This
drives ``motorsite.asgi.application`` in-process with raw ASGI calls (no sockets, no server),
a fleet snapshot from a temporary SQLite database and a pipeline that answers at once, and
reports process CPU time and wall time per request: what the front costs, nothing else.

    python3 -m toolchain exec bench/front.py [--requests 3000]

Runs against whatever tree it is in: the Django views (before the edge) or the edge.
Reports numbers only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KEY = "sk-bench-front-" + "0123456789abcdef"  # a key the settings accept (20+ characters, 6+ distinct)
BODY = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
ANSWER = {"id": "chatcmpl-x", "object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 1}}


class AnswerAtOnce:
    """Stands in for ServingPipeline: a chat completion without render, engine or derender."""

    async def chat(self, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        return ANSWER


def setup(tmp: str) -> Any:
    os.environ.update(
        DJANGO_SETTINGS_MODULE="motorsite.settings", DATABASE_URL=f"sqlite:///{tmp}/db.sqlite3",
        MOTOR_API_KEYS=KEY, LOG_LEVEL="WARNING",
    )
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from catalog.models import RenderConfig, ServedModel

    ServedModel.objects.create(name="tiny", model_path="/models/tiny", max_model_len=2048)
    RenderConfig.objects.create(host="127.0.0.1", port=1, timeout_ms=1000)
    from motorsite.asgi import application

    stub = AnswerAtOnce()
    for module in ("serving.views", "serving.edge.openai_api"):
        try:
            mod = __import__(module, fromlist=["pipeline_for"])
        except ImportError:
            continue
        if hasattr(mod, "pipeline_for"):
            mod.pipeline_for = lambda snapshot: stub  # type: ignore[attr-defined]
    return application


SCOPE = {
    "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
    "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
    "headers": [
        (b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()), (b"authorization", f"Bearer {KEY}".encode()),
    ],
    "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
}


async def one(application: Any) -> int:
    done = asyncio.Event()
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await done.wait()  # as a server does: the client is there until the response is complete
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif not message.get("more_body", False):
            done.set()

    await application(dict(SCOPE), receive, send)
    return status


async def run(application: Any, n: int) -> tuple[float, float]:
    for _ in range(200):  # warm-up: snapshot, imports, connection
        assert await one(application) == 200
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        await one(application)
    return (time.process_time() - cpu) / n, (time.perf_counter() - wall) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="motorsite-front-") as tmp:
        application = setup(tmp)
        cpu, wall = asyncio.run(run(application, args.requests))
    front = "edge" if Path(ROOT / "serving" / "edge").is_dir() else "Django views"
    print(f"{front}: {args.requests} requests, CPU {cpu * 1e6:.0f} us/request, wall {wall * 1e6:.0f} us/request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
