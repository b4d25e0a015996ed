"""A ``make run`` stack started as a subprocess, observed from outside: for tests and benchmarks.

``LaunchedStack.start`` runs ``manage.py runstack`` (exactly what ``make run`` runs: the launcher
as a supervisor) on free ports of 127.0.0.1, with its own var directory, SQLite database and
demo key, the embedded default (no Redis) and union engines only (no P/D engines). The caller
then reads what the launcher recorded in that database (``processes()``: the ``ManagedProcess``
rows; ``instance(url)``: an engine instance's probe verdict and its ``InstanceEvent`` history),
scrapes the coordinator's ``/metrics``, and ends with ``stop()``: SIGTERM to the launcher, which
stops every process it started, then a check that no port of the stack is still bound.

Django-free (stdlib, httpx and ``motorsite.stack``), so a benchmark can use it without settings;
it reads the database with ``sqlite3`` and never writes to it.

Exceptions:

    LaunchError
    ├── LauncherExited  - the launcher process ended while something was being waited for
    └── NotInTime       - what ``until()`` waited for did not happen within its timeout
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import httpx

from motorsite import stack
from motorsite.supervisor import free_port, wait_port_free

# How often until() re-checks: the launcher's database rows and probes change on a scale of
# seconds, and every check is a SQLite read or an HTTP call against a busy 2-core machine.
POLL_INTERVAL_S = 0.2
# How long stop() lets the launcher take all its children down before killing the whole group.
STOP_TIMEOUT_S = 60.0
# A port of a process stopped a moment ago may take a little while to be bindable again.
PORT_FREE_TIMEOUT_S = 10.0


class LaunchError(Exception):
    """Something the caller waited for on the launched stack did not happen."""


class LauncherExited(LaunchError):
    pass


class NotInTime(LaunchError):
    pass


class ProcessRow(NamedTuple):
    """One ``ManagedProcess`` row as the launcher wrote it."""

    pid: int | None
    state: str  # starting | running | backoff | failed | stopped
    restarts: int
    last_exit: str  # e.g. "killed by SIGKILL"; "" before the first exit


@dataclass(frozen=True)
class Stopped:
    """How ``stop()`` went: the launcher's exit code and the stack's ports still bound after it."""

    code: int
    bound_ports: tuple[int, ...]

    @property
    def clean(self) -> bool:
        return self.code == 0 and not self.bound_ports


@dataclass
class LaunchedStack:
    """One running ``manage.py runstack`` and where to look at it."""

    cfg: stack.StackConfig
    var_dir: Path
    popen: subprocess.Popen[bytes]
    launcher_log: Path

    @classmethod
    def start(
        cls,
        var_dir: Path,
        *,
        api_key: str,
        engines: str = "vllm",
        union_engines: int = 2,
        probe_interval_s: float | None = None,
        env: Mapping[str, str] | None = None,
        launcher_log: Path | None = None,
    ) -> LaunchedStack:
        """Start the launcher on free ports and return at once (see ``wait_registered``).

        ``MOTOR_MODEL_DIR``, ``MOTOR_RENDER_PYTHON`` and ``MOTOR_ENGINE_PYTHON`` come from the
        environment (``python3 -m toolchain exec`` sets them); ``env`` is added last. The
        launcher's own output goes to ``launcher_log`` (default ``var_dir/launcher.log``), its
        children's logs to ``var_dir/log/``.
        """
        var_dir.mkdir(parents=True, exist_ok=True)
        db = var_dir / "db.sqlite3"
        cfg = stack.StackConfig(
            model_dir=os.environ["MOTOR_MODEL_DIR"],
            render_python=os.environ["MOTOR_RENDER_PYTHON"],
            engine_python=os.environ["MOTOR_ENGINE_PYTHON"],
            engines=engines,
            coordinator_port=free_port(),
            render_port=free_port(),
            engine_ports=tuple(free_port() for _ in range(union_engines)),
            prefill_ports=(),
            decode_ports=(),
            database_url=f"sqlite:///{db}",
            log_dir=var_dir / "log",
            celery_dir=var_dir / "celery",
        )
        child_env = {**os.environ, "DATABASE_URL": cfg.database_url, "MOTOR_DEMO_API_KEY": api_key}
        # The embedded default: SQLite and a filesystem broker, whatever the caller's shell has.
        child_env.pop("REDIS_URL", None)
        if probe_interval_s is not None:
            child_env["MOTOR_PROBE_INTERVAL_MS"] = str(int(probe_interval_s * 1000))
        child_env.update(env or {})
        argv = [
            sys.executable, str(stack.ROOT / "manage.py"), "runstack", "--engines", engines,
            "--port", str(cfg.coordinator_port), "--render-port", str(cfg.render_port),
            "--engine-ports", ",".join(map(str, cfg.engine_ports)), "--prefill-ports", "", "--decode-ports", "",
            "--var-dir", str(var_dir),
        ]
        log_path = launcher_log or var_dir / "launcher.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            # Its own session: stop() can kill the launcher's whole group if it does not stop.
            popen = subprocess.Popen(
                argv, cwd=stack.ROOT, env=child_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return cls(cfg, var_dir, popen, log_path)

    # -- what the launcher recorded ------------------------------------------------------------

    @property
    def db(self) -> Path:
        return self.var_dir / "db.sqlite3"

    @property
    def base(self) -> str:
        return self.cfg.coordinator_url

    @property
    def ports(self) -> tuple[int, ...]:
        cfg = self.cfg
        return (cfg.coordinator_port, cfg.render_port, *cfg.engine_ports, *cfg.prefill_ports, *cfg.decode_ports)

    def expected_processes(self) -> int:
        """How many processes the launcher starts for this config (sidecar, engines, Celery, coordinator)."""
        return len(stack.build_specs(self.cfg))

    def ready_timeout(self) -> float:
        """The sum of every process's ready timeout: the longest a healthy start can take."""
        return sum(s.ready_timeout for s in stack.build_specs(self.cfg))

    def processes(self) -> dict[str, ProcessRow]:
        """``name -> ProcessRow`` as the launcher recorded them; empty before it recorded any."""
        try:
            with sqlite3.connect(self.db, timeout=10) as conn:
                rows = conn.execute(
                    "SELECT name, pid, state, restarts, last_exit_reason FROM fleet_managedprocess"
                ).fetchall()
        except sqlite3.OperationalError:
            # No database yet, or not migrated yet ("no such table"): nothing recorded.
            return {}
        return {name: ProcessRow(pid, state, restarts, reason or "") for name, pid, state, restarts, reason in rows}

    def instance(self, url: str) -> tuple[str, list[tuple[str, str, str]]]:
        """The instance's probe verdict (``healthy``, ``failing``, ...) and its history (kind, old, new), oldest first."""
        with sqlite3.connect(self.db, timeout=10) as conn:
            (iid, health), = conn.execute("SELECT id, health FROM fleet_engineinstance WHERE url = ?", (url,)).fetchall()
            events = conn.execute(
                "SELECT kind, old, new FROM fleet_instanceevent WHERE instance_id = ? ORDER BY id", (iid,)
            ).fetchall()
        return health, events

    def metrics(self) -> str:
        """The coordinator's ``/metrics`` text."""
        response = httpx.get(f"{self.base}/metrics", timeout=10)
        response.raise_for_status()
        return response.text

    # -- waiting -------------------------------------------------------------------------------

    def until(self, check: Callable[[], bool], timeout: float, what: str) -> float:
        """Poll ``check`` until true; return the seconds it took.

        Raises ``LauncherExited`` if the launcher ends meanwhile, ``NotInTime`` after ``timeout``;
        both name ``what`` and the launcher's log.
        """
        start = time.monotonic()
        while not check():
            if self.popen.poll() is not None:
                raise LauncherExited(
                    f"the launcher exited with {self.popen.returncode} while waiting for {what}; see {self.launcher_log}"
                )
            if time.monotonic() - start > timeout:
                raise NotInTime(f"{what} not within {timeout:.0f}s; launcher log: {self.launcher_log}")
            time.sleep(POLL_INTERVAL_S)
        return time.monotonic() - start

    def wait_registered(self) -> float:
        """Wait until the launcher recorded every process (it does once all are ready); return the seconds."""
        # The launcher writes the rows only after the supervisor's start() checked each process
        # ready, so "all rows present" means "the whole stack is up".
        return self.until(
            lambda: len(self.processes()) == self.expected_processes(), self.ready_timeout(), "the stack to be up"
        )

    # -- stopping ------------------------------------------------------------------------------

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> Stopped:
        """SIGTERM the launcher (it stops every child), wait, and report which ports are still bound.

        A launcher that does not exit within ``timeout`` gets SIGKILL on its whole group; its code
        is then -9 and the stop is not clean.
        """
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            code = self.popen.wait()
        bound = tuple(p for p in self.ports if not wait_port_free(stack.HOST, p, PORT_FREE_TIMEOUT_S))
        return Stopped(code, bound)

    def copy_logs(self, dest: Path) -> None:
        """Copy the children's logs (``var_dir/log/*.log``) into ``dest``."""
        dest.mkdir(parents=True, exist_ok=True)
        for f in (self.var_dir / "log").glob("*.log"):
            (dest / f.name).write_bytes(f.read_bytes())

    def __enter__(self) -> LaunchedStack:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.popen.poll() is None:
            self.stop()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")


def metric_samples(text: str, name: str) -> dict[str, float]:
    """The samples of metric ``name`` in Prometheus text, keyed by their label text (``process="render"``; ``""`` without)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            out[m.group(2) or ""] = float(m.group(3))
    return out


def greedy_answer(
    client: Any, kind: str, prompt: str, *, stream: bool, max_tokens: int, extra_body: dict[str, Any] | None = None
) -> tuple[str, str | None]:
    """(text, finish reason) of one greedy chat or completion through an ``openai.OpenAI`` client.

    A stream's text is its deltas joined, so a streamed answer compares equal to the same
    request's JSON answer; the fault tests and the soak compare every answer with its twin.
    """
    common: dict[str, Any] = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0.0}
    if extra_body:
        common["extra_body"] = extra_body
    if kind == "chat":
        messages = [{"role": "user", "content": prompt}]
        if not stream:
            r = client.chat.completions.create(messages=messages, **common)
            return r.choices[0].message.content or "", r.choices[0].finish_reason
        text, finish = "", None
        for chunk in client.chat.completions.create(messages=messages, stream=True, **common):
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, finish
    if not stream:
        rc = client.completions.create(prompt=prompt, **common)
        return rc.choices[0].text, rc.choices[0].finish_reason
    text, finish = "", None
    for part in client.completions.create(prompt=prompt, stream=True, **common):
        for c in part.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish
