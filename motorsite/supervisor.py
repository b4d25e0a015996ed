"""Start motorsite's processes in order, health-check each, restart what dies, stop them together.

`make run` and the integration tests start the same processes through this module (render
sidecar, token engines, Celery, the coordinator under Daphne); specs marked
``start_with_previous`` (``together``) start as one group, and the next spec waits for all of
it. Django-free on purpose: it runs
before any settings exist, and it must be importable from a plain test subprocess.

Each child runs in its own session, hence its own process group, so that Ctrl-C in a terminal
reaches only the supervisor, and `stop()` can signal a child together with every grandchild it
spawned (``motorsite.processes``). While `wait()` runs, a child whose spec has a
`RestartPolicy` is restarted when it exits, with exponential back-off, and left down alone when
it crash-loops (each child's own state machine, ``motorsite.children``, with the policy of
``motorsite.restarts``); each exit is logged with the reason and the tail of its log, and
reported to the `on_event` observer. The death of a child without a policy (the
coordinator), a port taken at start, or SIGINT/SIGTERM stops the whole stack.

Exceptions:

    SupervisorError
    ├── PortInUse         - a spec's port is taken before start, or still bound after stop
    ├── ChildDied         - a child exited while starting, or one without a restart policy exited
    ├── ReadinessTimeout  - a child did not become ready within its `ready_timeout`
    └── Interrupted       - SIGINT or SIGTERM arrived while `start()` was waiting for readiness

Misuse of the lifecycle (starting twice, waiting before starting) raises `RuntimeError`, as in
httpx.
"""

from __future__ import annotations

import enum
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType
from typing import Any

import httpx

from motorsite.children import (
    POLL_INTERVAL_MAX,
    Child,
    ChildEvent,
    ChildState,
    ChildStatus,
    spawn,
)
from motorsite.processes import (
    POLL_INTERVAL_MIN,
    PORT_RELEASE_TIMEOUT,
    ProcessSpec,
    can_bind,
    describe_exit,
    free_port,
    log_tail,
    probe,
    terminate_group,
    together,
    wait_port_free,
)
from motorsite.restarts import RestartPolicy

__all__ = [
    "ChildDied", "ChildEvent", "ChildState", "ChildStatus", "Interrupted", "PortInUse", "ProcessSpec",
    "ReadinessTimeout", "RestartPolicy", "Supervisor", "SupervisorError", "SupervisorState",
    "check_ports", "free_port", "log_tail", "run", "together", "wait_port_free",
]

logger = logging.getLogger(__name__)

# Cadence of wait()'s liveness check: the worst-case delay between a child's death (or a signal)
# and the restart or shutdown it triggers.
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
        # "exited with code 0 ... engine core killed by SIGILL": the code alone can mislead.
        self.reason = describe_exit(returncode, log_tail)
        super().__init__(f"{name!r} {self.reason}; last log lines:\n{log_tail}")


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

    def __init__(
        self, specs: Sequence[ProcessSpec], *, on_event: Callable[[ChildEvent], None] | None = None
    ) -> None:
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
        # Told of every exit, recovery and give-up while wait() runs (a launcher records them for
        # /metrics and the admin); an observer's own failure is logged and never stops supervision.
        self.on_event = on_event
        self.state = SupervisorState.UNSTARTED
        # Set when wait() ended because a child died, for callers that want more than the code.
        self.died: ChildDied | None = None
        self._children: list[Child] = []
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
        """Check every port, then start each spec in order and wait until it is ready (a spec
        with ``start_with_previous`` is spawned before the previous one is ready, not after).

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
            group: list[tuple[Child, float]] = []
            for n, spec in enumerate(self.specs):
                group.append((spawn(spec), time.monotonic()))
                self._children.append(group[-1][0])
                if n + 1 < len(self.specs) and self.specs[n + 1].start_with_previous:
                    continue  # the next one starts now too; the group is waited for together
                for child, spawned in group:
                    self._wait_ready(child, spawned)
                    child.up_since = time.monotonic()
                    logger.info("%s ready (pid %d)", child.spec.name, child.popen.pid)
                group = []
        except BaseException:
            self.stop(check_ports_free=False)
            raise
        self.state = SupervisorState.RUNNING

    def check_children(self) -> None:
        """Return when every child that must be running still is.

        While starting, that is every child; once running (``add`` waits through this), only
        those without a restart policy: wait() restarts the others. Raises ChildDied for the
        first such child (in start order) that has exited.
        """
        for child in self._children:
            if child.state in (ChildState.BACKOFF, ChildState.FAILED):
                continue
            if self.state is SupervisorState.RUNNING and child.spec.restart is not None:
                continue
            returncode = child.popen.poll()
            if returncode is not None:
                raise ChildDied(
                    child.spec.name, returncode, log_tail(child.spec.log_path, child.log_offset)
                )

    def wait(self, tick: Callable[[], None] | None = None, tick_interval: float = 1.0) -> int:
        """Supervise until SIGINT/SIGTERM or a fatal death, stop everything, return an exit code.

        A child with a restart policy that exits is restarted after its back-off and, while
        starting, probed for readiness without blocking the loop for long; one that crash-loops
        is left down (logged, reported as "gave_up") and the rest keeps running. The exit of a
        child without a policy ends the loop. ``tick`` (if given) runs every ``tick_interval``
        seconds in this loop, so a launcher can react to outside state (e.g. replace a child with
        ``add``/``retire``) on the one thread that owns the children and the signals. Returns 0
        after a signal, 1 when a child without a restart policy died (logged with its log tail,
        kept in `self.died`) or a port stayed bound after stop. Raises RuntimeError unless
        running.
        """
        if self.state is not SupervisorState.RUNNING:
            raise RuntimeError(f"cannot wait on a supervisor in state {self.state.name}")
        self._waiting = True
        next_tick = time.monotonic() + tick_interval
        try:
            # trust_env=False: see _wait_ready.
            with httpx.Client(trust_env=False) as client:
                while self._signal_received is None:
                    try:
                        self.supervise_once(client)
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

    def supervise_once(self, client: httpx.Client) -> None:
        """One pass of wait()'s loop: rotate logs past their bound, notice exits, start children
        whose back-off is over, probe starting ones. Raises ChildDied when a child without a
        restart policy has exited."""
        for child in list(self._children):
            if child.state in (ChildState.STARTING, ChildState.RUNNING):
                # Before the exit check, so a tail read just below sees the rotated files as they are.
                child.rotate_log()
                returncode = child.popen.poll()
                if returncode is not None:
                    tail = log_tail(child.spec.log_path, child.log_offset)
                    if child.spec.restart is None:
                        raise ChildDied(child.spec.name, returncode, tail)
                    self._emit(child.exited(describe_exit(returncode, tail), tail))
                elif child.state is ChildState.STARTING:
                    self._emit(child.probe_starting(client))
            elif child.state is ChildState.BACKOFF and time.monotonic() >= child.restart_at:
                self._emit(child.restart())

    def status(self) -> list[ChildStatus]:
        """Every child in start order: state, current pid, restarts so far, why it last exited."""
        return [c.status() for c in self._children]

    def _emit(self, event: ChildEvent | None) -> None:
        if event is None or self.on_event is None:
            return
        try:
            self.on_event(event)
        except Exception:
            # A database that is down must not stop the restarts it was asked to record.
            logger.exception("observer failed on %s %s", event.name, event.kind)

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
        child = spawn(spec)
        try:
            self._wait_ready(child)
        except BaseException:
            terminate_group(child.spec, child.popen)
            raise
        child.up_since = time.monotonic()
        self._children.append(child)
        logger.info("%s ready (pid %d)", spec.name, child.popen.pid)

    def retire(self, name: str) -> None:
        """Stop the running child ``name`` (its whole process group) and forget it."""
        child = next((c for c in self._children if c.spec.name == name), None)
        if child is None:
            raise ValueError(f"no child named {name!r}")
        terminate_group(child.spec, child.popen)
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
                terminate_group(child.spec, child.popen)
        finally:
            self._restore_signal_handlers()
            self.state = SupervisorState.STOPPED
        if not check_ports_free:
            return
        for child in self._children:
            for host, port in child.spec.ports:
                if not wait_port_free(host, port, PORT_RELEASE_TIMEOUT):
                    raise PortInUse(child.spec.name, host, port, after_stop=True)

    def _wait_ready(self, child: Child, spawned: float | None = None) -> None:
        spec = child.spec
        deadline = (time.monotonic() if spawned is None else spawned) + spec.ready_timeout
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
                # A start may take minutes (real engines): logs keep their bound meanwhile too.
                for started in [*self._children, *([] if any(c is child for c in self._children) else [child])]:
                    started.rotate_log()
                # The child waited for, too: a replacement (``add``) is not among the children
                # yet, and one that exits at once must fail now, not after its ready timeout.
                returncode = child.popen.poll()
                if returncode is not None:
                    raise ChildDied(spec.name, returncode, log_tail(spec.log_path, child.log_offset))
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
                    last_error = probe(client, spec, remaining)
                    if not last_error:
                        return
                    logger.debug("%s not ready: %s", spec.name, last_error)
                    time.sleep(min(interval, max(deadline - time.monotonic(), 0)))
                finally:
                    self._interruptible = False
                interval = min(interval * 2, POLL_INTERVAL_MAX)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.state is SupervisorState.STOPPED:
            # Left installed by a supervisor started inside this one and stopped after it (an
            # early rig of the tests): act as what this one replaced, or Ctrl-C would be lost.
            previous = self._previous_handlers.get(signum)
            if callable(previous):  # Python's own SIGINT handler raises KeyboardInterrupt
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
            return
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
            if not can_bind(host, port):
                raise PortInUse(spec.name, host, port)


