"""What a Django process loads when it boots: Celery only where a worker, beat or a task send needs
it, Twisted only where Daphne serves.

Each process runs fresh (a subprocess), since this test process has loaded everything already.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, tmp_path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env |= {
        "DJANGO_SETTINGS_MODULE": "motorsite.settings", "PYTHONPATH": str(ROOT),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", "MOTOR_CELERY_DIR": str(tmp_path / "celery"),
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_coordinators_boot_imports_no_celery(tmp_path: Path) -> None:
    # Celery and kombu cost each boot about a second of CPU (make run, every test stack).
    code = (
        "import sys, django; django.setup(); import motorsite.asgi, motorsite.urls, fleet.admin, fleet.api; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'celery', 'kombu'}))"
    )
    assert _python(code, tmp_path) == "[]"


def test_a_manage_py_command_imports_neither_celery_nor_twisted(tmp_path: Path) -> None:
    # migrate, demo_fleet, probe_lora, runstack's launcher, Celery's worker and beat: the "daphne"
    # app imported daphne.server (Twisted's reactor) into each of them.
    code = (
        "import sys, django; django.setup(); from django.core.management import call_command; call_command('check'); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'celery', 'kombu', 'daphne', 'twisted', 'autobahn'}))"
    )
    assert _python(code, tmp_path).splitlines()[-1] == "[]"


def test_runserver_is_still_daphnes() -> None:
    from daphne.management.commands import runserver as daphne_runserver
    from django.core.management import get_commands, load_command_class

    assert isinstance(load_command_class(get_commands()["runserver"], "runserver"), daphne_runserver.Command)


def test_probe_now_from_a_fresh_process_reaches_motorsites_broker(tmp_path: Path) -> None:
    # The admin's and the API's "probe now" in a coordinator that never loaded Celery at boot: the
    # message lands in motorsite's filesystem broker (not Celery's default AMQP on localhost).
    code = "import django; django.setup(); from fleet import services; print(services.probes_enqueue(instance_ids=[7]))"
    assert _python(code, tmp_path) == "1"
    sent = [p.read_text() for p in (tmp_path / "celery" / "queue").iterdir()]
    assert len(sent) == 1 and "fleet.tasks.probe_instance" in sent[0]
