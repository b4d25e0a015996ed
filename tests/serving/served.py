"""A real coordinator process (Daphne or uvicorn, as ``make run`` starts it) over the fake upstreams.

The fake render sidecar, engines and derender of ``fakes.py`` are served over 127.0.0.1 by
``bench/fake_upstream_server.py``; the coordinator reads its fleet from an SQLite database that
``stack.prepare_database`` writes (as ``make run`` does), so a test or benchmark drives the whole
coordinator through its server over a socket without starting vLLM. Used by
``test_silent_client.py`` and ``bench/slow_reader.py``; ``signal_for_json`` asks a coordinator run
under a counting or tracing wrapper (``counted_server.py``, ``bench/traced_server.py``) what it holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import httpx

from motorsite import stack
from motorsite.supervisor import Supervisor, free_port
from tests.serving.fakes import MODEL, VOCAB_SIZE

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-served-" + uuid.uuid4().hex  # the settings refuse a short or repetitive key


@contextlib.contextmanager
def fake_upstreams(tokens: int, pad_bytes: int = 0, token_ms: float = 0.0) -> Iterator[dict[str, str]]:
    """Start ``bench/fake_upstream_server.py``; yields the base URL of each fake host (render, e1, e2)."""
    argv = [sys.executable, str(ROOT / "bench" / "fake_upstream_server.py"), "--tokens", str(tokens),
            "--pad-bytes", str(pad_bytes), "--token-ms", str(token_ms)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ports = json.loads(proc.stdout.readline())
        yield {host: f"http://127.0.0.1:{port}" for host, port in ports.items()}
    finally:
        proc.terminate()
        proc.wait(10)


@dataclass(frozen=True)
class Fleet:
    """The fakes and a database describing them; ``coordinator`` starts a server in front."""

    cfg: stack.StackConfig
    urls: dict[str, str]

    def stats(self) -> dict[str, Any]:
        """The fakes' counters (``bench/fake_upstream_server.py``): events sent, derendered tokens, aborts."""
        got: dict[str, Any] = httpx.get(self.urls["render"] + "/stats").json()
        return got

    @contextlib.contextmanager
    def coordinator(
        self, server: str, env: dict[str, str] | None = None, *, wrapper: Path | None = None, ready_timeout: float = 0.0,
    ) -> Iterator[tuple[stack.StackConfig, int]]:
        """A coordinator under ``server`` (daphne | uvicorn), with ``env`` added to its environment;
        yields its configuration and process id. With ``wrapper``, the server's module and arguments
        are run by that script (``counted_server.py``, ``bench/traced_server.py``); it is given at
        least ``ready_timeout`` seconds to be ready."""
        cfg = replace(self.cfg, server=server, coordinator_port=free_port(),
                      extra_env={**self.cfg.extra_env, **(env or {})})
        spec = stack.coordinator_spec(cfg)
        if wrapper is not None:
            python, dash_m, module, *rest = spec.argv
            assert dash_m == "-m"
            spec = replace(spec, argv=[python, str(wrapper), module, *rest])
        spec = replace(spec, log_path=coordinator_log(cfg), ready_timeout=max(spec.ready_timeout, ready_timeout))
        with Supervisor([spec]) as sup:
            yield cfg, sup.pids["coordinator"]


def signal_for_json(pid: int, path: Path, timeout_s: float) -> dict[str, Any]:
    """Send ``pid`` SIGUSR1 and wait up to ``timeout_s`` for the JSON it writes to ``path`` in answer
    (whole or not at all: the wrappers rename it into place); returns it."""
    path.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"process {pid} never wrote {path.name}"
        time.sleep(0.05)
    got: dict[str, Any] = json.loads(path.read_text())
    return got


def coordinator_log(cfg: stack.StackConfig) -> Path:
    """The log of the coordinator ``Fleet.coordinator`` started with ``cfg`` (one per process)."""
    return cfg.log_dir / f"coordinator-{cfg.server}-{cfg.coordinator_port}.log"


@contextlib.contextmanager
def fake_fleet(
    tmp: Path, tokens: int, pad_bytes: int = 0, coalesce: bool = True, max_model_len: int = 1 << 20,
    token_ms: float = 0.0,
) -> Iterator[Fleet]:
    """The fakes (each engine stream ``tokens`` tokens long, ``token_ms`` apart, each derendered chunk
    ``pad_bytes`` longer) and a database of them, in ``tmp``; ``coalesce`` is the render config's
    derender coalescing."""
    model_dir = tmp / "model"
    model_dir.mkdir()
    # What demo_fleet reads: the fakes render Qwen2 ids, so their vocabulary is the bound.
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": VOCAB_SIZE}))
    with fake_upstreams(tokens, pad_bytes, token_ms) as urls:
        cfg = stack.StackConfig(
            model_dir=str(model_dir), render_python="", engine_python="", engines="sim",
            served_model_name=MODEL, max_model_len=max_model_len,
            render_port=int(urls["render"].rsplit(":", 1)[1]),
            engine_ports=(int(urls["e1"].rsplit(":", 1)[1]), int(urls["e2"].rsplit(":", 1)[1])),
            prefill_ports=(), decode_ports=(), database_url=f"sqlite:///{tmp / 'coordinator.sqlite3'}",
            api_keys=(API_KEY,), log_dir=tmp, celery=False, restart=None,
        )
        stack.prepare_database(cfg)
        with sqlite3.connect(tmp / "coordinator.sqlite3") as conn:
            assert conn.execute("UPDATE serving_renderconfig SET derender_coalesce = ?", (coalesce,)).rowcount == 1
        yield Fleet(cfg, urls)
