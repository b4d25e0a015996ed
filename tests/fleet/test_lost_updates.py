"""Control-plane writers racing on one row, on real SQLite and on PostgreSQL: an operator's edit
(REST PATCH, an admin change form) or a breaker write-back decided a moment ago must not undo a
state flip, a probe verdict, an operator's reset or another writer's edit that landed between its
read and its write. The engine instances' races and the catalog's (render config, served model)
are two tests, each a subprocess of its own.

Each race is played in its worst order on purpose rather than left to chance: writer A is paused
just before it starts writing (its first ``BEGIN``, which on SQLite takes the write lock, or its
first ``UPDATE`` or locking read of the contested row) while writer B, on its own connection in
another thread, does its whole write and commits; then A goes on. That is the widest window a
stale copy can have, and it is the same window on every run. The writers run in a subprocess
with ``DATABASE_URL`` set (this file run as a script, as in
``tests/motorsite/test_sqlite_concurrency.py``), so they use exactly the ``DATABASES`` that
``motorsite.settings`` builds for ``make run`` and for PostgreSQL.

On SQLite the admin change view is one ``BEGIN IMMEDIATE`` transaction (Django wraps it in
``atomic``), so there B goes first and A reads fresh: SQLite serializes that path by itself;
PostgreSQL (read committed) does not. What SQLite does not serialize is the human-sized window: a
form opened (``_opened_form``: a GET, as a browser's) before B and posted after it, which must
write only what the operator changed in it, not every value B changed meanwhile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
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
    ("admin_form_opened", "api_patch"),
]
# The same for the catalog: the render config's and the served model's admin forms.
CATALOG_RACES = [
    ("render_form", "render_health_probe"),
    ("render_form", "render_publish"),
    ("render_form", "sidecar_moved"),
    ("model_form", "revision_record"),
    ("model_form", "version_probe"),
]


# -- the writers (in the subprocess) ------------------------------------------------------------


def _pause_before_writing(run_b: Callable[[], None], tables: tuple[str, ...], *, at_once: bool = False) -> Any:
    """An execute wrapper that runs ``run_b`` to completion once, just before A's first write
    (or the first read that locks a row of ``tables``: B would wait for that lock, and A for B),
    or ``at_once``, before A's first statement (a form opened before B, posted after it)."""
    state = {"paused": False}

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        contested = any(f'"{table}"' in sql for table in tables)
        locking = contested and (sql.startswith("UPDATE") or sql.endswith(" FOR UPDATE"))
        writing = at_once or sql.startswith("BEGIN") or locking
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
            elif b_kind == "api_patch":  # another operator's edit of another field
                outcome["b"] = client.patch(
                    f"/api/instances/{instance.id}", {"token_capacity": 999}, content_type="application/json", **api
                ).status_code
            elif b_kind == "breaker_reset":
                outcome["b"] = client.post(f"/api/instances/{instance.id}/breaker/reset", **api).status_code
            elif b_kind == "health_probe":
                # Only the probe's database write is in question, not its HTTP: a canned failing engine.
                failing = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(500)))
                for _ in range(probes.thresholds().fall):
                    probes.probe_engine_health(instance.id, client=failing)
                outcome["b"] = EngineInstance.objects.get(id=instance.id).health
        except Exception as exc:
            outcome["b"] = f"{type(exc).__name__}: {exc}"
        finally:
            connection.close()

    wrapper, paused = _pause_before_writing(
        run_b, ("fleet_engineinstance", "fleet_breakerstate"), at_once=a_kind == "admin_form_opened"
    )
    client = Client(raise_request_exception=False)
    if a_kind.startswith("admin_form"):
        client.force_login(User.objects.get(id=user_id))  # (writes a session: before the pause is armed)
    change_url = f"/admin/fleet/engineinstance/{instance.id}/change/"
    opened = _opened_form(client, change_url) if a_kind == "admin_form_opened" else {}
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
                outcome["a"] = client.post(change_url, form).status_code
            elif a_kind == "admin_form_opened":
                outcome["a"] = client.post(change_url, {**opened, "weight": 7}).status_code
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
        "token_capacity": row.token_capacity, "breaker": [breaker.state, breaker.epoch],
    }


class _FormValues(HTMLParser):
    """What a browser posts for the forms of an admin change page, as it was served."""

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, str] = {}
        self._select: str | None = None
        self._textarea: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "option" and self._select and "selected" in a:
            self.data[self._select] = a.get("value") or ""
        name = a.get("name") or ""
        if not name or name.startswith(("csrf", "_")):
            return
        if tag == "input" and a.get("type") in ("checkbox", "radio"):
            if "checked" in a:
                self.data[name] = a.get("value") or "on"
        elif tag == "input" and a.get("type") not in ("submit", "button", "file"):
            self.data[name] = a.get("value") or ""
        elif tag == "select":
            self._select = name
            self.data.setdefault(name, "")
        elif tag == "textarea":
            self._textarea = name
            self.data[name] = ""

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        if tag == "select":
            self._select = None
        elif tag == "textarea":
            self._textarea = None

    def handle_data(self, data: str) -> None:
        if self._textarea:
            self.data[self._textarea] += data.removeprefix("\n") if not self.data[self._textarea] else data


def _opened_form(client: Any, url: str) -> dict[str, str]:
    """The change form at ``url`` as an operator opens it: the values a browser would post back."""
    page = client.get(url)
    assert page.status_code == 200, page.status_code
    parser = _FormValues()
    parser.feed(page.content.decode())
    return parser.data


def _catalog_race(a_kind: str, b_kind: str, key: str, user_id: int) -> dict[str, Any]:
    import httpx
    from django.contrib.auth.models import User
    from django.db import connection
    from django.test import Client

    from catalog import services
    from catalog.models import RenderConfig, ServedModel
    from fleet import probes

    model_dir = Path(tempfile.mkdtemp())
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 321}))
    if a_kind == "render_form":
        RenderConfig.objects.all().delete()  # the probes look at the first render config
        row: Any = RenderConfig.objects.create(name=f"{a_kind}-{b_kind}", host="127.0.0.1", port=8100)
    else:
        row = ServedModel.objects.create(name=f"{a_kind}-{b_kind}", model_path=str(model_dir))
    api = {"HTTP_AUTHORIZATION": f"Bearer {key}"}
    outcome: dict[str, Any] = {}

    def run_b() -> None:
        try:
            # Only the probe's database write is in question, not its HTTP: a canned failing tier.
            failing = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(500)))
            if b_kind == "render_health_probe":
                for _ in range(probes.thresholds().fall):
                    probes.probe_render_health(client=failing)
                outcome["b"] = RenderConfig.objects.get(id=row.id).health
            elif b_kind == "render_publish":  # another operator moves the sidecar: a restart is owed
                outcome["b"] = Client(raise_request_exception=False).post(
                    f"/api/render-configs/{row.id}/publish", {"port": 8111}, content_type="application/json", **api
                ).status_code
            elif b_kind == "sidecar_moved":  # the launcher's graceful restart: the replacement's port
                outcome["b"] = services.render_sidecar_moved(
                    config_id=row.id, expected={"host": "127.0.0.1", "port": 8100}, port=8112, actor="launcher"
                )
            elif b_kind == "revision_record":  # make run: the model files' fingerprints
                outcome["b"] = services.revision_record(served_model=row, model_dir=model_dir, actor="t").created
            elif b_kind == "version_probe":  # writes the vocabulary size from config.json
                probes.probe_versions(client=failing)
                outcome["b"] = ServedModel.objects.get(id=row.id).vocab_size
        except Exception as exc:
            outcome["b"] = f"{type(exc).__name__}: {exc}"
        finally:
            connection.close()

    wrapper, paused = _pause_before_writing(run_b, ("serving_renderconfig", "serving_servedmodel"))
    client = Client(raise_request_exception=False)
    client.force_login(User.objects.get(id=user_id))  # (writes a session: before the pause is armed)
    change_url = f"/admin/serving/{type(row).__name__.lower()}/{row.id}/change/"
    opened = _opened_form(client, change_url)  # the operator opens the form before B...
    edit = {"timeout_ms": "7000"} if a_kind == "render_form" else {"max_model_len": "4096"}
    try:
        with connection.execute_wrapper(wrapper):
            outcome["a"] = client.post(change_url, {**opened, **edit}).status_code  # ...and saves one change
    except Exception as exc:
        outcome["a"] = f"{type(exc).__name__}: {exc}"
    row.refresh_from_db()
    if a_kind == "render_form":
        fields = {"health": row.health, "timeout_ms": row.timeout_ms, "port": row.port, "restart_required": row.restart_required}
    else:
        fields = {"max_model_len": row.max_model_len, "vocab_size": row.vocab_size, "revision": row.active_revision_id is not None}
    return {**outcome, "paused": paused["paused"], **fields}


def main(races: str) -> None:
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
    if races == "catalog":
        results = {f"{a}+{b}": _catalog_race(a, b, key, user.id) for a, b in CATALOG_RACES}
    else:
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


def _play(database_url: str, races: str) -> dict[str, Any]:
    """Play ``races`` ("fleet" or "catalog") in a subprocess on ``database_url``; their outcomes."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "MOTOR_SQLITE_TIMEOUT_MS")}
    env.update(
        DATABASE_URL=database_url,
        DJANGO_SETTINGS_MODULE="motorsite.settings",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        ALLOWED_HOSTS="testserver",
        LOG_LEVEL="WARNING",
        MOTOR_PROBE_FALL="2",
    )
    done = subprocess.run(
        [sys.executable, __file__, races], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return results


def test_an_edit_or_a_write_back_from_a_stale_copy_loses_no_concurrent_flip(database_url: str) -> None:
    results = _play(database_url, "fleet")

    # Every race was played (A paused before writing, B finished meanwhile), and both writers'
    # changes stand: A's edit, and B's flip that A's stale copy must not revert. The write-back
    # decided before the reset is dropped: the operator's reset (epoch 1) stands. A form opened
    # before another operator's PATCH writes only the field changed in it.
    untouched = {
        "paused": True, "state": "active", "health": "unknown", "weight": 7, "token_capacity": 65536,
        "breaker": ["closed", 0],
    }
    assert results == {
        "api_patch+quarantine": {**untouched, "a": 200, "b": 200, "state": "quarantined"},
        "api_patch+health_probe": {**untouched, "a": 200, "b": "failing", "health": "failing"},
        "admin_form+drain": {**untouched, "a": 302, "b": 200, "state": "draining"},
        "admin_form+health_probe": {**untouched, "a": 302, "b": "failing", "health": "failing"},
        "breaker_writeback+breaker_reset": {**untouched, "a": "written", "b": 200, "weight": 1, "breaker": ["closed", 1]},
        "admin_form_opened+api_patch": {**untouched, "a": 302, "b": 200, "token_capacity": 999},
    }


def test_a_catalog_edit_from_a_stale_copy_loses_no_concurrent_write(database_url: str) -> None:
    results = _play(database_url, "catalog")

    # The admin form (opened before B, timeout_ms or max_model_len changed in it) and B both
    # stand: the render sidecar's probe verdict, another operator's publish of a new port (and
    # the restart it owes), the launcher's move to a replacement sidecar, the revision
    # ``revision_record`` made active and the vocabulary size the version probe wrote.
    render = {"a": 302, "paused": True, "health": "unknown", "timeout_ms": 7000, "port": 8100, "restart_required": False}
    model = {"a": 302, "paused": True, "max_model_len": 4096, "vocab_size": None, "revision": False}
    assert results == {
        "render_form+render_health_probe": {**render, "b": "failing", "health": "failing"},
        "render_form+render_publish": {**render, "b": 200, "port": 8111, "restart_required": True},
        "render_form+sidecar_moved": {**render, "b": True, "port": 8112},
        "model_form+revision_record": {**model, "b": True, "revision": True},
        "model_form+version_probe": {**model, "b": 321, "vocab_size": 321},
    }


if __name__ == "__main__":
    main(sys.argv[1])
