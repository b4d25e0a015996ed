"""Derender retries: off unless asked (the RFC), and the removed patience setting stops the start."""

from __future__ import annotations

import os
import subprocess
import sys

from motorsite import stack


def _load_settings(*lines: str, **env: str) -> subprocess.CompletedProcess[str]:
    code = "import django; django.setup(); from django.conf import settings; " + "; ".join(lines)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MOTOR_DERENDER_")}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "DJANGO_SETTINGS_MODULE": "motorsite.settings", "PYTHONPATH": str(stack.ROOT), **env},
        cwd=stack.ROOT, capture_output=True, text=True, timeout=60,
    )


def test_derender_is_not_retried_by_default() -> None:
    result = _load_settings("print(settings.MOTOR_DERENDER_CHUNK_RETRIES)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"


def test_the_removed_patience_setting_stops_the_start() -> None:
    """Silently ignoring it would leave an operator believing streams wait out a sidecar restart."""
    result = _load_settings(MOTOR_DERENDER_PATIENCE_MS="120000")
    assert result.returncode != 0
    assert "ImproperlyConfigured: MOTOR_DERENDER_PATIENCE_MS is gone" in result.stderr
