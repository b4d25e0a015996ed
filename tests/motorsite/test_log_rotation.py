"""Children's logs are rotated past their bound, and the tail of a dead child's log still reads right.

A child writes numbered 1 KiB lines into the log the supervisor gave it; whenever its log passed
the bound, it waits until the supervisor rotated it (so the test needs no timing: the child
cannot outrun the supervisor, and on a supervisor that never rotates it gives up and exits 99).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from motorsite import stack
from motorsite.supervisor import ChildDied, ProcessSpec, Supervisor

MAX = 32 * 1024
LINE = 1024

CHILD = """
import os, sys, time
MAX, LINE, lines = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for n in range(lines):
    sys.stdout.write(f"line {n:05d} ".ljust(LINE - 1, "x") + "\\n")
    sys.stdout.flush()
    deadline = time.monotonic() + 30
    while os.fstat(1).st_size > MAX:  # past the bound: wait for the supervisor's rotation
        if time.monotonic() > deadline:
            print("never rotated", flush=True)
            sys.exit(99)
        time.sleep(0.005)
print("last words", flush=True)
sys.exit(3)
"""


def writer(tmp_path: Path, lines: int) -> ProcessSpec:
    return ProcessSpec(
        name="chatty", argv=[sys.executable, "-c", CHILD, str(MAX), str(LINE), str(lines)],
        log_path=tmp_path / "chatty.log", ready_argv=["true"], log_max_bytes=MAX, log_backups=2,
    )


def run_until_it_dies(spec: ProcessSpec) -> ChildDied:
    with Supervisor([spec]) as sup, httpx.Client() as client:
        deadline = time.monotonic() + 120  # a watchdog, not a timing assertion
        while time.monotonic() < deadline:
            try:
                sup.supervise_once(client)
            except ChildDied as died:
                return died
            time.sleep(0.005)
    pytest.fail("the child never ended")


def test_a_child_writing_past_the_bound_leaves_bounded_files(tmp_path: Path) -> None:
    died = run_until_it_dies(writer(tmp_path, lines=300))  # 300 KiB through a 32 KiB bound
    assert died.returncode == 3, died.log_tail
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["chatty.log", "chatty.log.1", "chatty.log.2"]  # two backups kept, no more
    for name in files:
        # The bound, plus the one line that crossed it.
        assert (tmp_path / name).stat().st_size <= MAX + LINE, name
    # The tail names the last lines the child wrote, and why it ended.
    tail = died.log_tail.splitlines()
    assert tail[-1] == "last words" and tail[-2].startswith("line 00299 ")
    assert "exited with code 3" in str(died)


def test_the_tail_reaches_back_across_a_rotation_to_this_runs_start(tmp_path: Path) -> None:
    log = tmp_path / "chatty.log"
    log.write_text("--- supervisor: starting chatty: [an earlier run]\nearlier run's line\n")
    # 40 lines fill the bound once: the rotation comes mid-run, and the last lines land in a fresh file.
    died = run_until_it_dies(writer(tmp_path, lines=40))
    assert (tmp_path / "chatty.log.1").exists() and "line 00000" in (tmp_path / "chatty.log.1").read_text()
    tail = died.log_tail.splitlines()
    assert len(tail) == 40 and tail[-1] == "last words" and tail[-2].startswith("line 00039 ")
    assert tail[0].startswith("line 00001 ")  # from the rotated file, in order
    assert not [line for line in tail if "earlier run" in line or "supervisor: starting" in line]


def test_make_run_gives_every_child_the_configured_bound(tmp_path: Path) -> None:
    cfg = stack.StackConfig(
        model_dir="/m", render_python="python", engine_python="python", engines="sim", log_dir=tmp_path,
        log_max_bytes=1234, log_backups=5,
    )
    assert {(s.log_max_bytes, s.log_backups) for s in stack.build_specs(cfg)} == {(1234, 5)}


def test_a_child_still_starting_is_rotated_too(tmp_path: Path) -> None:
    # Real engines take minutes to become ready; their logs keep the bound meanwhile. The child
    # only becomes "ready" (its flag file) after its log was rotated once.
    flag = tmp_path / "ready"
    script = CHILD.replace('print("last words", flush=True)', f'open({str(flag)!r}, "w").close(); print("last words", flush=True)')
    script = script.replace("sys.exit(3)", "import time as t; t.sleep(60)")
    spec = ProcessSpec(
        name="chatty", argv=[sys.executable, "-c", script, str(MAX), str(LINE), "100"],
        log_path=tmp_path / "chatty.log", ready_argv=["test", "-f", str(flag)], ready_timeout=60.0,
        log_max_bytes=MAX, log_backups=1,
    )
    with Supervisor([spec]):
        assert flag.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["chatty.log", "chatty.log.1", "ready"]
        assert (tmp_path / "chatty.log.1").stat().st_size <= MAX + LINE
