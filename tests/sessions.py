"""What keeps two pytest sessions of one run apart: ``make test`` (``python3 -m toolchain test``)
runs ``tests/integration`` and the rest of the suite at once, in two processes on one machine.

Each session is named by ``MOTOR_TEST_SESSION`` (``integration``, ``rest``; unset in a plain
pytest run). What the two would otherwise share by a fixed name, and what keeps it apart:

- Django's test databases (``test_<NAME>`` on a server database, as with ``DATABASE_URL`` set to
  PostgreSQL): suffixed with the session's name (``name_test_databases``), as pytest-django does
  for its xdist workers. SQLite's test database is in memory, one per process.
- Ports: ``motorsite.processes.free_port`` hands each out once per run through the ledger file
  named by ``MOTOR_PORT_LEDGER``, shared by both sessions (the root conftest makes one for a
  plain run).
- Redis databases: the numbers used under ``tests/integration`` and elsewhere are disjoint
  (``tests/test_sessions.py`` checks the sources); a test may flush its own.
- PostgreSQL databases the tests create are named with a random suffix; logs of the processes
  ``tests/integration`` starts go to ``artifacts/logs``, which nothing else writes.
"""

from __future__ import annotations

from typing import Any

SESSION_ENV = "MOTOR_TEST_SESSION"
SQLITE = "django.db.backends.sqlite3"


def name_test_databases(databases: dict[str, dict[str, Any]], session: str) -> None:
    """Give each server database in ``databases`` (Django's ``DATABASES``) a test database named
    for ``session``: ``test_<NAME>_<session>``, or ``<TEST NAME>_<session>`` when one is set.
    SQLite's are left alone: in memory unless a ``TEST NAME`` says otherwise, then suffixed too."""
    for db in databases.values():
        test = db.setdefault("TEST", {})
        name = test.get("NAME")
        if not name:
            if db["ENGINE"] == SQLITE:
                continue
            name = f"test_{db['NAME']}"
        if name == ":memory:" or name.startswith("file:memorydb"):
            continue
        test["NAME"] = f"{name}_{session}"
