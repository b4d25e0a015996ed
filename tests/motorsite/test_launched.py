"""The pure parts of ``motorsite.launched``: reading /metrics text and the launcher's database."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

from motorsite import stack
from motorsite.launched import LaunchedStack, ProcessRow, Stopped, metric_samples

METRICS = """\
# HELP motor_engine_errors_total Engine requests that failed on the engine's side.
# TYPE motor_engine_errors_total counter
motor_engine_errors_total{instance="engine-1"} 3.0
motor_engine_errors_total{instance="engine-2"} 0.0
motor_admission_waiting 0.0
motor_process_restarts_total{process="engine-1"} 2.0
motor_process_restarts_total_other{process="engine-1"} 9.0
"""


def test_it_reads_the_samples_of_one_metric_by_label() -> None:
    assert metric_samples(METRICS, "motor_engine_errors_total") == {'instance="engine-1"': 3.0, 'instance="engine-2"': 0.0}
    assert metric_samples(METRICS, "motor_process_restarts_total") == {'process="engine-1"': 2.0}
    assert metric_samples(METRICS, "motor_admission_waiting") == {"": 0.0}
    assert metric_samples(METRICS, "motor_absent") == {}


def test_it_calls_a_stop_clean_only_with_code_zero_and_no_port_bound() -> None:
    assert Stopped(0, ()).clean
    assert not Stopped(0, (8000,)).clean
    assert not Stopped(-9, ()).clean


def _launched(tmp_path: Path) -> LaunchedStack:
    cfg = stack.StackConfig(model_dir="m", render_python="p", engine_python="p", prefill_ports=(), decode_ports=())
    # A stand-in launcher that has already exited: only the database is read here.
    popen = subprocess.Popen([sys.executable, "-c", "pass"])
    popen.wait()
    return LaunchedStack(cfg, tmp_path, popen, tmp_path / "launcher.log")


def test_it_reads_no_processes_before_the_launcher_migrated(tmp_path: Path) -> None:
    launched = _launched(tmp_path)
    assert launched.processes() == {}  # no database file
    sqlite3.connect(launched.db).close()
    assert launched.processes() == {}  # a database without the table yet


def test_it_reads_the_process_rows_the_launcher_wrote(tmp_path: Path) -> None:
    launched = _launched(tmp_path)
    with sqlite3.connect(launched.db) as conn:
        conn.execute("CREATE TABLE fleet_managedprocess (name, pid, state, restarts, last_exit_reason)")
        conn.execute("INSERT INTO fleet_managedprocess VALUES ('engine-1', 42, 'running', 1, 'killed by SIGKILL')")
        conn.execute("INSERT INTO fleet_managedprocess VALUES ('render', 41, 'running', 0, NULL)")
    assert launched.processes() == {
        "engine-1": ProcessRow(42, "running", 1, "killed by SIGKILL"),
        "render": ProcessRow(41, "running", 0, ""),
    }
