"""One child process of the stack: its spec, readiness probe, exit story, and its process group.

Stdlib and httpx only (see ``motorsite.supervisor``, which owns the lifecycle). Each child runs in
its own session, hence its own process group: ``terminate_group`` signals the child together with
every grandchild it spawned (a shell wrapper, vLLM's engine-core process, Celery's pool).

Why a child died is told from its returncode and the tail of its log (``describe_exit``): vLLM's
API server exits normally when its engine core dies, so the code alone would say "code 0" for an
engine whose core took SIGILL. The engine site (``motorsite/engine_site``) makes the engine
processes say what happened in the log: ``faulthandler``'s "Fatal Python error: ..." for a fatal
signal, and one ``motorsite: subprocess NAME (pid N) killed by SIGNAL`` line when a
multiprocessing child ends badly.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import re
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from motorsite import unix_http
from motorsite.restarts import RestartPolicy

logger = logging.getLogger("motorsite.supervisor")

LOG_TAIL_LINES = 40
# A child's log is rotated once it passes this many bytes, keeping this many older files
# (``<log>.1`` the newest): at most about (backups + 1) x max bytes per child, however long it
# runs and however much it prints (a vLLM engine's access log alone is a line per request).
# make run takes both from MOTOR_LOG_MAX_BYTES and MOTOR_LOG_BACKUPS (motorsite/settings.py).
LOG_MAX_BYTES = 32 * 1024 * 1024
LOG_BACKUPS = 3
# The line a child's log gets before each run's own output (children.spawn writes it).
RUN_BANNER = b"--- supervisor: starting "
# How long stop() waits for the kernel to release a dead child's listening sockets before it
# reports the port as leaked; closing happens at process exit, so this only covers exit latency.
PORT_RELEASE_TIMEOUT = 5.0
# After SIGKILL a process cannot refuse to die; this only bounds a process stuck in the kernel
# (uninterruptible I/O) so that stop() always returns.
KILL_TIMEOUT = 5.0
POLL_INTERVAL_MIN = 0.05
# What is left of a child whose leader already died (vLLM's engine core after its API server was
# SIGKILLed waits on a parent that is gone and ignores SIGTERM for seconds) gets this long before
# SIGKILL: the cleanup runs in the supervisor's one loop and holds up every other restart.
ORPHAN_GRACE = 1.0

@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """How to run one child process and how to know it is ready.

    Exactly one readiness check is set: `ready_url` (GET answers 2xx), `ready_post` (POST of
    `(path, json_body)` against `ready_base_url` answers 2xx) or `ready_argv` (a command exits 0,
    for processes without an HTTP port such as a Celery worker).

    Raises ValueError when the readiness fields do not describe exactly one check.
    """

    name: str
    argv: list[str]
    log_path: Path
    # Added on top of os.environ; the child inherits everything else.
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    # Every (host, port) the process will bind, checked before anything starts and after stop.
    ports: list[tuple[str, int]] = field(default_factory=list)
    # Every unix socket the process binds (a render sidecar with ``--uds``): a file a dead run
    # left is removed before each start, since bind() refuses an existing path.
    unix_sockets: list[str] = field(default_factory=list)
    ready_url: str | None = None
    # A real request, not /health: vLLM answers /health before its model has ever run.
    ready_post: tuple[str, dict[str, Any]] | None = None
    ready_base_url: str | None = None
    ready_argv: list[str] | None = None
    ready_timeout: float = 60.0
    stop_timeout: float = 10.0
    # None: this child's exit stops the whole stack (the coordinator). Otherwise the supervisor
    # restarts it with back-off and leaves it down alone when it crash-loops.
    restart: RestartPolicy | None = None
    # Spawned right after the previous spec instead of once that one is ready: processes that do
    # not need each other (the render sidecar and the engines) start in one go, and the next spec
    # without the flag waits for the whole group. Each one's ready_timeout counts from its spawn.
    start_with_previous: bool = False
    # Rotation of ``log_path`` (``rotate_log``); 0 bytes: never rotated.
    log_max_bytes: int = LOG_MAX_BYTES
    log_backups: int = LOG_BACKUPS

    def __post_init__(self) -> None:
        checks = [self.ready_url, self.ready_post, self.ready_argv]
        if sum(check is not None for check in checks) != 1:
            raise ValueError(
                f"{self.name!r}: set exactly one of ready_url, ready_post, ready_argv"
            )
        if self.ready_post is not None and self.ready_base_url is None:
            raise ValueError(f"{self.name!r}: ready_post needs ready_base_url")
        if not self.argv:
            raise ValueError(f"{self.name!r}: argv is empty")


def together(specs: Sequence[ProcessSpec]) -> list[ProcessSpec]:
    """``specs`` as one start group: each after the first starts with the previous one."""
    return [replace(spec, start_with_previous=True) if n else spec for n, spec in enumerate(specs)]


def free_port(host: str = "127.0.0.1") -> int:
    """Return a port that was free on `host` a moment ago (for tests; another process may race).

    With ``MOTOR_PORT_LEDGER`` set, a port this run has not handed out before, from outside the
    kernel's ephemeral range (``_ledger_port``); otherwise whatever the kernel picks.
    """
    ledger = os.environ.get(PORT_LEDGER_ENV)
    if ledger:
        return _ledger_port(host, Path(ledger))
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


# The file through which every process of a test run (``python3 -m toolchain test``'s two pytest
# sessions, their children) hands out ports: one per line, each at most once per run. A port
# picked here is bound by its process only later (a vLLM engine binds 20-50 s after its spawn);
# the kernel's own picks (``bind(("127.0.0.1", 0))``, an outgoing connection's local port) come
# from the ephemeral range, so the ledger's ports never do: neither a test's listener in the
# other session nor a connection can take one meanwhile, and no other ``free_port`` of the run
# is given it again.
PORT_LEDGER_ENV = "MOTOR_PORT_LEDGER"
# Below: the fixed ports of ``make run`` (8000-9221) and services. Above: room for a port derived
# by adding 1000 (a P/D engine's NIXL side channel when none is given: ``stack.pd_engine_specs``).
LEDGER_PORTS = (10000, 64535)


def _ledger_port(host: str, ledger: Path) -> int:
    low, high = _ephemeral_range()
    ports = [p for p in range(LEDGER_PORTS[0], LEDGER_PORTS[1] + 1) if not low <= p <= high]
    start = random.randrange(len(ports))  # two runs with ledgers of their own rarely meet
    with open(ledger, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        given = {int(line) for line in f.read().split()}
        for port in ports[start:] + ports[:start]:
            if port not in given and _bindable(host, port):
                f.write(f"{port}\n")
                return port
    raise RuntimeError(f"no port left outside the ephemeral range {low}-{high} ({len(given)} handed out by {ledger})")


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (Linux's default when unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    # Without SO_REUSEADDR, unlike can_bind: a port with connections in TIME_WAIT is passed over,
    # since not every server the tests start sets it.
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def wait_port_free(host: str, port: int, timeout: float) -> bool:
    """Poll until `port` on `host` can be bound; return whether it became free within `timeout`."""
    deadline = time.monotonic() + timeout
    while not can_bind(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_INTERVAL_MIN)
    return True


def log_tail(path: Path, offset: int = 0, lines: int = LOG_TAIL_LINES) -> str:
    """Return the last `lines` lines of `path` written after byte `offset` ("" if unreadable).

    Offset 0 means the run's output began before the log was last rotated (a run's own output
    always follows its banner line, so it never starts at 0 otherwise): lines missing from the
    fresh file are taken from the end of ``<log>.1``, back to that run's banner.
    """
    try:
        data = _read_end(path, offset)
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    found = data.decode("utf-8", errors="replace").splitlines()
    if offset == 0 and len(found) < lines:
        try:
            earlier = _read_end(rotated(path, 1), 0)
        except OSError:
            earlier = b""
        banner = earlier.rfind(RUN_BANNER)
        if banner >= 0:
            earlier = earlier[earlier.find(b"\n", banner) + 1:] if b"\n" in earlier[banner:] else b""
        found = earlier.decode("utf-8", errors="replace").splitlines() + found
    return "\n".join(found[-lines:])


def _read_end(path: Path, offset: int) -> bytes:
    with open(path, "rb") as log:
        size = log.seek(0, os.SEEK_END)
        # 64 KiB holds 40 lines of any sane log; reading only the end keeps a gigabyte
        # vLLM log from being loaded to print 40 lines.
        log.seek(max(offset, size - 65536))
        return log.read()


def rotated(path: Path, n: int) -> Path:
    """The ``n``-th older file of ``path`` (``engine-1.log.1`` the newest)."""
    return path.with_name(f"{path.name}.{n}")


def rotate_log(path: Path, *, max_bytes: int, backups: int) -> bool:
    """Rotate ``path`` if it passed ``max_bytes``; return whether it did.

    Copy and truncate, as logrotate's ``copytruncate``: the child keeps writing to the file it
    was given (opened for appending, so its next write lands at the new end, 0); renaming the
    file would leave it writing to the renamed one forever. Lines the child writes between the
    copy and the truncation are lost (a few milliseconds), which a log can afford.
    """
    if max_bytes <= 0:
        return False
    try:
        if path.stat().st_size <= max_bytes:
            return False
        if backups > 0:
            for n in range(backups - 1, 0, -1):
                if rotated(path, n).exists():
                    os.replace(rotated(path, n), rotated(path, n + 1))
            with open(path, "rb") as src, open(rotated(path, 1), "wb") as dst:
                while chunk := src.read(1024 * 1024):
                    dst.write(chunk)
        os.truncate(path, 0)
    except OSError as exc:
        # A full disk must not stop supervision; the next pass tries again.
        logger.warning("could not rotate %s: %s", path, exc)
        return False
    return True


def probe(client: httpx.Client, spec: ProcessSpec, remaining: float) -> str:
    """Run the spec's readiness check once; return "" when ready, else why not."""
    if spec.ready_argv is not None:
        try:
            result = subprocess.run(
                spec.ready_argv,
                cwd=spec.cwd,
                env={**os.environ, **spec.env},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=remaining,
            )
        except subprocess.TimeoutExpired:
            return f"{spec.ready_argv} timed out"
        if result.returncode == 0:
            return ""
        output = (result.stdout + result.stderr).decode(errors="replace").strip()
        return f"{spec.ready_argv} exited with {result.returncode}: {output[-200:]}"
    # Connect fails fast while the child has not bound yet; the read may legitimately take long
    # (a first real completion), so it may use the whole remaining readiness budget.
    timeout = httpx.Timeout(remaining, connect=min(remaining, 2.0))
    try:
        if spec.ready_post is not None:
            assert spec.ready_base_url is not None
            path, body = spec.ready_post
            url = spec.ready_base_url.rstrip("/") + path
            with unix_http.reach(client, spec.ready_base_url) as (c, base):  # http+unix:// too
                response = c.post(base + path, json=body, timeout=timeout)
        else:
            assert spec.ready_url is not None
            url = spec.ready_url
            response = client.get(url, timeout=timeout)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.is_success:
        return ""
    return f"{response.status_code} from {url}: {response.text[:200]}"


def clear_stale_sockets(spec: ProcessSpec) -> None:
    """Remove each of ``spec.unix_sockets`` that no server answers on (a dead run's file), so the
    start can bind it; one a live server answers on is left, and the start fails on it visibly."""
    for path in spec.unix_sockets:
        if os.path.exists(path) and not unix_http.socket_answers(path):
            os.unlink(path)


def terminate_group(spec: ProcessSpec, popen: subprocess.Popen[bytes], *, grace: float | None = None) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``grace`` (default: stop_timeout); reap.

    Also right after the leader died on its own: its grandchildren (vLLM's engine core, say)
    may live on, holding memory and ports the replacement needs.
    """
    pgid = popen.pid
    grace = spec.stop_timeout if grace is None else grace
    # The group is signalled even when the leader already died: its grandchildren may live on.
    _signal_group(pgid, signal.SIGTERM)
    if _wait_group_gone(popen, grace):
        logger.info("stopped %s", spec.name)
        return
    logger.warning("%s did not stop within %gs; sending SIGKILL", spec.name, grace)
    _signal_group(pgid, signal.SIGKILL)
    if not _wait_group_gone(popen, KILL_TIMEOUT):
        logger.error(
            "%s: processes %s survived SIGKILL", spec.name, _live_group_members(pgid)
        )


def _wait_group_gone(popen: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        # Reap the leader first: an unreaped leader is a zombie that still counts as a member.
        popen.poll()
        if popen.returncode is not None and not _live_group_members(popen.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_INTERVAL_MIN)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass  # The whole group is already gone.


def _live_group_members(pgid: int) -> list[int]:
    """Return the pids of non-zombie processes in process group `pgid`."""
    proc = Path("/proc")
    if not proc.is_dir():
        # Without /proc (macOS) fall back to the kernel's view, which counts zombies too.
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    # Scan /proc instead of killpg(pgid, 0): orphaned grandchildren are re-parented to PID 1,
    # and a container's PID 1 often never reaps them, so their zombies would keep the group
    # "alive" forever although they hold no port and run no code.
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # Exited between listing and reading.
        # Fields after the parenthesised command name (which may contain spaces or parens):
        # state, ppid, pgrp, ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def can_bind(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR as every server sets it: otherwise TIME_WAIT connections left by our own
        # readiness probes would make a free port look taken for a minute after stop.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def describe_returncode(returncode: int) -> str:
    """``"code 1"`` or ``"signal SIGKILL"`` for a Popen returncode."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"


# faulthandler's first line for each fatal signal it handles (CPython's faulthandler.c).
_FATAL_ERRORS = {
    "Illegal instruction": "SIGILL",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Aborted": "SIGABRT",
}
_FATAL_RE = re.compile(r"Fatal Python error: (" + "|".join(map(re.escape, _FATAL_ERRORS)) + ")")
# Written by the engine site when a multiprocessing child of the engine ends badly.
_SUBPROCESS_RE = re.compile(
    r"motorsite: subprocess (?P<name>\S+) \(pid \d+\) (?P<fate>killed by SIG[A-Z0-9]+|exited with code -?\d+)"
)


def describe_exit(returncode: int, tail: str) -> str:
    """Say how a child ended, from its returncode and the log lines it wrote in this run.

    The process's own returncode comes first; a subprocess's fate found in the log (the last
    one reported) is added, worded for vLLM's engine core when that is what died.
    """
    told = describe_returncode(returncode)
    fates = list(_SUBPROCESS_RE.finditer(tail))
    if fates:
        last = fates[-1]
        name, fate = last["name"], last["fate"]
        who = "engine core" if name.startswith("EngineCore") else f"subprocess {name}"
        return f"{who} {fate} (then the process exited with {told})"
    fatal = list(_FATAL_RE.finditer(tail))
    if fatal:
        signame = _FATAL_ERRORS[fatal[-1][1]]
        if returncode == -getattr(signal, signame):
            return f"killed by {signame}"
        return f"a process of its group was killed by {signame} (then the process exited with {told})"
    return f"exited with {told}" if returncode >= 0 else f"killed by {told[len('signal '):]}"
