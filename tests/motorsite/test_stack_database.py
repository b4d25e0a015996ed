"""``stack.prepare_database``: what ``make run`` writes before anything starts."""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.hashers import check_password

from motorsite import stack

# As runstack generates one (secrets.token_urlsafe), which starts with "-" one time in 64.
PASSWORD = "-Xk9_dash-Qw3rty"


def test_it_sets_the_admin_password_without_putting_it_on_any_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # argv is public (ps, /proc/<pid>/cmdline for every user); the password went there once.
    seen: list[tuple[list[str], dict[str, str]]] = []
    real_run = subprocess.run

    def run(argv: list[str], **kwargs: Any) -> Any:
        seen.append((list(argv), dict(kwargs.get("env") or {})))
        return real_run(argv, **kwargs)

    monkeypatch.setattr(stack.subprocess, "run", run)
    db = tmp_path / "db.sqlite3"
    cfg = stack.StackConfig(
        model_dir="/m", render_python="", engine_python="", engines="sim", prefill_ports=(), decode_ports=(),
        database_url=f"sqlite:///{db}", admin_password=PASSWORD, log_dir=tmp_path,
    )
    stack.prepare_database(cfg)
    with sqlite3.connect(db) as conn:
        (hashed,) = conn.execute("SELECT password FROM auth_user WHERE username = 'admin'").fetchone()
    assert check_password(PASSWORD, hashed)
    # One Django process migrates and writes the fleet (a boot costs seconds of CPU).
    assert [argv[2:4] for argv, _ in seen] == [["demo_fleet", "--migrate"]]
    assert not [a for argv, _ in seen for a in argv if PASSWORD in a]
    assert seen[0][1]["MOTOR_DEMO_ADMIN_PASSWORD"] == PASSWORD  # demo_fleet's environment carries it
    # Nor do the processes make run supervises carry it in their arguments.
    assert not [a for spec in stack.build_specs(cfg) for a in spec.argv if PASSWORD in a]
