"""``python3 -m toolchain test`` (toolchain/suite.py): two sessions at once, their output named,
a failure in either fails the run, and a signal leaves nothing running."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WATCHDOG_S = 60  # a bound on waits for the fakes below, not a timing assertion

# A session that passes only if the other one runs at the same time: each leaves a file and waits
# for the other's. It prints what keeps sessions apart, then pytest's last lines.
MEETS_THE_OTHER = """
import os, sys, time
me, other, status = sys.argv[1], sys.argv[2], int(sys.argv[3])
open(me, "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(other):
    assert time.monotonic() < deadline, "the other session never ran beside this one"
    time.sleep(0.01)
print("session", os.environ["MOTOR_TEST_SESSION"], "ledger", os.environ["MOTOR_PORT_LEDGER"])
sys.stdout.write("tests/test_x.py ..")
sys.stdout.flush()
print("F")
if status:
    print("=" * 20 + " short test summary info " + "=" * 20)
    print("FAILED tests/test_x.py::test_it_fails - assert 0")
print("=" * 20 + (" 1 failed, 2 passed" if status else " 3 passed") + " in 0.10s " + "=" * 20)
sys.exit(status)
"""

# A session whose test started a process in a session of its own (as Supervisor starts each
# child) and that dies at SIGINT without stopping it, as a test process killed mid-teardown would.
LEAVES_A_CHILD = """
import os, signal, subprocess, sys, time
child = subprocess.Popen(["sleep", "600"], start_new_session=True)
with open(sys.argv[1] + ".partial", "w") as f:
    f.write(str(child.pid))
os.rename(sys.argv[1] + ".partial", sys.argv[1])
signal.signal(signal.SIGINT, lambda *_: os._exit(2))
time.sleep(600)
"""


def _fakes(tmp_path: Path, statuses: tuple[int, int]) -> list[tuple[str, list[str]]]:
    a, b = tmp_path / "a", tmp_path / "b"
    return [
        ("integration", [sys.executable, "-c", MEETS_THE_OTHER, str(a), str(b), str(statuses[0])]),
        ("rest", [sys.executable, "-c", MEETS_THE_OTHER, str(b), str(a), str(statuses[1])]),
    ]


def _runner(sessions: list[tuple[str, list[str]]]) -> subprocess.Popen[str]:
    """The runner in a process of its own, as ``make test`` starts it: it becomes the subreaper
    of what it starts and takes the signals (never this test process)."""
    code = f"import sys; from toolchain import suite; sys.exit(suite.run_sessions({sessions!r}, {{}}))"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)


def _run(sessions: list[tuple[str, list[str]]]) -> tuple[int, str]:
    runner = _runner(sessions)
    out, _ = runner.communicate(timeout=WATCHDOG_S)
    return runner.returncode, out


def test_it_runs_both_sessions_at_once_and_names_each_line(tmp_path: Path) -> None:
    status, out = _run(_fakes(tmp_path, (0, 0)))
    assert status == 0, out
    lines = out.splitlines()
    sessions = [line for line in lines if "| session" in line]
    # Each knows its name; both hand out ports through one ledger.
    assert sorted(line.split(" | ")[0].strip() + ":" + line.split()[3] for line in sessions) == [
        "integration:integration", "rest:rest"]
    assert len({line.split()[-1] for line in sessions}) == 1
    assert "integration | tests/test_x.py ..F" in lines and "rest        | tests/test_x.py ..F" in lines
    assert [line.split(" (")[0] for line in lines if line.startswith("motorsite: ") and "exit" in line] == [
        "motorsite: integration: 3 passed in 0.10s", "motorsite: rest: 3 passed in 0.10s"]


def test_it_fails_when_either_session_fails_and_repeats_its_failures_at_the_end(tmp_path: Path) -> None:
    status, out = _run(_fakes(tmp_path, (0, 1)))
    assert status == 1, out
    end = out.split("\n\n")[-1].splitlines()
    assert end[:2] == ["---- rest: short test summary info", "FAILED tests/test_x.py::test_it_fails - assert 0"]
    assert end[3].startswith("motorsite: rest: 1 failed, 2 passed in 0.10s (exit 1, ")


def test_a_sigterm_stops_both_sessions_and_what_they_left_running(tmp_path: Path) -> None:
    pids = [tmp_path / "a.pid", tmp_path / "b.pid"]
    sessions = [(name, [sys.executable, "-c", LEAVES_A_CHILD, str(p)]) for name, p in zip(("integration", "rest"), pids, strict=True)]
    runner = _runner(sessions)
    deadline = time.monotonic() + WATCHDOG_S
    while not all(p.exists() for p in pids):
        assert time.monotonic() < deadline and runner.poll() is None
        time.sleep(0.05)
    children = [int(p.read_text()) for p in pids]
    runner.send_signal(signal.SIGTERM)
    out, _ = runner.communicate(timeout=WATCHDOG_S)
    assert runner.returncode == 2, out  # pytest's status for an interrupted run
    for pid in children:
        assert not Path(f"/proc/{pid}").exists(), f"{pid} still runs"
        assert f"left running: {pid} sleep 600" in out
