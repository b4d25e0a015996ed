"""``stack.prepare_database``: what ``make run`` writes before anything starts."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from django.contrib.auth.hashers import check_password

from motorsite import stack


def test_it_sets_an_admin_password_that_starts_with_a_dash(tmp_path: Path) -> None:
    # runstack generates the password with secrets.token_urlsafe, which starts with "-" one time
    # in 64: passed as a separate argument, demo_fleet's parser took it for an option and failed.
    db = tmp_path / "db.sqlite3"
    cfg = stack.StackConfig(
        model_dir="/m", render_python="", engine_python="", engines="sim", prefill_ports=(), decode_ports=(),
        database_url=f"sqlite:///{db}", admin_password="-Xk9_dash", log_dir=tmp_path,
    )
    stack.prepare_database(cfg)
    with sqlite3.connect(db) as conn:
        (hashed,) = conn.execute("SELECT password FROM auth_user WHERE username = 'admin'").fetchone()
    assert check_password("-Xk9_dash", hashed)
