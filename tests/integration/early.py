"""Real processes started in the background before the first test that needs them asks for them.

A real vLLM process takes 20-50 s to start, almost all of it one core importing torch and vLLM,
while the test process waits; on a 2-core machine the other core is then idle. So each rig of
real processes the package shares (``conftest``'s session fixtures) or a module starts for itself
is an ``EarlyRig``: registered when its module is imported, and begun in a thread of its own
while an earlier test runs (``pytest_runtest_call`` in ``conftest``: at most one rig starting in
the background at a time, the next one the remaining tests need). The fixture that uses it then
waits for the start already under way, or begins it itself when nothing did (a run of one module);
while it waits the test process runs nothing, so the next rig may begin beside (``begin_beside``).

Nothing changes in what a test sees: the same specs, started by the same ``Supervisor``, ready
by the same real request, stopped by the same fixture. A start that failed in the background
raises its error in the fixture that waits for it. Waiting is bounded by each spec's own
``ready_timeout``, counted from its spawn, as before; a rig begun early gets ``EARLY_READY_TIMEOUT``
instead, since it may start beside a test's own work on a loaded machine and nobody waits on it
meanwhile.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, Protocol, TypeVar, cast

from motorsite import stack
from motorsite.supervisor import Interrupted, ProcessSpec, Supervisor

T = TypeVar("T")

# Each rig's begin, ready and wait, one line each: what the background starts saved, per run.
LOG: list[Path] = []


def _note(line: str) -> None:
    if LOG:
        with open(LOG[0], "a") as log:
            log.write(f"{time.strftime('%H:%M:%S')} {line}\n")

class Starter(Protocol):
    """What starts a rig other than a list of specs (``manage.py runstack``, say)."""

    def start(self) -> None:
        """Start everything and return once it is ready (raises when it cannot be)."""

    def stop(self) -> None:
        """Stop everything, also while ``start`` is still running in another thread (idempotent)."""


class Prepared:
    """A ``Starter``: ``prepare()`` (a coordinator's database, say: what the processes read at
    their start), then ``specs`` started by a ``Supervisor``, all in the rig's thread."""

    def __init__(self, prepare: Callable[[], None], specs: list[ProcessSpec]) -> None:
        self.prepare = prepare
        self.supervisor = Supervisor(specs)
        self.stopping = False
        self.in_start = False

    @property
    def pids(self) -> dict[str, int]:
        return self.supervisor.pids

    def start(self) -> None:
        self.in_start = True
        try:
            self.prepare()
            if self.stopping:
                raise Interrupted(signal.SIGTERM)
            self.supervisor.start()
        finally:
            self.in_start = False

    def stop(self) -> None:
        self.stopping = True
        if self.in_start:
            # As ``EarlyRig.close`` interrupts a Supervisor's start: its readiness loop raises
            # Interrupted and stops every child it spawned; the second stop() then finds none.
            self.supervisor._signal_received = signal.SIGTERM
        else:
            self.supervisor.stop()


# A rig begun early may share the machine with a test and another rig; its first user waits at
# most this long from the spawn (the rigs' own bounds are 120-420 s).
EARLY_READY_TIMEOUT = 900.0


class EarlyRig(Generic[T]):
    """The processes ``build`` describes, started once in a thread: begun early or on first use.

    ``build(base)`` returns the specs (started as ``Supervisor`` starts them: in order, groups
    marked ``start_with_previous`` together), or a ``Starter``, and what the fixture hands its
    tests (URLs, config). ``users`` decides which tests need it (fixture names, module path).
    """

    def __init__(self, name: str, build: Callable[[stack.StackConfig], tuple[list[ProcessSpec] | Starter, T]],
                 users: Callable[[str, tuple[str, ...]], bool]) -> None:
        self.name = name
        self.build = build
        self.users = users
        self.value: T | None = None
        self.starter: Starter | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.closed = False
        self.taken = False  # a fixture asked for it: from then on it is that fixture's
        self.begun_at = 0.0

    @property
    def starting(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def begin(self, base: stack.StackConfig, *, early: bool, during: str = "") -> None:
        """Start the processes in a thread unless that already happened (idempotent)."""
        with LOCK:  # a fixture and the chain of early starts (``_start``) may both ask
            if self.thread is not None or self.closed:
                return
            self._begin(base, early=early, during=during)

    def _begin(self, base: stack.StackConfig, *, early: bool, during: str) -> None:
        _note(f"{self.name}: begun {'early, ' + during if early else 'by its first user'}")
        self.begun_at = time.monotonic()
        specs, self.value = self.build(base)
        if isinstance(specs, list):
            if early:
                specs = [replace(s, ready_timeout=max(s.ready_timeout, EARLY_READY_TIMEOUT)) for s in specs]
            self.starter = Supervisor(specs)
        else:
            self.starter = specs
        self.thread = threading.Thread(target=self._start, name=f"early-{self.name}", daemon=True)
        self.thread.start()

    def _start(self) -> None:
        assert self.starter is not None
        try:
            self.starter.start()  # off the main thread: no signal handlers (Supervisor's rule)
        except BaseException as exc:  # raised again in the fixture that waits
            self.error = exc
        _note(f"{self.name}: {'failed' if self.error else 'ready'} {time.monotonic() - self.begun_at:.1f} s after its begin")
        # The next rig need not wait for the next test to begin (a test may run for a minute).
        if UPCOMING and self.error is None:
            found = next_to_begin(UPCOMING[0][1], starting=self)
            if found is not None:
                found.begin(UPCOMING[0][0], early=True, during=f"after {self.name} was ready")

    @contextlib.contextmanager
    def running(self, base: stack.StackConfig) -> Iterator[tuple[T, Any]]:
        """Wait until every process is ready (beginning the start if nobody did); stop them after."""
        self.begin(base, early=False)
        self.taken = True
        assert self.thread is not None and self.starter is not None
        try:
            waited = time.monotonic()
            if self.starting:
                begin_beside(self)
            self.thread.join()
            _note(f"{self.name}: its first user waited {time.monotonic() - waited:.1f} s")
            if self.error is not None:
                raise self.error
            yield cast(T, self.value), self.starter  # set by begin(): the Supervisor, or the Starter
        finally:
            self.close()

    def close(self) -> None:
        """Stop what was started, interrupting a start still under way (idempotent)."""
        self.closed = True
        if self.starter is None:
            return
        if self.thread is not None and self.thread.is_alive():
            if isinstance(self.starter, Supervisor):
                # The start's readiness loop checks this before every probe and raises Interrupted,
                # and start() then stops every child it spawned (Supervisor's own interrupt path).
                self.starter._signal_received = signal.SIGTERM
            else:
                self.starter.stop()
            self.thread.join()
        # As ``with Supervisor(...)`` stops: a port still bound afterwards is an error.
        self.starter.stop()


def begin_beside(waited_for: EarlyRig[Any]) -> None:
    """While a fixture waits for ``waited_for`` the test process runs nothing: its core is free,
    so the next rig the remaining tests need may begin beside that start (one more start at most,
    and no further ahead than ``next_to_begin`` looks)."""
    if UPCOMING:
        found = next_to_begin(UPCOMING[0][1], starting=waited_for)
        if found is not None:
            found.begin(UPCOMING[0][0], early=True, during=f"beside {waited_for.name}, while its first user waited")


RIGS: list[EarlyRig[Any]] = []
# How many modules may have rigs begun and waiting for them at once. With one, a module whose
# tests run briefly left the next module's rigs to start while that module waited; two keep a
# rig starting in the background through most of the package.
MODULES_AHEAD = 2
LOCK = threading.Lock()
# The base configuration and the tests still to run (path, fixture names), as of the last test
# that began: where a start that ends in the background looks for the next rig to begin.
UPCOMING: list[tuple[stack.StackConfig, list[tuple[str, tuple[str, ...]]]]] = []


def rig(name: str, build: Callable[[stack.StackConfig], tuple[list[ProcessSpec] | Starter, T]], *,
        fixture: str, module: str | None = None) -> EarlyRig[T]:
    """Register a rig needed by every test that uses ``fixture`` (in ``module`` only, when given:
    module fixtures of different modules share names)."""
    def users(path: str, fixtures: tuple[str, ...]) -> bool:
        return fixture in fixtures and (module is None or path == module)

    found = EarlyRig(name, build, users)
    RIGS.append(found)
    return found


def next_to_begin(upcoming: list[tuple[str, tuple[str, ...]]], starting: EarlyRig[Any] | None = None
                  ) -> EarlyRig[Any] | None:
    """The next rig to begin for the ``upcoming`` tests (path, fixture names), in their order.

    None while a rig is starting (one at a time: two starts on two cores would take the running
    test's), and beyond the ``MODULES_AHEAD``-th module still to take a rig begun for it (their
    rigs may begin, no later module's): processes waiting for a far-away user would only sit in
    memory. ``starting`` is left out of that count: the rig whose start just ended, or the one a
    fixture waits for (``begin_beside``).
    """
    if any(r.starting for r in RIGS if r is not starting):
        return None
    waiting: list[str] = []  # the modules with a rig begun for them and not yet taken, in order
    for path, fixtures in upcoming:
        if path not in waiting and len(waiting) >= MODULES_AHEAD:
            return None
        for candidate in RIGS:
            if candidate.closed or candidate.taken or not candidate.users(path, fixtures):
                continue
            if candidate.thread is None:
                return candidate
            if path not in waiting:
                waiting.append(path)
    return None
