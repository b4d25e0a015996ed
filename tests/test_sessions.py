"""The two sessions ``make test`` runs at once share nothing keyed by a fixed name (tests/sessions.py)."""

from __future__ import annotations

import re
from pathlib import Path

from motorsite.settings import database_from_url
from tests import sessions

TESTS = Path(__file__).resolve().parent
# A Redis URL in a test's source: its host part up to the database number (f-string fields
# included). Port 1 is where nothing listens (a client that must fail); its number is moot.
REDIS_URL = re.compile(r"redis://(?P<host>[^/\s\"']+)/(?P<db>\d+)")


def _redis_databases(files: list[Path]) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for path in files:
        for m in REDIS_URL.finditer(path.read_text()):
            if m["host"].endswith(":1") or not m["host"].startswith(("127.0.0.1", "localhost", "{")):
                continue
            found.setdefault(int(m["db"]), []).append(str(path.relative_to(TESTS)))
    return found


def test_the_two_sessions_use_different_redis_databases() -> None:
    # tests/integration flushes its databases (test_replicas, test_celery_redis) while the rest
    # runs; a database both used would lose the other's keys mid-test.
    files = sorted(TESTS.rglob("*.py"))
    integration = _redis_databases([p for p in files if (TESTS / "integration") in p.parents])
    rest = _redis_databases([p for p in files if (TESTS / "integration") not in p.parents])
    assert integration and rest  # the pattern still finds them
    shared = {db: integration[db] + rest[db] for db in integration.keys() & rest.keys()}
    assert not shared, f"Redis databases used on both sides of make test: {shared}"


def test_each_session_names_its_own_test_database_on_a_server() -> None:
    databases = {"default": database_from_url("postgresql://postgres@127.0.0.1:5432/motorsite")}
    sessions.name_test_databases(databases, "integration")
    assert databases["default"]["TEST"] == {"NAME": "test_motorsite_integration"}


def test_sqlite_test_databases_stay_in_memory() -> None:
    databases = {"default": database_from_url("sqlite:///var/db.sqlite3"), "memory": database_from_url("sqlite://")}
    sessions.name_test_databases(databases, "rest")
    assert [db["TEST"] for db in databases.values()] == [{}, {}]
