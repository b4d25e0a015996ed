"""``tests/integration/early.py``'s order of starts, with rigs that start nothing real.

A rig's start here is a ``Starter`` that blocks until the test lets it end, so what is asserted is
only which rig ``early`` begins when: while a fixture waits for a rig the test process runs
nothing, and the next rig begins beside that start; otherwise one start at a time.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any, cast

import pytest

from motorsite import stack
from motorsite.supervisor import Interrupted, ProcessSpec
from tests.integration import early

BASE = cast(stack.StackConfig, object())  # handed to each build, which ignores it
MODULE = "/tests/integration/test_m.py"


class Blocking:
    """A start that lasts until ``done`` is set."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.started = threading.Event()

    def start(self) -> None:
        self.started.set()
        assert self.done.wait(30)

    def stop(self) -> None:
        self.done.set()


@pytest.fixture(autouse=True)
def fresh_rigs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(early, "RIGS", [])
    monkeypatch.setattr(early, "UPCOMING", [])
    monkeypatch.setattr(early, "LOG", [])


def rig(name: str, fixture: str, module: str = MODULE) -> tuple[early.EarlyRig[Any], Blocking]:
    starter = Blocking()
    return early.rig(name, lambda _base: (starter, name), fixture=fixture, module=module), starter


def test_a_rig_begins_beside_the_one_a_fixture_waits_for() -> None:
    first, first_start = rig("first", "a")
    second, second_start = rig("second", "b")
    early.UPCOMING[:] = [(BASE, [(MODULE, ("a", "b"))])]

    def fixture() -> None:
        with first.running(BASE):
            pass

    waiting = threading.Thread(target=fixture)
    waiting.start()
    try:
        assert first_start.started.wait(10)
        assert second_start.started.wait(10), "the next rig did not begin while the fixture waited"
        assert second.thread is not None and second.thread.is_alive() and first.thread is not None
    finally:
        first_start.done.set()
        second_start.done.set()
        waiting.join(10)
        first.close()
        second.close()


def test_while_a_test_runs_one_rig_starts_at_a_time() -> None:
    first, first_start = rig("first", "a")
    second, second_start = rig("second", "b")
    upcoming = [(MODULE, ("a", "b"))]
    early.UPCOMING[:] = [(BASE, upcoming)]
    try:
        found = early.next_to_begin(upcoming)
        assert found is first
        first.begin(BASE, early=True)
        assert first_start.started.wait(10)
        assert early.next_to_begin(upcoming) is None  # first is starting
        first_start.done.set()  # its end begins the next one (``EarlyRig._start``)
        assert second_start.started.wait(10)
    finally:
        first_start.done.set()
        second_start.done.set()
        first.close()
        second.close()


def test_a_prepared_rig_stopped_while_it_prepares_starts_no_process(tmp_path: Path) -> None:
    spawned: list[str] = []
    prepared = threading.Event()
    release = threading.Event()

    def prepare() -> None:
        prepared.set()
        assert release.wait(10)

    spec = ProcessSpec(name="never", argv=["sh", "-c", f"touch {tmp_path / 'ran'}"], ready_argv=["true"],
                       log_path=tmp_path / "never.log")
    starter = early.Prepared(prepare, [spec])
    errors: list[BaseException] = []

    def start() -> None:
        try:
            starter.start()
        except BaseException as exc:
            errors.append(exc)
        spawned.extend(starter.pids)

    thread = threading.Thread(target=start)
    thread.start()
    assert prepared.wait(10)
    starter.stop()
    release.set()
    thread.join(10)
    starter.stop()
    assert [type(e) for e in errors] == [Interrupted] and errors[0].signum == signal.SIGTERM  # type: ignore[attr-defined]
    assert spawned == [] and not (tmp_path / "ran").exists()


def test_rigs_begin_for_two_modules_ahead_and_no_further() -> None:
    modules = [f"/tests/integration/test_m{n}.py" for n in range(3)]
    rigs = [rig(f"rig-{n}", "a", module) for n, module in enumerate(modules)]
    upcoming = [(module, ("a",)) for module in modules]
    try:
        first, first_start = rigs[0]
        first.begin(BASE, early=True)
        first_start.done.set()
        assert first.thread is not None
        first.thread.join(10)  # ready, and not taken: its module has yet to run
        assert early.next_to_begin(upcoming) is rigs[1][0]  # the next module's may begin too
        second, second_start = rigs[1]
        second.begin(BASE, early=True)
        second_start.done.set()
        assert second.thread is not None
        second.thread.join(10)
        assert early.next_to_begin(upcoming) is None  # not a third module's
    finally:
        for found, start in rigs:
            start.done.set()
            found.close()
