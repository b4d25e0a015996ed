"""The embedded default (SQLite) under its own concurrency: writers in several processes and
threads at once, through the code paths that collided, give no 5xx and lose no write.

The writers are this file run as a script (``setup``, then ``write`` in each process) against one file
database named by ``DATABASE_URL``, so they get exactly the ``DATABASES`` that ``motorsite.settings``
builds for ``make run``; pytest-django's own test database (in memory) cannot be shared across
processes. Every writer waits for one "go" so that all of them write at the same time.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
from collections import Counter
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PROCESSES = 3
THREADS = 4
ROUNDS = 3  # per thread, of each of the three writes
INSTANCE_NAME = "e1"


# -- the writer processes -----------------------------------------------------------------------


def _setup() -> dict[str, Any]:
    from django.core.management import call_command

    from catalog.models import ServedModel
    from fleet import services
    from fleet.models import ControlVersion

    call_command("migrate", verbosity=0)
    model = ServedModel.objects.create(name="tiny", model_path="/models/tiny")
    instance = services.instance_create(actor="t", name=INSTANCE_NAME, url="http://e1.test:8201", served_model_id=model.id)
    _, key = services.api_key_create(name="ops", scope="admin")
    return {"instance_id": instance.id, "key": key, "control_version": ControlVersion.objects.get(id=1).value}


def _write(instance_id: int, key: str) -> dict[str, Any]:
    """Run THREADS threads of ROUNDS rounds after "go" on stdin; return status codes and errors."""
    import httpx
    from django.db import connection
    from django.test import Client

    from fleet import probes, writeback

    # Only the probe's database writes are in question here, not its HTTP: a canned healthy engine.
    engine = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, json={"choices": []})))
    statuses: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()

    def api_reset() -> None:
        client = Client(raise_request_exception=False, HTTP_AUTHORIZATION=f"Bearer {key}")
        status = client.post(f"/api/instances/{instance_id}/breaker/reset").status_code
        with lock:
            statuses.append(status)

    def breaker_writeback() -> None:
        # What the write-back thread runs for each queued transition; called from several threads
        # here so that it collides with itself as well as with the API and the probes.
        writeback.BreakerWriteBack.write(
            writeback.BreakerTransition(instance_id, "open", "3 failures in a row", 3, None, 1.0, epoch=0)
        )

    def probe() -> None:
        probes.probe_engine_health(instance_id, client=engine)

    writes = (api_reset, breaker_writeback, probe)
    start = threading.Barrier(THREADS)

    def run(n: int) -> None:
        start.wait()
        try:
            for r in range(ROUNDS):
                for w in range(len(writes)):
                    try:
                        writes[(n + r + w) % len(writes)]()
                    except Exception as exc:  # the assertion wants every failure, not the first
                        with lock:
                            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(THREADS)]
    print("ready", flush=True)
    sys.stdin.readline()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"statuses": statuses, "errors": errors}


def main(argv: list[str]) -> None:
    import django

    django.setup()
    mode, *args = argv
    result = _setup() if mode == "setup" else _write(int(args[0]), args[1])
    print(json.dumps(result), flush=True)


# -- the test -----------------------------------------------------------------------------------


@pytest.fixture
def writer_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "MOTOR_SQLITE_TIMEOUT_MS")}
    env.update(
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
        DJANGO_SETTINGS_MODULE="motorsite.settings",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        ALLOWED_HOSTS="testserver",
        LOG_LEVEL="WARNING",
    )
    return env


def run_script(env: dict[str, str], *args: str) -> Any:
    done = subprocess.run([sys.executable, __file__, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def count_rows(db: Path, instance_id: int) -> dict[str, Any]:
    with closing(sqlite3.connect(db)) as conn:

        def one(sql: str) -> Any:
            return conn.execute(sql, {"id": instance_id}).fetchone()[0]

        return {
            "journal_mode": one("PRAGMA journal_mode"),
            "resets": one("SELECT count(*) FROM fleet_breakerflip WHERE instance_id = :id AND reason = 'operator reset'"),
            "epoch": one("SELECT epoch FROM fleet_breakerstate WHERE instance_id = :id"),
            "probe_results": one("SELECT count(*) FROM fleet_proberesult WHERE instance_id = :id AND kind = 'health'"),
            "consecutive_successes": one("SELECT consecutive_successes FROM fleet_engineinstance WHERE id = :id"),
            "health_events": one("SELECT count(*) FROM fleet_instanceevent WHERE instance_id = :id AND kind = 'health'"),
            "control_version": one("SELECT value FROM fleet_controlversion WHERE id = 1"),
        }


def test_it_takes_concurrent_writers_from_processes_and_threads_without_5xx_or_lost_writes(
    writer_env: dict[str, str], tmp_path: Path
) -> None:
    fleet = run_script(writer_env, "setup")
    logs = [tmp_path / f"writer-{p}.log" for p in range(PROCESSES)]
    # stderr to files, not pipes: a writer blocked on a full pipe while it holds the write lock
    # would stall the others into the very timeout this test must not reach.
    with ExitStack() as files:
        writers = [
            subprocess.Popen(
                [sys.executable, __file__, "write", str(fleet["instance_id"]), fleet["key"]],
                env=writer_env, cwd=REPO, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=files.enter_context(log.open("w")),
            )
            for log in logs
        ]
    try:
        # Every process is set up (Django imported, threads made) before any of them writes.
        for w in writers:
            assert w.stdout is not None and w.stdout.readline().strip() == "ready", [log.read_text() for log in logs]
        for w in writers:
            assert w.stdin is not None
            w.stdin.write("go\n")
            w.stdin.flush()
        outputs = [w.communicate(timeout=120)[0] for w in writers]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
    stderr = "\n".join(log.read_text() for log in logs)
    assert [w.returncode for w in writers] == [0] * PROCESSES, stderr
    results = [json.loads(out.splitlines()[-1]) for out in outputs]

    n = PROCESSES * THREADS * ROUNDS  # writes of each kind
    errors = Counter(e for r in results for e in r["errors"])
    statuses = Counter(s for r in results for s in r["statuses"])
    assert (errors, statuses) == (Counter(), Counter({200: n})), stderr[-4000:]

    counts = count_rows(tmp_path / "db.sqlite3", fleet["instance_id"])
    assert counts["journal_mode"] == "wal"
    # No lost write: every reset left its flip and its epoch bump, every probe its result and its
    # step of the consecutive-success counter (a compare-and-set that lost would skip the step),
    # and every service call exactly one bump of the control version.
    assert counts["resets"] == counts["epoch"] == n
    assert counts["probe_results"] == counts["consecutive_successes"] == n
    assert counts["control_version"] == fleet["control_version"] + 2 * n + counts["health_events"]
    assert counts["health_events"] == 1  # unknown -> healthy, once


def test_it_configures_sqlite_for_concurrent_use_and_leaves_postgresql_alone() -> None:
    from motorsite.settings import database_from_url

    sqlite = database_from_url("sqlite:////var/db.sqlite3", sqlite_timeout_s=2.5)
    assert sqlite["NAME"] == "/var/db.sqlite3"
    assert sqlite["OPTIONS"] == {
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL",
        "transaction_mode": "IMMEDIATE",
        "timeout": 2.5,
    }
    assert "OPTIONS" not in database_from_url("postgresql://u:p@db:5432/motor")


if __name__ == "__main__":
    main(sys.argv[1:])
