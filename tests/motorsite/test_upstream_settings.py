"""MOTOR_UPSTREAM_MAX_REPLY_BYTES: the upstream client's bound on a reply read whole, from the environment."""

from __future__ import annotations

from pathlib import Path

from tests.motorsite.test_settings import STRONG, start


def test_a_reply_bound_too_small_to_hold_a_render_reply_stops_the_start(tmp_path: Path) -> None:
    assert start(tmp_path, SECRET_KEY=STRONG, MOTOR_UPSTREAM_MAX_REPLY_BYTES="1048576").returncode == 0
    for bad in ("1000", "-1"):
        done = start(tmp_path, SECRET_KEY=STRONG, MOTOR_UPSTREAM_MAX_REPLY_BYTES=bad)
        assert done.returncode != 0
        assert "MOTOR_UPSTREAM_MAX_REPLY_BYTES must be at least 65536" in done.stderr
    assert "must be an integer" in start(tmp_path, SECRET_KEY=STRONG, MOTOR_UPSTREAM_MAX_REPLY_BYTES="64MiB").stderr
