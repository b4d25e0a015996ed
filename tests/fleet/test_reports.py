"""The fleet dashboard across coordinator processes: buckets added up, reports in the database or Redis."""

from __future__ import annotations

import re
import threading
import time
import uuid
from typing import Any, Iterator

import pytest
from django.contrib.auth.models import User
from django.test import Client

from catalog.models import RenderConfig, ServedModel
from fleet import reports
from fleet.models import CoordinatorReport, EngineInstance
from fleet.services import instance_create
from serving.pipeline import metrics
from serving.pipeline.metrics import MetricsRegistry
from tests import prerequisites

NOW = 1_000_000.0  # a multiple of the bucket width: the current bucket starts here


def registry(at: float = NOW) -> MetricsRegistry:
    return MetricsRegistry(clock=lambda: at)


def test_it_adds_up_the_buckets_of_two_processes() -> None:
    a, b = registry(), registry()
    a.record_request("e1", 0.010, 0.002, ok=True)
    a.record_request("e1", 0.030, None, ok=True)
    b.record_request("e1", 0.050, 0.004, ok=False)
    b.record_request("e2", None, None, ok=False)
    merged = metrics.merge([a.export(), b.export()], now=NOW)
    last = merged["e1"].points[-1]
    assert (last.start, last.requests, last.errors) == (NOW, 3, 1)
    # Weighted by count, not an average of the two processes' averages ((0.02 + 0.05) / 2).
    assert last.ttft_s == pytest.approx(0.030) and last.tpot_s == pytest.approx(0.003)
    assert merged["e2"].points[-1].errors == 1 and merged["e1"].requests_total == 3
    assert len(merged["e1"].points) == metrics.BUCKETS
    # One process alone is what its own snapshot says.
    assert metrics.merge([a.export()], now=NOW)["e1"].points == a.snapshot()["e1"].points


def test_it_leaves_out_buckets_older_than_the_window() -> None:
    old = registry(NOW - metrics.BUCKETS * metrics.BUCKET_S)  # one lap ago: just outside
    old.record_request("e1", 0.5, None, ok=True)
    recent = registry(NOW - 10)
    recent.record_request("e1", 0.1, None, ok=True)
    merged = metrics.merge([old.export(), recent.export()], now=NOW)["e1"]
    assert [p.requests for p in merged.points[-2:]] == [1, 0] and sum(p.requests for p in merged.points) == 1


def test_the_registry_calls_its_listener_on_every_record() -> None:
    r = registry()
    seen: list[int] = []
    r.on_record = lambda: seen.append(1)
    r.record_request("e1", None, None, ok=True)
    r.record_request("e1", None, None, ok=False)
    assert len(seen) == 2


# -- the stores --------------------------------------------------------------------------------


@pytest.fixture
def redis_store(settings: Any) -> Iterator[None]:
    if not prerequisites.redis_answers():
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    # Not a database tests/integration uses: it runs at the same time (tests/sessions.py), and its
    # coordinators' reports are under the same prefix this deletes.
    settings.REDIS_URL = "redis://127.0.0.1:6379/11"
    reports._redis_client = None
    client = reports._redis()
    for key in client.scan_iter(match=reports.REDIS_PREFIX + "*"):
        client.delete(key)
    yield
    for key in client.scan_iter(match=reports.REDIS_PREFIX + "*"):
        client.delete(key)
    reports._redis_client = None


def _roundtrip() -> str:
    host = f"pod-{uuid.uuid4().hex[:6]}"
    reports.report_write(host=host, pid=11, payload={"series": {"e1": [[NOW, 1, 0, 0.1, 1, 0.0, 0]]}, "in_flight": {"e1": 5}})
    reports.report_write(host=host, pid=12, payload={"series": {}, "in_flight": {}})
    reports.report_write(host=host, pid=11, payload={"series": {"e1": [[NOW, 2, 0, 0.2, 2, 0.0, 0]]}, "in_flight": {}})
    # Only this test's host: a coordinator thread of an earlier test may have reported its own.
    found = sorted((r.host, r.pid, r.payload["series"]) for r in reports.reports_read() if r.host == host)
    assert found == [(host, 11, {"e1": [[NOW, 2, 0, 0.2, 2, 0.0, 0]]}), (host, 12, {})]
    return host


def test_it_keeps_one_report_per_process_in_the_database(db: None, settings: Any) -> None:
    settings.REDIS_URL = ""
    host = _roundtrip()
    mine = CoordinatorReport.objects.filter(host=host)
    assert mine.count() == 2
    # A process silent for longer than the window is forgotten by the next write.
    mine.filter(pid=12).update(updated=mine.get(pid=11).updated.replace(year=2000))
    assert [r.pid for r in reports.reports_read() if r.host == host] == [11]
    reports.report_write(host="x", pid=1, payload={})
    assert not mine.filter(pid=12).exists()


def test_it_keeps_one_report_per_process_in_redis(db: None, redis_store: None) -> None:
    host = _roundtrip()
    assert not CoordinatorReport.objects.filter(host=host).exists()  # nothing went to the database
    ttl = reports._redis().ttl(next(reports._redis().scan_iter(match=reports.REDIS_PREFIX + "*")))
    assert 0 < ttl <= reports.STALE_S


# -- the dashboard of any replica draws the whole fleet ------------------------------------------


@pytest.fixture
def staff_client(db: None) -> Client:
    client = Client()
    client.force_login(User.objects.create_user("ops", password="pw", is_staff=True, is_superuser=True))
    return client


@pytest.fixture
def two_engines(db: None) -> list[EngineInstance]:
    model = ServedModel.objects.create(name="tiny", model_path="/m/tiny")
    RenderConfig.objects.create(name="default")
    return [instance_create(actor="test", name=f"e{n}", url=f"http://e{n}.test", served_model_id=model.id) for n in (1, 2)]


def _row_numbers(html: str, name: str) -> tuple[str, str]:
    row = html.split(f'data-instance="{name}"', 1)[1].split("</tr>", 1)[0]
    requests = re.search(r'data-plot="rate">.*?<span class="num">(\d+) in the last minute', row, re.S)
    in_flight = re.search(r'data-field="in-flight">(\d+)<', row)
    assert requests and in_flight
    return requests.group(1), in_flight.group(1)


@pytest.mark.parametrize("store", ["database", "redis"])
def test_every_replica_draws_the_same_fleet(
    staff_client: Client, two_engines: list[EngineInstance], store: str, settings: Any, request: pytest.FixtureRequest,
) -> None:
    if store == "redis":
        request.getfixturevalue("redis_store")
    else:
        settings.REDIS_URL = ""
    now = time.time()
    # Two other coordinator processes served e1 (and one of them e2); this one served nothing.
    a, b = registry(now), registry(now)
    for _ in range(3):
        a.record_request("e1", 0.02, 0.004, ok=True)
    b.record_request("e1", 0.04, None, ok=True)
    b.record_request("e2", None, None, ok=False)
    reports.report_write(host="coord-a", pid=1, payload={"series": a.export(), "in_flight": {"e1": 40}})
    reports.report_write(host="coord-b", pid=2, payload={"series": b.export(), "in_flight": {"e1": 2}})
    # This process's own stale report is ignored: its live registry (empty) is what counts.
    host, pid = reports.this_process()
    reports.report_write(host=host, pid=pid, payload={"series": a.export(), "in_flight": {"e1": 1000}})
    metrics.REGISTRY.clear()
    try:
        html = staff_client.get("/admin/fleet/dashboard/").content.decode()
    finally:
        metrics.REGISTRY.clear()
    assert re.search(r"added up over (\d+) coordinator processes", html).group(1) == str(len(reports.reports_read()))
    assert _row_numbers(html, "e1") == ("4", "42")
    assert _row_numbers(html, "e2") == ("1", "0")
    # Another replica (coord-a's view: its live buckets plus the other reports) draws the same.
    others = [r for r in reports.reports_read() if r.host != "coord-a" and (r.host, r.pid) != (host, pid)]
    seen_by_a = metrics.merge([a.export(), *[r.payload["series"] for r in others]], now=now)
    seen_here = metrics.merge([r.payload["series"] for r in reports.reports_read() if r.host.startswith("coord-")], now=now)
    assert seen_by_a == seen_here


def test_a_coordinator_process_reports_its_traffic_by_itself(transactional_db: None, settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from serving import runtime, stream_reports

    settings.REDIS_URL = ""
    # The composition root wires the process's registry to its reporter.
    assert metrics.REGISTRY.on_record == runtime.dashboard_reporter.notify
    monkeypatch.setattr(stream_reports, "DASHBOARD_DELAY_S", 0.05)
    # The process's own reporter writes under the same host and pid: a wake-up left over from an
    # earlier test must not overwrite this test's row while it is being read.
    monkeypatch.setattr(runtime.dashboard_reporter, "_write", lambda payload: None)
    r = registry(time.time())
    reporter = stream_reports.dashboard_reporter(stream_reports.dashboard_payload(r.export, lambda: {"e1": 12, "e2": 0}))
    # The test reads the row only once the thread's write is over: in the test's shared-cache
    # in-memory SQLite a read while the thread's write transaction holds the table fails at once
    # ("database table is locked"; no busy timeout applies), so polling the table raced the write.
    written = threading.Event()
    real_write = reporter._write

    def write_then_signal(payload: dict[str, Any]) -> None:
        real_write(payload)
        written.set()

    reporter._write = write_then_signal
    r.on_record = reporter.notify
    r.record_request("e1", 0.02, None, ok=True)
    assert written.wait(10), "the reporter thread wrote nothing"
    host, pid = reports.this_process()
    row = CoordinatorReport.objects.get(host=host, pid=pid)
    assert row.payload["in_flight"] == {"e1": 12}  # instances holding nothing are left out
    assert row.payload["series"]["e1"][0][1:3] == [1, 0]
