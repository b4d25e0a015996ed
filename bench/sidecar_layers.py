"""What each ASGI layer of the render sidecar costs a streaming derender call, in-process.

Takes the sidecar's command line from ``motorsite.tiers.render_sidecar_command`` (so with
``--middleware motorsite_render_asgi.DerenderFastPath``), then runs itself again in the render
environment (vLLM 0.33.0, ``MOTOR_RENDER_PYTHON``), which builds the FastAPI app exactly as
``vllm launch render`` does from that command line and calls it directly with ASGI messages: no socket, no uvicorn, no other process. For the whole app
and for the chain below each layer it reports the Python function calls per derender call
(``cProfile``'s count: deterministic, whatever else runs on the machine) and the CPU per call
(``time.process_time``, all threads, rounds interleaved). "Below DerenderFastPath" is the chain
every call went through before that middleware (the instrumentator included).

    python3 -m toolchain exec bench/sidecar_layers.py [--calls 2000] [--rounds 3]

Prints a table; nothing is written and nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# A module of constants only: it imports in the render environment too (``--child``).
from bench.derender_sample import BODY, EVENT  # noqa: E402

DERENDER = "/v1/chat/completions/derender"


def build(argv: list[str]) -> Any:
    """The render app and its config, as ``vllm launch render`` builds them from ``argv``."""
    from vllm import AsyncEngineArgs, envs
    from vllm.config import VllmConfig
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.entrypoints.launchers.app import build_app
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[argv.index("render") + 1:])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    model_config = engine_args.create_model_config()
    model_config.quantization = None
    envs.VLLM_CPU_KVCACHE_SPACE = 0
    config = VllmConfig(model_config=model_config, logging_config=engine_args.create_logging_config(),
                        structured_outputs_config=engine_args.create_structured_outputs_config())
    return build_app(args, ("render",)), config, args


async def call(root: Any, target: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    raw = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "state": {}, "app": root,
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(raw)).encode())],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
    }
    messages: list[dict[str, Any]] = []
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await target(scope, receive, send)
    if messages[0]["status"] != 200:
        raise RuntimeError(f"{path} answered {messages[0]['status']}: {messages[1].get('body', b'')[:300]!r}")
    return json.loads(b"".join(m.get("body", b"") for m in messages[1:]))


async def measure(args: argparse.Namespace) -> None:
    from vllm.entrypoints.launchers.render.app_state import init_render_app_state

    app, config, vargs = build(json.loads(args.child))
    await init_render_app_state(config, app.state, vargs)
    ids = (await call(app, app, "/v1/chat/completions/render", BODY))["token_ids"]
    first = {"stream": True, "model": "tiny", "generate_chunk": EVENT, "prompt_tokens": len(ids),
             "prompt_token_ids": ids, "chat_request": BODY, "stream_state": None}
    state = (await call(app, app, DERENDER, first))["stream_state"]
    bare = {"stream": True, "model": "tiny", "generate_chunk": EVENT, "prompt_tokens": len(ids), "stream_state": state}
    app.middleware_stack = app.middleware_stack or app.build_middleware_stack()
    targets: dict[str, Any] = {"whole app": app}
    node = app.middleware_stack
    while hasattr(node, "app") and type(node).__name__ != "ExceptionMiddleware":
        targets[f"below {type(node).__name__}"] = node.app
        node = node.app
    counts: dict[str, float] = {}
    for name, target in targets.items():
        for _ in range(100):
            await call(app, target, DERENDER, bare)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            await call(app, target, DERENDER, bare)
        profile.disable()
        counts[name] = pstats.Stats(profile).total_calls / 200  # type: ignore[attr-defined]
    cpu: dict[str, list[float]] = {name: [] for name in targets}
    for r in range(args.rounds):
        order = list(targets) if r % 2 == 0 else list(targets)[::-1]
        for name in order:
            c0 = time.process_time()
            for _ in range(args.calls):
                await call(app, targets[name], DERENDER, bare)
            cpu[name].append(1e6 * (time.process_time() - c0) / args.calls)
    print(f"load average before/after: see uptime; {args.calls} calls x {args.rounds} rounds per row")
    print("| entered at | Python function calls / derender call | CPU / call (us), per round |")
    print("|---|---:|---|")
    for name in targets:
        print(f"| {name} | {counts[name]:.0f} | {' / '.join(f'{v:.0f}' for v in cpu[name])} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the sidecar's argv, in the render environment
    args = parser.parse_args()
    if args.child:
        asyncio.run(measure(args))
        return 0
    from bench.common import require_env
    from motorsite import tiers

    render_python = require_env("MOTOR_RENDER_PYTHON", "bench/sidecar_layers.py")
    argv, env = tiers.render_sidecar_command(python=render_python, model_dir=require_env(
        "MOTOR_MODEL_DIR", "bench/sidecar_layers.py"), served_model_name="tiny", port=0, workers=4)
    child = [render_python, __file__, "--calls", str(args.calls), "--rounds", str(args.rounds),
             "--child", json.dumps(argv)]
    return subprocess.run(child, env={**os.environ, **env}, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
