"""Control-plane writers racing on one row, on real SQLite and on PostgreSQL: an operator's edit
(REST PATCH, the admin change form) or a breaker write-back decided a moment ago must not undo a
state flip, a probe verdict or an operator's reset that landed between its read and its write.

Each race is played in its worst order on purpose rather than left to chance: writer A is paused
just before it starts writing (its first ``BEGIN``, which on SQLite takes the write lock, or its
first ``UPDATE`` of the contested row) while writer B, on its own connection in another thread,
does its whole write and commits; then A goes on. That is the widest window a stale copy can have,
and it is the same window on every run. The writers run in a subprocess with ``DATABASE_URL``
set (this file run as a script, as in ``tests/motorsite/test_sqlite_concurrency.py``), so they use
exactly the ``DATABASES`` that ``motorsite.settings`` builds for ``make run`` and for PostgreSQL.

On SQLite the admin change view is one ``BEGIN IMMEDIATE`` transaction (Django wraps it in
``atomic``), so there B goes first and A reads fresh: SQLite serializes that path by itself;
PostgreSQL (read committed) does not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import prerequisites

REPO = Path(__file__).resolve().parents[2]
PSQL = ["psql", "-h", prerequisites.HOST, "-U", "postgres", "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-qc"]

# Writer A (an edit made from a copy read just before) against writer B (a flip that must survive).
RACES = [
    ("api_patch", "quarantine"),
    ("api_patch", "health_probe"),
    ("admin_form", "drain"),
    ("admin_form", "health_probe"),
    ("breaker_writeback", "breaker_reset"),
]


# -- the writers (in the subprocess) ------------------------------------------------------------


def _pause_before_writing(run_b: Callable[[], None]) -> Any:
    """An execute wrapper that runs ``run_b`` to completion once, just before A's first write."""
    state = {"paused": False}

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        writing = sql.startswith("BEGIN") or sql.startswith(('UPDATE "fleet_engineinstance"', 'UPDATE "fleet_breakerstate"'))
        if writing and not state["paused"]:
            state["paused"] = True
            b = threading.Thread(target=run_b)
            b.start()
            b.join()
        return execute(sql, params, many, context)

    return wrapper, state


def _race(a_kind: str, b_kind: str, served_model_id: int, key: str, user_id: int) -> dict[str, Any]:
    import httpx
    from django.contrib.auth.models import User
    from django.db import connection
    from django.test import Client

    from fleet import probes, services, writeback
    from fleet.models import BreakerState, EngineInstance

    instance = services.instance_create(
        actor="t", name=f"{a_kind}-{b_kind}", url="http://e1.test:8201", served_model_id=served_model_id
    )
    api = {"HTTP_AUTHORIZATION": f"Bearer {key}"}
    outcome: dict[str, Any] = {}

    def run_b() -> None:
        try:
            client = Client(raise_request_exception=False)
            if b_kind == "quarantine":
                outcome["b"] = client.post(
                    f"/api/instances/{instance.id}/quarantine", {"reason": "race"}, content_type="application/json", **api
                ).status_code
            elif b_kind == "drain":
                outcome["b"] = client.post(f"/api/instances/{instance.id}/drain", **api).status_code
            elif b_kind == "breaker_reset":
                outcome["b"] = client.post(f"/api/instances/{instance.id}/breaker/reset", **api).status_code
            elif b_kind == "health_probe":
                failing = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(500)))
                for _ in range(probes.thresholds().fall):
                    probes.probe_engine_health(instance.id, client=failing)
                outcome["b"] = EngineInstance.objects.get(id=instance.id).health
        except Exception as exc:
            outcome["b"] = f"{type(exc).__name__}: {exc}"
        finally:
            connection.close()

    wrapper, paused = _pause_before_writing(run_b)
    client = Client(raise_request_exception=False)
    if a_kind == "admin_form":
        client.force_login(User.objects.get(id=user_id))  # (writes a session: before the pause is armed)
    try:
        with connection.execute_wrapper(wrapper):
            if a_kind == "api_patch":
                outcome["a"] = client.patch(
                    f"/api/instances/{instance.id}", {"weight": 7}, content_type="application/json", **api
                ).status_code
            elif a_kind == "admin_form":
                form = {
                    "name": instance.name, "url": instance.url, "role": instance.role, "served_model": served_model_id,
                    "kind": instance.kind, "weight": 7, "token_capacity": instance.token_capacity,
                    "cap_token_generate": "on", "hardware_kind": instance.hardware_kind, "tp": 1, "dp": 1, "ep": 1,
                }
                outcome["a"] = client.post(f"/admin/fleet/engineinstance/{instance.id}/change/", form).status_code
            elif a_kind == "breaker_writeback":
                # The request path opened the breaker under epoch 0; the write-back thread writes it now.
                writeback.BreakerWriteBack.write(
                    writeback.BreakerTransition(instance.id, "open", "3 failures in a row", 3, None, 60.0, epoch=0)
                )
                outcome["a"] = "written"
    except Exception as exc:
        outcome["a"] = f"{type(exc).__name__}: {exc}"
    row = EngineInstance.objects.get(id=instance.id)
    breaker = BreakerState.objects.get(instance=row)
    return {
        **outcome, "paused": paused["paused"], "state": row.state, "health": row.health, "weight": row.weight,
        "breaker": [breaker.state, breaker.epoch],
    }


def main() -> None:
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.management import call_command

    from catalog.models import ServedModel
    from fleet import services

    call_command("migrate", verbosity=0)
    model = ServedModel.objects.create(name="tiny", model_path="/models/tiny")
    _, key = services.api_key_create(name="ops", scope="admin")
    user = User.objects.create(username="admin", is_staff=True, is_superuser=True)
    results = {f"{a}+{b}": _race(a, b, model.id, key, user.id) for a, b in RACES}
    print(json.dumps(results), flush=True)


# -- the test -----------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'db.sqlite3'}"
        return
    if not prerequisites.postgres_answers():
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432")
    db = f"motorsite_races_{uuid.uuid4().hex[:8]}"
    subprocess.run([*PSQL, f"CREATE DATABASE {db}"], check=True)
    try:
        yield f"postgresql://postgres@{prerequisites.HOST}:{prerequisites.POSTGRES_PORT}/{db}"
    finally:
        subprocess.run([*PSQL, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"], check=False)


def test_an_edit_or_a_write_back_from_a_stale_copy_loses_no_concurrent_flip(database_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "MOTOR_SQLITE_TIMEOUT_MS")}
    env.update(
        DATABASE_URL=database_url,
        DJANGO_SETTINGS_MODULE="motorsite.settings",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        ALLOWED_HOSTS="testserver",
        LOG_LEVEL="WARNING",
        MOTOR_PROBE_FALL="2",
    )
    done = subprocess.run([sys.executable, __file__], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.splitlines()[-1])

    # Every race was played (A paused before writing, B finished meanwhile), and both writers'
    # changes stand: A's edit, and B's flip that A's stale copy must not revert. The write-back
    # decided before the reset is dropped: the operator's reset (epoch 1) stands.
    untouched = {"paused": True, "state": "active", "health": "unknown", "weight": 7, "breaker": ["closed", 0]}
    assert results == {
        "api_patch+quarantine": {**untouched, "a": 200, "b": 200, "state": "quarantined"},
        "api_patch+health_probe": {**untouched, "a": 200, "b": "failing", "health": "failing"},
        "admin_form+drain": {**untouched, "a": 302, "b": 200, "state": "draining"},
        "admin_form+health_probe": {**untouched, "a": 302, "b": "failing", "health": "failing"},
        "breaker_writeback+breaker_reset": {**untouched, "a": "written", "b": 200, "weight": 1, "breaker": ["closed", 1]},
    }

if __name__ == "__main__":
    main()
