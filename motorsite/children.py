"""A child under supervision: its states, what is reported about it, and its restart state machine.

``motorsite.supervisor`` owns the ordered list of children, the signals and the stack's
lifecycle; a ``Child`` owns one process across its restarts. ``spawn`` starts it; while
``Supervisor.wait`` runs, a child with a ``RestartPolicy`` goes ``RUNNING -> BACKOFF ->
STARTING -> RUNNING`` each time it exits, or to ``FAILED`` when it crash-loops
(``motorsite.restarts`` decides the back-off and the verdict). Each step the launcher must hear
of returns a ``ChildEvent``, which the supervisor hands to its observer.

Stdlib and httpx only, like the rest of the supervisor.
"""

from __future__ import annotations

import enum
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from typing import Literal

import httpx

from motorsite.processes import (
    ORPHAN_GRACE,
    POLL_INTERVAL_MIN,
    RUN_BANNER,
    ProcessSpec,
    can_bind,
    clear_stale_sockets,
    log_tail,
    probe,
    rotate_log,
    terminate_group,
)
from motorsite.restarts import RestartTracker

# One logger for the whole supervisor (as motorsite.processes): operators filter on one name.
logger = logging.getLogger("motorsite.supervisor")

# Readiness polling starts fast (POLL_INTERVAL_MIN: tests and small sidecars are up in well under a
# second) and backs off to this, so that a vLLM engine loading weights for minutes is not probed 10
# times a second.
POLL_INTERVAL_MAX = 1.0
# One readiness probe of a restarting child runs inside wait()'s loop; this bounds how long it
# can hold up noticing another child's death or a signal.
RESTART_PROBE_TIMEOUT = 5.0


class ChildState(enum.Enum):
    # Spawned (again) by wait(); its readiness check has not passed yet.
    STARTING = 1
    # Passed its readiness check and has not exited since.
    RUNNING = 2
    # Exited; wait() starts it again at `restart_at`.
    BACKOFF = 3
    # Crash-looped: left down for good while the rest of the stack runs on.
    FAILED = 4


@dataclass(frozen=True, slots=True)
class ChildEvent:
    """What `wait()` tells its observer: a child exited, became ready again, or was given up."""

    name: str
    kind: Literal["exited", "ready", "gave_up"]
    pid: int
    restarts: int
    # Why it exited ("killed by SIGKILL", "engine core killed by SIGILL ..."); "" for "ready".
    reason: str = ""
    log_tail: str = ""


@dataclass(frozen=True, slots=True)
class ChildStatus:
    """One child as `Supervisor.status()` reports it (for a launcher's metrics and views)."""

    name: str
    state: ChildState
    pid: int
    restarts: int
    last_exit: str


@dataclass(slots=True)
class Child:
    """One spec's process, replaced on each restart; built by ``spawn``."""

    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    # Where this run's output starts in the (appended) log file, so a tail never shows the
    # previous run's lines.
    log_offset: int
    state: ChildState = ChildState.RUNNING
    tracker: RestartTracker | None = None
    # monotonic times: became ready; next start (BACKOFF); readiness deadline and next probe
    # (STARTING).
    up_since: float | None = None
    restart_at: float = 0.0
    ready_deadline: float = 0.0
    next_probe_at: float = 0.0
    probe_interval: float = POLL_INTERVAL_MIN
    last_error: str = ""
    last_exit: str = ""

    @property
    def restarts(self) -> int:
        return self.tracker.restarts if self.tracker is not None else 0

    def status(self) -> ChildStatus:
        return ChildStatus(self.spec.name, self.state, self.popen.pid, self.restarts, self.last_exit)

    def exited(self, reason: str, tail: str) -> ChildEvent:
        """Clean up after this restartable child exited (or never became ready) and decide when
        it starts again (``exited``), or that it crash-loops (``gave_up``)."""
        name, pid = self.spec.name, self.popen.pid
        # Grandchildren (vLLM's engine core, a Celery pool) may outlive their leader.
        terminate_group(self.spec, self.popen, grace=ORPHAN_GRACE)
        assert self.tracker is not None
        now = time.monotonic()
        delay = self.tracker.record_exit(now, self.up_since)
        self.last_exit = reason
        self.up_since = None
        if delay is None:
            self.state = ChildState.FAILED
            policy = self.tracker.policy
            logger.error(
                "%s %s; crash loop (%d exits within %gs): not restarting it, the rest of the stack"
                " keeps running; last log lines:\n%s",
                name, reason, policy.crash_loop_exits, policy.crash_loop_window_s, tail,
            )
            return ChildEvent(name, "gave_up", pid, self.restarts, reason, tail)
        self.state = ChildState.BACKOFF
        self.restart_at = now + delay
        logger.warning(
            "%s %s; restarting it in %gs (restart %d); last log lines:\n%s",
            name, reason, delay, self.restarts, tail,
        )
        return ChildEvent(name, "exited", pid, self.restarts, reason, tail)

    def rotate_log(self) -> None:
        """Rotate this child's log when it passed its bound (``processes.rotate_log``)."""
        if rotate_log(self.spec.log_path, max_bytes=self.spec.log_max_bytes, backups=self.spec.log_backups):
            # This run's output now continues at the start of the fresh file (log_tail reads
            # the rest from the newest rotated file).
            self.log_offset = 0

    def restart(self) -> ChildEvent | None:
        """Start the process again once its back-off is over; an event only if that failed at once."""
        spec = self.spec
        taken = [(h, p) for h, p in spec.ports if not can_bind(h, p)]
        if taken:
            # Someone else took the port while this child was down: a failed start like any other,
            # so a port that stays taken ends in the crash-loop verdict instead of a silent wait.
            host, port = taken[0]
            return self.exited(f"could not restart: port {host}:{port} is in use", "")
        self.popen, self.log_offset = _launch(spec)
        now = time.monotonic()
        self.state = ChildState.STARTING
        self.ready_deadline = now + spec.ready_timeout
        self.next_probe_at = now
        self.probe_interval = POLL_INTERVAL_MIN
        self.last_error = "not checked yet"
        return None

    def probe_starting(self, client: httpx.Client) -> ChildEvent | None:
        """One readiness probe of a restarted child, when due: ``ready``, ``exited`` (its
        deadline passed) or ``gave_up``; None while it is still starting."""
        now = time.monotonic()
        if now < self.next_probe_at:
            return None
        remaining = self.ready_deadline - now
        if remaining <= 0:
            tail = log_tail(self.spec.log_path, self.log_offset)
            reason = f"not ready {self.spec.ready_timeout:g}s after restart (last check: {self.last_error})"
            return self.exited(reason, tail)
        self.last_error = probe(client, self.spec, min(remaining, RESTART_PROBE_TIMEOUT))
        if self.last_error:
            self.next_probe_at = time.monotonic() + self.probe_interval
            self.probe_interval = min(self.probe_interval * 2, POLL_INTERVAL_MAX)
            return None
        self.state = ChildState.RUNNING
        self.up_since = time.monotonic()
        logger.info("%s ready again (pid %d, restart %d)", self.spec.name, self.popen.pid, self.restarts)
        return ChildEvent(self.spec.name, "ready", self.popen.pid, self.restarts)


def spawn(spec: ProcessSpec) -> Child:
    """Start ``spec``'s argv in its own session, its output appended to its log file."""
    popen, offset = _launch(spec)
    tracker = RestartTracker(spec.restart) if spec.restart is not None else None
    return Child(spec=spec, popen=popen, log_offset=offset, tracker=tracker)


def _launch(spec: ProcessSpec) -> tuple[subprocess.Popen[bytes], int]:
    """Run ``spec``'s argv; return the process and where this run's output starts in its log."""
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    clear_stale_sockets(spec)
    env = dict(os.environ)
    # Python children would otherwise block-buffer stdout into the log file, and the lines
    # printed just before a crash are exactly the ones the log tail must show.
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(spec.env)
    with open(spec.log_path, "ab") as log:
        log.write(RUN_BANNER + f"{spec.name}: {spec.argv}\n".encode())
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
    return popen, offset
