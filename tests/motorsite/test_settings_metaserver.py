"""The metaserver's addresses are checked when settings load, not at the first Trigger request."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from motorsite import stack


def _load_settings(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "motorsite.settings", "PYTHONPATH": str(stack.ROOT), **env},
        cwd=stack.ROOT, capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize("name", ["MOTOR_METASERVER_BASE_URL", "MOTOR_METASERVER_OWNER_URL"])
def test_it_refuses_a_metaserver_address_that_is_no_url(name: str) -> None:
    result = _load_settings(**{name: "10.0.0.5:8000"})
    assert result.returncode != 0
    assert f"ImproperlyConfigured: {name} must be an http(s) URL" in result.stderr


def test_it_takes_a_pod_address() -> None:
    result = _load_settings(MOTOR_METASERVER_BASE_URL="http://10.0.0.5:8000", MOTOR_METASERVER_OWNER_URL="http://10.0.0.5:8000")
    assert result.returncode == 0, result.stderr
