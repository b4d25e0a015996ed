"""Start motorsite's processes in order, health-check each, and stop them all together.

`make run` and the integration tests start the same processes through this module (render
sidecar, token engines, Celery, the coordinator under Daphne). Django-free on purpose: it runs
before any settings exist, and it must be importable from a plain test subprocess.

Each child runs in its own session, hence its own process group, so that Ctrl-C in a terminal
reaches only the supervisor, and `stop()` can signal a child together with every grandchild it
spawned (a shell wrapper, vLLM's engine-core process, Celery's pool). A child that dies is
reported with the tail of its log and is never restarted.

Exceptions:

    SupervisorError
    ├── PortInUse         - a spec's port is taken before start, or still bound after stop
    ├── ChildDied         - a child exited while starting or running
    ├── ReadinessTimeout  - a child did not become ready within its `ready_timeout`
    └── Interrupted       - SIGINT or SIGTERM arrived while `start()` was waiting for readiness

Misuse of the lifecycle (starting twice, waiting before starting) raises `RuntimeError`, as in
httpx.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import httpx

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
# How long stop() waits for the kernel to release a dead child's listening sockets before it
# reports the port as leaked; closing happens at process exit, so this only covers exit latency.
PORT_RELEASE_TIMEOUT = 5.0
# After SIGKILL a process cannot refuse to die; this only bounds a process stuck in the kernel
# (uninterruptible I/O) so that stop() always returns.
KILL_TIMEOUT = 5.0
# Readiness polling starts fast (tests and small sidecars are up in well under a second) and
# backs off so that a vLLM engine loading weights for minutes is not probed 10 times a second.
POLL_INTERVAL_MIN = 0.05
POLL_INTERVAL_MAX = 1.0
# Cadence of wait()'s liveness check: the worst-case delay between a child's death (or a signal)
# and the shutdown it triggers.
WAIT_POLL_INTERVAL = 0.1


class SupervisorError(Exception):
    """Base class of every error this module raises on purpose."""


class PortInUse(SupervisorError):
    """A port a process needs is bound by someone else."""

    def __init__(self, name: str, host: str, port: int, *, after_stop: bool = False) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.after_stop = after_stop
        if after_stop:
            message = f"port {host}:{port} of {name!r} is still bound after stop"
        else:
            message = f"port {host}:{port} needed by {name!r} is already in use"
        super().__init__(message)


class ChildDied(SupervisorError):
    """A child process exited while the supervisor expected it to run."""

    def __init__(self, name: str, returncode: int, log_tail: str) -> None:
        self.name = name
        self.returncode = returncode
        self.log_tail = log_tail
        super().__init__(
            f"{name!r} exited with {_describe_returncode(returncode)}; last log lines:\n{log_tail}"
        )


class ReadinessTimeout(SupervisorError):
    """A child kept running but never passed its readiness check."""

    def __init__(self, name: str, timeout: float, last_error: str, log_tail: str) -> None:
        self.name = name
        self.timeout = timeout
        self.last_error = last_error
        self.log_tail = log_tail
        super().__init__(
            f"{name!r} not ready after {timeout:g}s (last check: {last_error}); "
            f"last log lines:\n{log_tail}"
        )


class Interrupted(SupervisorError):
    """SIGINT or SIGTERM arrived while start() was bringing processes up."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name} during start")


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
    ready_url: str | None = None
    # A real request, not /health: vLLM answers /health before its model has ever run.
    ready_post: tuple[str, dict[str, Any]] | None = None
    ready_base_url: str | None = None
    ready_argv: list[str] | None = None
    ready_timeout: float = 60.0
    stop_timeout: float = 10.0

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


class SupervisorState(enum.Enum):
    # Constructed; nothing has been spawned and no signal handler is installed.
    UNSTARTED = 1
    # start() is spawning children and waiting for each one's readiness.
    STARTING = 2
    # Every child passed its readiness check; wait() or the caller's code runs.
    RUNNING = 3
    # stop() is terminating process groups; signals are recorded, never acted on twice.
    STOPPING = 4
    # Every child is gone and the signal handlers are restored; terminal state.
    STOPPED = 5


@dataclass(slots=True)
class _Child:
    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    # Where this run's output starts in the (appended) log file, so a tail never shows the
    # previous run's lines.
    log_offset: int


class Supervisor:
    """Owns a fixed, ordered list of child processes from start to stop.

    Usage: `with Supervisor(specs) as sup: ...` (enter starts, exit stops), or `run(specs)`
    for a foreground launcher. From start() until stop() returns, SIGINT and SIGTERM (in the
    main thread) lead to an orderly stop instead of orphaning the children: during start() they
    raise Interrupted, during wait() they make it stop and return 0. In the caller's own code
    between the two, SIGINT still raises KeyboardInterrupt (so `with` stops the children) and
    SIGTERM is remembered, making the next wait() return at once.

    Raises ValueError when two specs share a name or a port.
    """

    def __init__(self, specs: Sequence[ProcessSpec]) -> None:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate process names in {names}")
        owners: dict[int, str] = {}
        for spec in specs:
            for _host, port in spec.ports:
                if port in owners:
                    raise ValueError(f"port {port} claimed by {owners[port]!r} and {spec.name!r}")
                owners[port] = spec.name
        self.specs = list(specs)
        self.state = SupervisorState.UNSTARTED
        # Set when wait() ended because a child died, for callers that want more than the code.
        self.died: ChildDied | None = None
        self._children: list[_Child] = []
        self._signal_received: int | None = None
        # True only around readiness probes and sleeps in start(): the one place where the signal
        # handler may raise, so an interrupt never lands inside Popen() or in stop()'s cleanup.
        self._interruptible = False
        self._waiting = False
        self._previous_handlers: dict[int, Any] = {}

    @property
    def pids(self) -> dict[str, int]:
        """Map each started child's name to its pid (which is also its process group id)."""
        return {child.spec.name: child.popen.pid for child in self._children}

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Check every port, then start each spec in order and wait until it is ready.

        On any failure every child started so far is stopped before the error propagates.
        Raises PortInUse before spawning anything, ChildDied, ReadinessTimeout, Interrupted,
        OSError when an argv cannot be executed, and RuntimeError when already started.
        """
        if self.state is not SupervisorState.UNSTARTED:
            raise RuntimeError(f"cannot start a supervisor in state {self.state.name}")
        self.state = SupervisorState.STARTING
        self._install_signal_handlers()
        try:
            check_ports(self.specs)
            for spec in self.specs:
                child = self._spawn(spec)
                self._children.append(child)
                self._wait_ready(child)
                logger.info("%s ready (pid %d)", spec.name, child.popen.pid)
        except BaseException:
            self.stop(check_ports_free=False)
            raise
        self.state = SupervisorState.RUNNING

    def check_children(self) -> None:
        """Return when every started child is still running.

        Raises ChildDied for the first child (in start order) that has exited.
        """
        for child in self._children:
            returncode = child.popen.poll()
            if returncode is not None:
                raise ChildDied(
                    child.spec.name, returncode, log_tail(child.spec.log_path, child.log_offset)
                )

    def wait(self, tick: Callable[[], None] | None = None, tick_interval: float = 1.0) -> int:
        """Block until SIGINT/SIGTERM or a child's death, stop everything and return an exit code.

        ``tick`` (if given) runs every ``tick_interval`` seconds in this loop, so a launcher can
        react to outside state (e.g. replace a child with ``add``/``retire``) on the one thread
        that owns the children and the signals. Returns 0 after a signal, 1 when a child died
        (logged with its log tail, kept in `self.died`) or a port stayed bound after stop.
        Raises RuntimeError unless running.
        """
        if self.state is not SupervisorState.RUNNING:
            raise RuntimeError(f"cannot wait on a supervisor in state {self.state.name}")
        self._waiting = True
        next_tick = time.monotonic() + tick_interval
        try:
            while self._signal_received is None:
                try:
                    self.check_children()
                except ChildDied as exc:
                    self.died = exc
                    break
                if tick is not None and time.monotonic() >= next_tick:
                    try:
                        tick()
                    except Interrupted:
                        break  # a signal while tick() waited for a new child: stop as after any
                    next_tick = time.monotonic() + tick_interval
                time.sleep(WAIT_POLL_INTERVAL)
        finally:
            self._waiting = False
        if self.died is not None:
            logger.error("%s", self.died)
        else:
            assert self._signal_received is not None
            logger.info("received %s; stopping", signal.Signals(self._signal_received).name)
        try:
            self.stop()
        except PortInUse as exc:
            logger.error("%s", exc)
            return 1
        return 1 if self.died is not None else 0

    def add(self, spec: ProcessSpec) -> None:
        """Start one more child while running (a replacement, say) and wait until it is ready.

        On failure the new child is stopped and the error propagates (ChildDied,
        ReadinessTimeout, PortInUse, Interrupted); the running children are untouched.
        Raises ValueError when the name or a port is taken by a running child.
        """
        if self.state is not SupervisorState.RUNNING:
            raise RuntimeError(f"cannot add a child to a supervisor in state {self.state.name}")
        if any(c.spec.name == spec.name for c in self._children):
            raise ValueError(f"a child named {spec.name!r} is running")
        ports = {port: c.spec.name for c in self._children for _host, port in c.spec.ports}
        for _host, port in spec.ports:
            if port in ports:
                raise ValueError(f"port {port} claimed by {ports[port]!r} and {spec.name!r}")
        check_ports([spec])
        child = self._spawn(spec)
        try:
            self._wait_ready(child)
        except BaseException:
            _terminate(child)
            raise
        self._children.append(child)
        logger.info("%s ready (pid %d)", spec.name, child.popen.pid)

    def retire(self, name: str) -> None:
        """Stop the running child ``name`` (its whole process group) and forget it."""
        child = next((c for c in self._children if c.spec.name == name), None)
        if child is None:
            raise ValueError(f"no child named {name!r}")
        _terminate(child)
        self._children.remove(child)

    def stop(self, *, check_ports_free: bool = True) -> None:
        """Terminate every child's process group in reverse start order; idempotent.

        Each group gets SIGTERM, then SIGKILL after the spec's stop_timeout. Afterwards no
        process of any group is left. Raises PortInUse (after all cleanup) when a spec's port is
        still bound once its processes are gone, unless check_ports_free is false.
        """
        if self.state in (SupervisorState.STOPPING, SupervisorState.STOPPED):
            return
        self.state = SupervisorState.STOPPING
        try:
            for child in reversed(self._children):
                _terminate(child)
        finally:
            self._restore_signal_handlers()
            self.state = SupervisorState.STOPPED
        if not check_ports_free:
            return
        for child in self._children:
            for host, port in child.spec.ports:
                if not wait_port_free(host, port, PORT_RELEASE_TIMEOUT):
                    raise PortInUse(child.spec.name, host, port, after_stop=True)

    def _spawn(self, spec: ProcessSpec) -> _Child:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        # Python children would otherwise block-buffer stdout into the log file, and the lines
        # printed just before a crash are exactly the ones the log tail must show.
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(spec.env)
        with open(spec.log_path, "ab") as log:
            log.write(f"--- supervisor: starting {spec.name}: {spec.argv}\n".encode())
            log.flush()
            offset = log.tell()
            popen = subprocess.Popen(
                spec.argv,
                env=env,
                cwd=spec.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Own session and process group: the terminal's Ctrl-C reaches only us, and
                # killpg() reaches the child's grandchildren too.
                start_new_session=True,
            )
        logger.info("started %s (pid %d): %s", spec.name, popen.pid, spec.argv)
        return _Child(spec=spec, popen=popen, log_offset=offset)

    def _wait_ready(self, child: _Child) -> None:
        spec = child.spec
        deadline = time.monotonic() + spec.ready_timeout
        interval = POLL_INTERVAL_MIN
        last_error = "not checked yet"
        # trust_env=False: an HTTP(S)_PROXY in the environment must not route a probe of
        # 127.0.0.1 through a proxy that would answer on the child's behalf.
        with httpx.Client(trust_env=False) as client:
            while True:
                if self._signal_received is not None:
                    raise Interrupted(self._signal_received)
                # Checked before every probe, for every child started so far: an engine that
                # crashes while the coordinator starts must fail the start, not be found later.
                self.check_children()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ReadinessTimeout(
                        spec.name,
                        spec.ready_timeout,
                        last_error,
                        log_tail(spec.log_path, child.log_offset),
                    )
                self._interruptible = True
                try:
                    last_error = _probe(client, spec, remaining)
                    if not last_error:
                        return
                    logger.debug("%s not ready: %s", spec.name, last_error)
                    time.sleep(min(interval, max(deadline - time.monotonic(), 0)))
                finally:
                    self._interruptible = False
                interval = min(interval * 2, POLL_INTERVAL_MAX)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Keep the first signal: a second Ctrl-C while stopping must not abort the cleanup that
        # guarantees no orphan, and stop() is bounded by stop_timeout + KILL_TIMEOUT anyway.
        if self._signal_received is None:
            self._signal_received = signum
        if self._interruptible:
            raise Interrupted(signum)
        if (
            signum == signal.SIGINT
            and self.state is SupervisorState.RUNNING
            and not self._waiting
        ):
            # The caller's own code runs (e.g. a test using the supervisor as a fixture):
            # keep Ctrl-C meaning KeyboardInterrupt there, and let `with` stop the children.
            raise KeyboardInterrupt

    def _install_signal_handlers(self) -> None:
        # signal.signal() only works in the main thread; elsewhere the embedding code owns
        # signals and wait() returns only when a child dies.
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()


def run(specs: Sequence[ProcessSpec]) -> int:
    """Start `specs`, block until a signal or a child's death, stop everything.

    Returns the process exit code: 0 after SIGINT/SIGTERM (also during start), 1 when a port
    is taken, a child died or did not become ready (each logged with the reason).
    """
    supervisor = Supervisor(specs)
    try:
        supervisor.start()
        return supervisor.wait()
    except (Interrupted, KeyboardInterrupt):
        return 0
    except SupervisorError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        supervisor.stop(check_ports_free=False)


def check_ports(specs: Sequence[ProcessSpec]) -> None:
    """Try to bind every port every spec will bind, before anything starts.

    Without this, a stale process on a port would answer the readiness check in place of the
    new child, and the supervisor would report a process ready that is about to die.
    Raises PortInUse naming the first taken port and the process that needs it.
    """
    for spec in specs:
        for host, port in spec.ports:
            if not _can_bind(host, port):
                raise PortInUse(spec.name, host, port)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a port that was free on `host` a moment ago (for tests; another process may race)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def wait_port_free(host: str, port: int, timeout: float) -> bool:
    """Poll until `port` on `host` can be bound; return whether it became free within `timeout`."""
    deadline = time.monotonic() + timeout
    while not _can_bind(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_INTERVAL_MIN)
    return True


def log_tail(path: Path, offset: int = 0, lines: int = LOG_TAIL_LINES) -> str:
    """Return the last `lines` lines of `path` written after byte `offset` ("" if unreadable)."""
    try:
        with open(path, "rb") as log:
            size = log.seek(0, os.SEEK_END)
            # 64 KiB holds 40 lines of any sane log; reading only the end keeps a gigabyte
            # vLLM log from being loaded to print 40 lines.
            log.seek(max(offset, size - 65536))
            data = log.read()
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])


def _probe(client: httpx.Client, spec: ProcessSpec, remaining: float) -> str:
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
            response = client.post(url, json=body, timeout=timeout)
        else:
            assert spec.ready_url is not None
            url = spec.ready_url
            response = client.get(url, timeout=timeout)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.is_success:
        return ""
    return f"{response.status_code} from {url}: {response.text[:200]}"


def _terminate(child: _Child) -> None:
    """SIGTERM the child's process group, SIGKILL it after stop_timeout; reap the child."""
    spec, pgid = child.spec, child.popen.pid
    # The group is signalled even when the leader already died: its grandchildren may live on.
    _signal_group(pgid, signal.SIGTERM)
    if _wait_group_gone(child, spec.stop_timeout):
        logger.info("stopped %s", spec.name)
        return
    logger.warning("%s did not stop within %gs; sending SIGKILL", spec.name, spec.stop_timeout)
    _signal_group(pgid, signal.SIGKILL)
    if not _wait_group_gone(child, KILL_TIMEOUT):
        logger.error(
            "%s: processes %s survived SIGKILL", spec.name, _live_group_members(pgid)
        )


def _wait_group_gone(child: _Child, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        # Reap the leader first: an unreaped leader is a zombie that still counts as a member.
        child.popen.poll()
        if child.popen.returncode is not None and not _live_group_members(child.popen.pid):
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


def _can_bind(host: str, port: int) -> bool:
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


def _describe_returncode(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"
