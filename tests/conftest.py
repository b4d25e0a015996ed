"""Suite-wide policy: under ``make test`` a skipped test is a failed test.

Every skip in this suite is for a missing prerequisite (Redis, PostgreSQL, Chromium, a built
tier; see ``tests/prerequisites.py``). A run that skipped one of them would be green without
having run it, so with ``MOTOR_PREREQUISITES=required`` (set by ``toolchain exec -m pytest``,
which ``make test`` and ``.ci/run`` use) each skip is reported as a failure naming its reason.

``make test`` runs two sessions at once (``python3 -m toolchain test``); what keeps them apart
is in ``tests/sessions.py``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from motorsite.processes import PORT_LEDGER_ENV
from tests import prerequisites, sessions


def pytest_configure(config: pytest.Config) -> None:
    # A plain pytest run (not under ``toolchain test``, which shares one between its two
    # sessions) gets a port ledger of its own: no port handed out twice in the run.
    if not os.environ.get(PORT_LEDGER_ENV):
        folder = tempfile.mkdtemp(prefix="motorsite-ports-")
        os.environ[PORT_LEDGER_ENV] = str(Path(folder) / "ports")

        def drop() -> None:
            os.environ.pop(PORT_LEDGER_ENV, None)
            shutil.rmtree(folder, ignore_errors=True)

        config.add_cleanup(drop)


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None) -> None:
    """pytest-django's hook for test database names, as its own chain (xdist, tox) and then
    the session's name (``tests/sessions.py``): two sessions never share ``test_<NAME>``."""
    session = os.environ.get(sessions.SESSION_ENV)
    if session:
        from django.conf import settings

        sessions.name_test_databases(settings.DATABASES, session)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome: Any = yield
    report: pytest.TestReport = outcome.get_result()
    # xfail is reported as skipped too; it is an expectation, not a missing prerequisite.
    if report.skipped and not hasattr(report, "wasxfail") and prerequisites.required():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (
            f"skipped under MOTOR_PREREQUISITES=required (make test): {reason}\n"
            "install what is missing, or run with MOTOR_PREREQUISITES=optional to allow the skip"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome: Any = yield
    report: pytest.CollectReport = outcome.get_result()
    # A module skipped as a whole (``pytest.skip(..., allow_module_level=True)``) is the same case.
    if report.skipped and prerequisites.required():
        report.outcome = "failed"
        report.longrepr = f"module skipped under MOTOR_PREREQUISITES=required (make test): {report.longrepr}"


@pytest.fixture(autouse=True)
def _fresh_render_health() -> Iterator[None]:
    """Each test starts with no sidecar marked down: the coordinator process's render-down marks
    (``serving.runtime``, a cooldown of a few seconds) would carry one test's fault into the next."""
    yield
    runtime = sys.modules.get("serving.runtime")
    if runtime is not None:
        runtime.RUNTIME.render_health.clear()


@pytest.fixture(autouse=True)
def _in_process_reports_write_nowhere() -> None:
    """The test process's own reporter threads (``serving.runtime``: render stream counts, the
    dashboard's series) write nowhere. Under pytest-django a thread outside a test may not touch
    the database, so their writes could only fail; each failure logged a traceback from that
    thread for the rest of the session, and Python 3.11 formats tracebacks with ``ast.parse``,
    which is not thread-safe: an ``ast.parse`` in a test raced it (``SystemError: AST constructor
    recursion depth mismatch``). Tests of the reporters build their own."""
    runtime = sys.modules.get("serving.runtime")
    if runtime is not None:
        for reporter in (runtime.RUNTIME.render_report_writer, runtime.RUNTIME.dashboard_reporter):
            reporter._write = _write_nowhere


def _write_nowhere(_payload: object) -> None:
    return None
