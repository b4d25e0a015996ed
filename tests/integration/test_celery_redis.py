"""Celery with Redis as broker, end to end: the worker ``make run`` starts, fed through Redis.

Two simulated engines and a Celery worker (no beat: the test enqueues exactly what it asserts
on) start through the supervisor with ``REDIS_URL`` on a Redis database of their own; the test
process enqueues real ``fleet.tasks`` through the same broker and reads their effect from the
worker's SQLite database.
"""

from __future__ import annotations

import os
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest
from celery import Celery

from motorsite import stack
from motorsite.supervisor import Supervisor, free_port
from tests import prerequisites

REDIS_URL = "redis://127.0.0.1:6379/14"


pytestmark = pytest.mark.skipif(not prerequisites.redis_answers(), reason="Redis is not answering on 127.0.0.1:6379")


def _flushdb() -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.flushdb()
    finally:
        client.close()


@contextmanager
def _redis_worker(cfg: stack.StackConfig) -> Iterator[dict[str, int]]:
    """The engines and the Celery worker of ``cfg``; yields their pids. Redis db 14 is empty after."""
    _flushdb()  # a message left by an earlier, killed run must not be taken for this one's
    stack.prepare_database(cfg)
    worker = [s for s in stack.celery_specs(cfg) if s.name == "celery-worker"]
    try:
        with Supervisor([*stack.engine_specs(cfg), *worker]) as supervisor:
            yield supervisor.pids
    finally:
        _flushdb()


def _db_path(cfg: stack.StackConfig) -> str:
    return cfg.database_url.removeprefix("sqlite:///")


def _query(cfg: stack.StackConfig, sql: str) -> list[tuple]:
    with sqlite3.connect(_db_path(cfg)) as conn:
        return conn.execute(sql).fetchall()


def _wait_for(cfg: stack.StackConfig, sql: str, count: int, timeout: float = 30.0) -> list[tuple]:
    """Poll ``sql`` until it returns ``count`` rows (the worker commits asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = _query(cfg, sql)
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_tasks_through_redis_reach_the_worker(base_config: stack.StackConfig, tmp_path: Path) -> None:
    cfg = replace(
        base_config,
        engines="sim",
        engine_ports=(free_port(), free_port()),
        coordinator_port=free_port(),
        render_port=free_port(),  # nothing listens: the render probe is not what this test enqueues
        database_url=f"sqlite:///{tmp_path / 'coordinator.sqlite3'}",
        redis_url=REDIS_URL,
        celery_dir=tmp_path / "celery",
        log_dir=base_config.log_dir / "celery-redis",
    )
    with _redis_worker(cfg) as pids:
        assert set(pids) == {"engine-1", "engine-2", "celery-worker"}  # no beat: nothing unasked is enqueued
        instances = _query(cfg, "SELECT id, name FROM fleet_engineinstance ORDER BY name")
        assert [name for _, name in instances] == ["union-1", "union-2"]

        # A client of the same broker, as the coordinator's "probe now" is; task names are the contract.
        producer = Celery("motorsite-test", broker=REDIS_URL)
        try:
            producer.send_task("fleet.tasks.audit_fleet")
            for instance_id, _ in instances:
                producer.send_task("fleet.tasks.probe_instance", args=[instance_id])
        finally:
            producer.close()

        reports = _wait_for(cfg, "SELECT summary FROM fleet_auditreport", 1)
        assert len(reports) == 1
        assert '"union-1"' in reports[0][0] and '"union-2"' in reports[0][0]
        probes = _wait_for(cfg, "SELECT instance_id, ok, kind FROM fleet_proberesult WHERE kind = 'health'", 2)
        assert sorted(probes) == sorted((i, 1, "health") for i, _ in instances)
        # Read while the worker runs: the helper flushes db 14 on the way out, so afterwards
        # an empty database would prove nothing.
        assert _broker_drained(), "a task is still queued or unacknowledged in the Redis broker"

    # Nothing left behind: the worker and engines are gone.
    assert not [name for name, pid in pids.items() if _alive(pid)]


def _broker_drained(timeout: float = 10.0) -> bool:
    """Whether kombu's Redis transport holds no message: queue empty and nothing unacked.

    The binding key proves the tasks went through this database (another broker would leave
    db 14 empty too). The ack follows the database commit, so it is polled for briefly.
    """
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert client.exists("_kombu.binding.celery"), "the worker never bound its queue in this Redis db"
        deadline = time.monotonic() + timeout
        while (client.llen("celery"), client.hlen("unacked")) != (0, 0):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True
    finally:
        client.close()
