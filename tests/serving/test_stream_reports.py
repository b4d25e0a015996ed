"""The reporter that writes a coordinator process's live requests per sidecar to the database
(serving.stream_reports), and the launcher's reading of those rows (catalog.services)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from catalog.models import RenderStreamReport
from catalog.services import render_live_streams, render_streams_report
from serving import stream_reports
from serving.pipeline.render.sidecar_holds import SidecarHolds
from serving.stream_reports import ReportWriter

OLD = "http://127.0.0.1:8100"


class Writes:
    def __init__(self, fail: int = 0) -> None:
        self.written: list[dict[str, int]] = []
        self.fail = fail
        self.event = threading.Event()

    def __call__(self, counts: dict[str, int]) -> None:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("database is locked")
        self.written.append(counts)
        self.event.set()


def test_it_writes_only_counts_that_differ_from_the_last_write() -> None:
    live, writes = SidecarHolds(), Writes()
    reporter = ReportWriter(live.counts, write=writes)
    assert reporter.report_once()  # nothing held, nothing ever written: no row needed
    release = live.hold(OLD)
    reporter.report_once()
    reporter.report_once()
    release()
    reporter.report_once()
    assert writes.written == [{OLD: 1}, {}]


def test_a_request_that_ends_before_the_report_costs_no_write() -> None:
    live, writes = SidecarHolds(), Writes()
    reporter = ReportWriter(live.counts, write=writes)
    live.hold(OLD)()  # began and ended within one report delay
    reporter.report_once()
    assert writes.written == []


def test_a_failed_write_is_retried_with_the_counts_of_then(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_reports, "RETRY_S", 0)
    live, writes = SidecarHolds(), Writes(fail=1)
    reporter = ReportWriter(live.counts, write=writes)
    live.hold(OLD)
    assert not reporter.report_once()
    assert reporter.written == {}  # not taken as written
    assert reporter.report_once()
    assert writes.written == [{OLD: 1}]


def test_the_thread_reports_a_change_after_its_delay() -> None:
    live, writes = SidecarHolds(), Writes()
    reporter = ReportWriter(live.counts, delay_s=0.01, write=writes)
    live.on_change = reporter.notify
    live.hold(OLD)
    assert writes.event.wait(5)
    assert writes.written == [{OLD: 1}]


@pytest.mark.django_db(transaction=True)
def test_the_real_write_upserts_one_row_per_process_that_the_launcher_sums() -> None:
    stream_reports._write({OLD: 2})
    stream_reports._write({OLD: 1, "http://127.0.0.1:9": 4})
    row = RenderStreamReport.objects.get()
    assert (row.host, row.pid, row.counts) == (stream_reports.HOST, os.getpid(), {OLD: 1, "http://127.0.0.1:9": 4})
    assert render_live_streams(base_urls=(OLD,), host=stream_reports.HOST) == 1


@pytest.mark.django_db
def test_the_launcher_drops_rows_of_dead_processes() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    render_streams_report(host=stream_reports.HOST, pid=proc.pid, counts={OLD: 5})
    render_streams_report(host=stream_reports.HOST, pid=os.getpid(), counts={OLD: 1})
    assert render_live_streams(base_urls=(OLD,), host=stream_reports.HOST) == 1
    assert list(RenderStreamReport.objects.values_list("pid", flat=True)) == [os.getpid()]
