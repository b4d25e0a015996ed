"""``python3 -m toolchain test``: the whole suite as two pytest sessions at once, one per core.

``make test`` in one pytest process keeps about one core of two busy (docs/testing.md). Its
two halves need different things: ``tests/integration`` waits on real vLLM processes, each
begun in the background while earlier tests run (``tests/integration/early.py``), and shares
each set of them ("rig") between modules through session-scoped fixtures; the rest is plain
CPU. So one session runs ``tests/integration`` and another the rest, side by side, each with
its own part of the machine's work; every rig still starts once.

Why not pytest-xdist (besides being a dependency the suite does not have): its workers split the
items between them, so a session-scoped rig would start once per worker that runs one of its
users (each real vLLM start is 20-50 s of a core), and ``early.py`` plans which rig to begin
next from the order of the whole session's items, which no worker sees.

What the two sessions could share by a fixed name is kept apart as ``tests/sessions.py`` says:
each is named in ``MOTOR_TEST_SESSION``, and both hand out ports through one ledger file
(``MOTOR_PORT_LEDGER``, ``motorsite.processes.free_port``), made here for the run.

Each line a session prints is shown as it comes, after the session's name; at the end each
session's summary is printed again, with its short test summary when it failed. The exit status
is 0 only when both passed. SIGINT or SIGTERM is handed to both sessions as one SIGINT (pytest's
Ctrl-C: fixtures tear down, which stops their processes); after ``STOP_GRACE_S``, or at a second
signal, they are killed. This process is the subreaper of everything the sessions start, so
whatever outlives its session (a vLLM engine whose test process was killed) becomes its child
and is stopped before it exits (``_stop_left_behind``).
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parent.parent
SESSION_ENV = "MOTOR_TEST_SESSION"  # tests/sessions.py
PORT_LEDGER_ENV = "MOTOR_PORT_LEDGER"  # motorsite/processes.py
# The two sessions of ``make test``: (name, pytest's arguments). Together they collect exactly
# what ``pytest`` with no arguments collects (``testpaths = tests``).
SESSIONS = (
    ("integration", ["tests/integration"]),
    ("rest", ["tests", "--ignore=tests/integration"]),
)
# After the signal, how long the sessions get to tear their fixtures down (each supervisor gives a
# child 10 s after SIGTERM, then kills it) before they are killed.
STOP_GRACE_S = 120.0
# How long what a session left behind gets between SIGTERM and SIGKILL.
LEFT_BEHIND_GRACE_S = 10.0
PR_SET_CHILD_SUBREAPER = 36
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# pytest's last line: "==== 3 passed, 1 failed in 12.34s (0:00:12) ====".
FINAL_LINE = re.compile(r"^=+ .* in [0-9.]+s.* =+$")


@dataclass
class Session:
    name: str
    proc: subprocess.Popen[bytes]
    started: float
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0
    cpu: float = 0.0  # user and system, its children included (what it left running excepted)

    def summary(self) -> str:
        """pytest's final line ("N passed in T s"), or the last thing the session printed."""
        plain = [ANSI.sub("", line).rstrip() for line in self.lines]
        final = [line.strip("= ") for line in plain if FINAL_LINE.match(line)]
        return final[-1] if final else next((line for line in reversed(plain) if line), "(no output)")

    def short_summary(self) -> list[str]:
        """pytest's "short test summary info" block (the failures, one line each), if it printed one."""
        plain = [ANSI.sub("", line).rstrip() for line in self.lines]
        starts = [n for n, line in enumerate(plain) if "short test summary info" in line]
        return [line for line in plain[starts[-1] + 1:] if not FINAL_LINE.match(line)] if starts else []


def run_sessions(commands: list[tuple[str, list[str]]], env: dict[str, str], *, out: TextIO = sys.stdout,
                 grace: float = STOP_GRACE_S) -> int:
    """Run each ``(name, argv)`` at once with ``env``, relaying their output; 0 if all exit 0,
    else the first non-zero status. Leaves nothing running behind it."""
    _become_subreaper()
    width = max(len(name) for name, _ in commands)
    write = threading.Lock()
    ledger = tempfile.mkdtemp(prefix="motorsite-test-")
    env = {**env, PORT_LEDGER_ENV: str(Path(ledger) / "ports"), "PYTHONUNBUFFERED": "1"}
    sessions: list[Session] = []
    relays: list[threading.Thread] = []
    stopper = _Stopper(sessions, grace)
    previous = {signum: signal.signal(signum, stopper.on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        for name, argv in commands:
            # A process group of its own: a terminal's Ctrl-C reaches this process alone, which
            # hands each session exactly one SIGINT (a second one would cut pytest's teardown).
            proc = subprocess.Popen(argv, cwd=ROOT, env={**env, SESSION_ENV: name}, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, process_group=0)
            session = Session(name, proc, time.monotonic())
            sessions.append(session)
            relay = threading.Thread(target=_relay, args=(session, f"{name:<{width}} | ", out, write), daemon=True)
            relay.start()
            relays.append(relay)
        running = list(sessions)
        while running:
            stopper.escalate_when_due()
            time.sleep(0.2)
            for session in [s for s in running if s.proc.poll() is not None]:
                running.remove(session)
                session.seconds = time.monotonic() - session.started
                session.cpu = _children_cpu() - sum(s.cpu for s in sessions if s not in running and s is not session)
    finally:
        stopper.kill_all()  # only when the loop above was cut short (an exception in this process)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        left = _stop_left_behind()  # first: what is left may hold a session's output pipe open
        for relay in relays:
            relay.join(timeout=10)
        shutil.rmtree(ledger, ignore_errors=True)
    _report(sessions, left, out)
    return next((s.proc.returncode for s in sessions if s.proc.returncode != 0), 0)


def _relay(session: Session, prefix: str, out: TextIO, write: threading.Lock) -> None:
    assert session.proc.stdout is not None
    shown = True
    for raw in session.proc.stdout:  # read to the end whatever happens: a full pipe would stop the session
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        session.lines.append(line)
        if shown:
            with write:
                try:
                    out.write(prefix + line + "\n")
                    out.flush()
                except OSError:  # `make test | head`: the reader is gone
                    shown = False


class _Stopper:
    """The signal handler: one SIGINT to each session at the first signal, SIGKILL at the second
    or once ``grace`` has passed since the first."""

    def __init__(self, sessions: list[Session], grace: float) -> None:
        self.sessions = sessions
        self.grace = grace
        self.signalled_at: float | None = None

    def on_signal(self, signum: int, _frame: object) -> None:
        if self.signalled_at is not None:
            self.kill_all()
            return
        self.signalled_at = time.monotonic()
        for session in self.sessions:
            _signal_group(session.proc, signal.SIGINT)

    def escalate_when_due(self) -> None:
        if self.signalled_at is not None and time.monotonic() - self.signalled_at > self.grace:
            self.kill_all()

    def kill_all(self) -> None:
        for session in self.sessions:
            _signal_group(session.proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass


def _become_subreaper() -> None:
    """Make orphans among this process's descendants its own children, not init's (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _children() -> list[int]:
    """This process's live children: once the sessions were reaped, only what outlived them."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
            if int(fields[1]) == me and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def _stop_left_behind() -> list[str]:
    """Stop every process the sessions left running (SIGTERM to its group, SIGKILL after
    ``LEFT_BEHIND_GRACE_S``); the command lines of those found."""
    found: list[str] = []
    for _ in range(5):  # a stopped leader's own children are orphaned to us in turn
        pids = _children()
        if not pids:
            break
        for pid in pids:
            try:
                found.append(f"{pid} " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200])
            except OSError:
                pass
        for signum, wait in ((signal.SIGTERM, LEFT_BEHIND_GRACE_S), (signal.SIGKILL, 5.0)):
            for pid in pids:
                _signal_process_group(pid, signum)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
                _reap()
                time.sleep(0.1)
        _reap()
    _reap()
    return found


def _signal_process_group(pid: int, signum: int) -> None:
    try:
        group = os.getpgid(pid)
        # Its own group (a supervisor's child leads one), never this process's.
        os.killpg(group, signum) if group != os.getpgrp() else os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _reap() -> None:
    """Collect every exited child (the sessions were waited for already)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _report(sessions: list[Session], left: list[str], out: TextIO) -> None:
    out.write("\n")
    for session in sessions:
        if session.proc.returncode != 0 and session.short_summary():
            out.write(f"---- {session.name}: short test summary info\n" + "\n".join(session.short_summary()) + "\n")
    for session in sessions:
        out.write(f"motorsite: {session.name}: {session.summary()} (exit {session.proc.returncode}, "
                  f"{session.seconds:.0f} s, {session.cpu:.0f} s of CPU)\n")
    for line in left:
        out.write(f"motorsite: stopped what a session left running: {line}\n")
    out.flush()


def main(extra: list[str], env: dict[str, str], python: str) -> int:
    """Both sessions of the suite with the app environment's ``python``; ``extra`` goes to both."""
    color = ["--color=yes"] if sys.stdout.isatty() else []
    print("motorsite: two pytest sessions at once, "
          + "; ".join(f"{name}: pytest {' '.join([*args, *extra])}" for name, args in SESSIONS), flush=True)
    return run_sessions([(name, [python, "-m", "pytest", *args, *color, *extra]) for name, args in SESSIONS], env)
