"""The Celery app (as in Celery's "First steps with Django"): worker and beat run the fleet's probes.

``celery -A motorsite worker`` / ``beat`` find ``app`` here. Configuration comes from Django
settings under the ``CELERY_`` prefix; the broker is Redis when ``REDIS_URL`` is set and
otherwise kombu's filesystem transport in ``MOTOR_CELERY_DIR`` (message files that every process
on this machine sees), so ``make run`` needs no broker server. The beat schedule is
``fleet.tasks.BEAT_SCHEDULE``.

Readiness for the supervisor: when ``MOTOR_CELERY_READY_FILE`` is set, the worker writes that
file once it consumes and beat once its scheduler starts; the stack names one fresh file per run,
so a file left by a killed run can never pass for readiness.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "motorsite.settings")

app = Celery("motorsite")
app.config_from_object("django.conf:settings", namespace="CELERY")


# Imported by name only (the module defers its Django imports): beat builds its scheduler from
# the configuration before any task module is imported.
from fleet.tasks import BEAT_SCHEDULE  # noqa: E402

# Lazy, like config_from_object: importing this module (motorsite/__init__ does) reads no setting.
app.add_defaults({"beat_schedule": BEAT_SCHEDULE})
app.autodiscover_tasks()


@app.on_after_configure.connect
def _filesystem_broker(sender: Celery, **kwargs: Any) -> None:
    """With the filesystem transport, point every process at the same folders and create them."""
    if sender.conf.broker_url != "filesystem://":
        return
    from django.conf import settings

    base = Path(settings.MOTOR_CELERY_DIR)
    queue, control = base / "queue", base / "control"
    for d in (queue, control):
        d.mkdir(parents=True, exist_ok=True)
    # One folder in and out: producers (beat, the admin's "probe now") and the worker are peers
    # on one machine, not two ends of a pipe.
    sender.conf.broker_transport_options = {
        "data_folder_in": str(queue), "data_folder_out": str(queue), "control_folder": str(control),
    }


def _mark_ready(**kwargs: Any) -> None:
    path = os.environ.get("MOTOR_CELERY_READY_FILE")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(f"{os.getpid()}\n")
        # Both exit normally on SIGTERM (warm shutdown, SystemExit in beat): remove the marker.
        atexit.register(Path(path).unlink, missing_ok=True)


signals.worker_ready.connect(_mark_ready, weak=False)
signals.beat_init.connect(_mark_ready, weak=False)
