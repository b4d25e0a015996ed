"""Writes this process's live requests per render sidecar to the database, off the request path.

The data plane counts them in memory (``serving.pipeline.render.sidecar_holds.SidecarHolds``) and calls
``notify`` on every change; one daemon thread per process (as the breaker write-back) writes
the counts through ``catalog.services.render_streams_report`` at most once per
``REPORT_DELAY_S``, and only when they differ from what it last wrote. A request that starts
and ends within that delay is never written at all, so steady short traffic costs no writes;
a stream that outlives it is in the database about a second after it began, and its end about
a second after it ended. The launcher's graceful restart waits longer than that
(``runstack.RENDER_SETTLE_S``) before it trusts a zero.

Why the database and not Redis: the reader is the launcher, which already keeps the render
config and its restart flag in the database; every deployment has one, while Redis is
optional (``make run`` runs without it). One mechanism, one write per change per process.

The same thread, with another payload and writer, reports this process's engine-request buckets
and tokens in flight for the fleet dashboard (``dashboard_reporter``, ``fleet.reports``; there
in Redis when ``REDIS_URL`` is set), so every replica's dashboard draws the whole fleet.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

# Coalesces changes: one write per process per this much time, however many requests come and go.
REPORT_DELAY_S = 1.0
# After a failed write (database locked or down), try again this much later.
RETRY_S = 2.0
# The dashboard's buckets are 10 s wide and its page refreshes every 10 s: a report at most this
# late keeps every replica's plots within one bucket of each other, at one write per 5 s of traffic.
DASHBOARD_DELAY_S = 5.0

HOST = socket.gethostname()


class ReportWriter:
    """The thread that mirrors ``counts()`` into this process's ``RenderStreamReport`` row (or another report)."""

    def __init__(
        self,
        counts: Callable[[], dict[str, Any]],
        *,
        delay_s: float = REPORT_DELAY_S,
        write: Callable[[dict[str, Any]], None] | None = None,
        name: str = "render-stream-reports",
    ) -> None:
        self._counts = counts
        self._delay_s = delay_s
        self._write = write or _write
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._name = name
        # No row means no requests: until something was held there is nothing to write.
        self.written: dict[str, Any] = {}

    def notify(self) -> None:
        """The counts changed (called on the event loop: never blocks)."""
        self._ensure_thread()
        self._wake.set()

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(self._delay_s)  # let a burst of changes settle into one write
            self._wake.clear()
            self.report_once()

    def report_once(self) -> bool:
        """Write the current counts if they differ from the last written; False if a write failed."""
        counts = self._counts()
        if counts == self.written:
            return True
        try:
            self._write(counts)
        except Exception:
            logger.warning("%s: write failed; retrying in %.0fs", self._name, RETRY_S, exc_info=True)
            time.sleep(RETRY_S)
            self._wake.set()
            return False
        self.written = counts
        return True


def _write(counts: dict[str, int]) -> None:
    from django.db import close_old_connections, connection

    from catalog.services import render_streams_report

    close_old_connections()  # a long-lived thread must not reuse a connection the DB closed
    try:
        render_streams_report(host=HOST, pid=os.getpid(), counts=counts)
    finally:
        connection.close()  # changes are seconds apart: hold no connection between them


def dashboard_payload(
    series: Callable[[], Any], in_flight: Callable[[], dict[str, int]],
    route_decisions: Callable[[], list[tuple[str, str, str, int]]] = list,
) -> Callable[[], dict[str, Any]]:
    """What ``dashboard_reporter`` writes: the registry's export, this process's tokens in flight
    and its route decisions so far (model, path, reason, count: why requests went native)."""
    return lambda: {"series": series(), "in_flight": {k: v for k, v in in_flight().items() if v},
                    "route_decisions": [list(d) for d in route_decisions()]}


def dashboard_reporter(payload: Callable[[], dict[str, Any]]) -> ReportWriter:
    return ReportWriter(payload, delay_s=DASHBOARD_DELAY_S, write=_write_dashboard, name="dashboard-reports")


def _write_dashboard(payload: dict[str, Any]) -> None:
    from django.db import close_old_connections, connection

    from fleet.reports import report_write

    close_old_connections()
    try:
        report_write(host=HOST, pid=os.getpid(), payload=payload)
    finally:
        connection.close()
