"""The settings module at start: SECRET_KEY's rule and the TLS switch.

Each case imports ``motorsite.settings`` in a fresh interpreter with the environment under test,
as a process starting would: a bad value must stop it with ``ImproperlyConfigured``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.exceptions import ImproperlyConfigured

from motorsite.settings import DEV_SECRET_KEY, check_secret_key, persistent_secret_key

ROOT = Path(__file__).resolve().parents[2]
STRONG = "k" * 10 + "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"  # 56 characters, 46 distinct
PRINT = (
    "import json, django; from django.conf import settings; django.setup(); print(json.dumps({k: getattr(settings, k) "
    "for k in ('SECRET_KEY', 'SESSION_COOKIE_SECURE', 'CSRF_COOKIE_SECURE', 'SECURE_PROXY_SSL_HEADER', "
    "'SECURE_HSTS_SECONDS')}))"
)


def start(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Import the settings as a starting process does, in ``tmp_path`` as its var dir."""
    base = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG", "DATABASE_URL") and not k.startswith("MOTOR_")}
    return subprocess.run(
        [sys.executable, "-c", PRINT], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**base, "DJANGO_SETTINGS_MODULE": "motorsite.settings", "MOTOR_VAR_DIR": str(tmp_path), **env},
    )


def started(tmp_path: Path, **env: str) -> dict[str, Any]:
    done = start(tmp_path, **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("key", ["short-key", "x" * 60, "django-insecure-" + STRONG, DEV_SECRET_KEY])
def test_it_refuses_a_weak_secret_key_at_start(tmp_path: Path, key: str) -> None:
    done = start(tmp_path, SECRET_KEY=key)
    assert done.returncode != 0
    assert "ImproperlyConfigured: SECRET_KEY must be at least 50 characters" in done.stderr
    assert key not in done.stderr  # the refusal does not print the secret
    assert not (tmp_path / "secret_key").exists()


def test_it_takes_a_strong_secret_key_as_given(tmp_path: Path) -> None:
    assert started(tmp_path, SECRET_KEY=STRONG)["SECRET_KEY"] == STRONG
    assert not (tmp_path / "secret_key").exists()


def test_without_a_secret_key_it_generates_one_once_and_keeps_it(tmp_path: Path) -> None:
    first = started(tmp_path)["SECRET_KEY"]
    assert check_secret_key(first) == first
    stored = tmp_path / "secret_key"
    assert stored.read_text() == first and stored.stat().st_mode & 0o777 == 0o600
    assert started(tmp_path)["SECRET_KEY"] == first  # the next process signs with the same key
    assert list(tmp_path.iterdir()) == [stored]  # no temporary file left behind


def test_a_stored_key_that_is_not_strong_stops_the_start(tmp_path: Path) -> None:
    (tmp_path / "secret_key").write_text("short")
    done = start(tmp_path)
    assert done.returncode != 0 and "ImproperlyConfigured" in done.stderr and "secret_key must be" in done.stderr


class LateLook(type(Path())):  # type: ignore[misc]
    """A path that still looked absent when another process had just linked the key in place."""

    def exists(self, **kwargs: Any) -> bool:
        return False


def test_of_two_processes_generating_at_once_the_loser_takes_the_winners_key(tmp_path: Path) -> None:
    winner = persistent_secret_key(tmp_path / "secret_key")
    loser = persistent_secret_key(LateLook(tmp_path / "secret_key"))
    assert loser == winner and (tmp_path / "secret_key").read_text() == winner
    assert list(tmp_path.iterdir()) == [tmp_path / "secret_key"]  # the loser's own key is gone


def test_debug_runs_with_the_development_key(tmp_path: Path) -> None:
    assert started(tmp_path, DEBUG="true")["SECRET_KEY"] == DEV_SECRET_KEY
    assert not (tmp_path / "secret_key").exists()


def test_secure_cookies_follow_the_tls_setting(tmp_path: Path) -> None:
    plain = started(tmp_path, SECRET_KEY=STRONG)
    assert (plain["SESSION_COOKIE_SECURE"], plain["CSRF_COOKIE_SECURE"], plain["SECURE_PROXY_SSL_HEADER"]) == (
        False, False, None)
    tls = started(tmp_path, SECRET_KEY=STRONG, MOTOR_TLS="true", MOTOR_HSTS_SECONDS="3600")
    assert (tls["SESSION_COOKIE_SECURE"], tls["CSRF_COOKIE_SECURE"]) == (True, True)
    assert tls["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    assert tls["SECURE_HSTS_SECONDS"] == 3600
    assert "MOTOR_TLS must be a boolean" in start(tmp_path, SECRET_KEY=STRONG, MOTOR_TLS="https").stderr


def test_the_kubernetes_secret_is_refused() -> None:
    # Its placeholder once had the length the rule demands, so it passed, and signed metaserver
    # routes with a key anyone could read (tests/deploy/test_k8s.py starts a pod's processes with it).
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "secret.yaml").read_text()))
    key = next(d for d in docs if d and d["kind"] == "Secret")["stringData"]["SECRET_KEY"]
    with pytest.raises(ImproperlyConfigured, match="placeholder"):
        check_secret_key(key)


# The kind of value the k8s Secret shipped until it was refused: long enough, and public.
LONG_PLACEHOLDER = "change-me-to-the-output-of-secrets-token-urlsafe-50-before-applying"


@pytest.mark.parametrize("name", ["SECRET_KEY", "MOTOR_METASERVER_KEY"])
def test_it_refuses_a_long_placeholder_key(tmp_path: Path, name: str) -> None:
    done = start(tmp_path, **{"SECRET_KEY": STRONG, name: LONG_PLACEHOLDER})
    assert done.returncode != 0
    assert f"ImproperlyConfigured: {name} is a placeholder" in done.stderr
    assert "secrets.token_urlsafe(50)" in done.stderr and LONG_PLACEHOLDER not in done.stderr


def test_debug_still_refuses_a_placeholder_key(tmp_path: Path) -> None:
    done = start(tmp_path, DEBUG="true", SECRET_KEY=LONG_PLACEHOLDER)
    assert done.returncode != 0 and "SECRET_KEY is a placeholder" in done.stderr
    assert started(tmp_path, DEBUG="true", SECRET_KEY="short-dev-key")["SECRET_KEY"] == "short-dev-key"


GOOD_API_KEY = "sk-" + "0123456789abcdefghijklmnopqrstuvwxyzABCD"


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("MOTOR_API_KEYS", "sk-motor-change-me", "placeholder"),
        ("MOTOR_API_KEYS", f"{GOOD_API_KEY},sk-test", "shorter than 20"),  # every key of the list
        ("MOTOR_API_KEYS", "sk-aaaaaaaaaaaaaaaaaaaaaaaa", "fewer than 6 distinct"),
        ("MOTOR_DEMO_API_KEY", "sk-...", "placeholder"),
        ("MOTOR_DEMO_ADMIN_KEY", "mk-admin-change-me", "placeholder"),
        ("MOTOR_DEMO_ADMIN_KEY", "hunter2", "shorter than 20"),
        ("MOTOR_DEMO_ADMIN_PASSWORD", "hunter2", "shorter than 12"),
        ("MOTOR_DEMO_ADMIN_PASSWORD", "changeme12345", "placeholder"),
        ("DATABASE_URL", "postgresql://motorsite:change-me@postgres:5432/motorsite", "placeholder"),
    ],
)
def test_it_refuses_a_weak_or_placeholder_secret_at_start(tmp_path: Path, name: str, value: str, why: str) -> None:
    done = start(tmp_path, SECRET_KEY=STRONG, **{name: value})
    assert done.returncode != 0
    assert f"ImproperlyConfigured: {name}" in done.stderr and why in done.stderr, done.stderr[-1500:]
    assert "generate one with python3 -c" in done.stderr
    assert value not in done.stderr  # the refusal does not print the secret


def test_it_takes_generated_keys_and_passwords(tmp_path: Path) -> None:
    started(
        tmp_path, SECRET_KEY=STRONG, MOTOR_METASERVER_KEY=STRONG[::-1], MOTOR_API_KEYS=f"{GOOD_API_KEY},{GOOD_API_KEY[::-1]}",
        MOTOR_DEMO_ADMIN_KEY="mk-" + GOOD_API_KEY, MOTOR_DEMO_ADMIN_PASSWORD="Xk9_dash-Qw3rty",
    )


def test_check_secret_key_names_what_it_checked() -> None:
    with pytest.raises(ImproperlyConfigured, match="^/etc/key must be"):
        check_secret_key("short", name="/etc/key")
