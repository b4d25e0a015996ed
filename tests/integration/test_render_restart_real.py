"""A graceful render sidecar restart with a stream kept alive across it, through real processes.

The launcher side is a miniature ``make run``: a child process that starts the real vLLM render
sidecar under a Supervisor and runs ``RenderRestarter.tick`` in ``Supervisor.wait``, on the
same SQLite database as a real coordinator (Daphne) in front of one simulated engine that
produces a token every 150 ms. The test holds a stream open, publishes a worker-count change
through the REST API, and checks that the old sidecar outlives the switch while the stream
still derenders on it, and is retired soon after the stream ends, long before the cap.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from motorsite import stack
from motorsite.supervisor import ProcessSpec, Supervisor, free_port, together
from tests.integration.conftest import API_KEY

from . import early

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # two real sidecars start

ADMIN_KEY = "mk-test-" + uuid.uuid4().hex[:12]
DRAIN_CAP_S = 600.0  # far beyond the test: a retirement seen here is the zero count's, not the cap's

LAUNCHER = """
import json, logging, sys
from pathlib import Path
import django
django.setup()
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s %(message)s")
from motorsite import stack
from motorsite.supervisor import Supervisor
from motorsite.launcher.render_restarter import RenderRestarter
opts = json.loads(sys.argv[1])
cfg = stack.StackConfig(
    model_dir=opts["model_dir"], render_python=opts["render_python"], engine_python=opts["render_python"],
    render_port=opts["render_port"], log_dir=Path(opts["log_dir"]),
)
with Supervisor([stack.render_spec(cfg)]) as sup:
    Path(opts["ready_file"]).write_text(json.dumps(sup.pids))
    sup.wait(tick=RenderRestarter(sup, cfg, drain_s=opts["drain_s"]).tick, tick_interval=0.2)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def health(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def query(db: str, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db, timeout=10) as conn:
        return conn.execute(sql).fetchall()


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


@dataclass(frozen=True)
class Launched:
    cfg: stack.StackConfig
    db: str
    tmp: Path  # the database and the launcher's ready file


def _launched(base: stack.StackConfig) -> tuple[early.Prepared, Launched]:
    """The simulated engine and the launcher (its sidecar), on a database written first: they
    need nothing of each other, so they start together."""
    tmp = Path(tempfile.mkdtemp(prefix="motorsite-render-restart-"))
    db = str(tmp / "coordinator.sqlite3")
    cfg = replace(
        base, engines="sim", render_port=free_port(), engine_ports=(free_port(),), prefill_ports=(),
        decode_ports=(), coordinator_port=free_port(), database_url=f"sqlite:///{db}", celery=False,
        log_dir=base.log_dir / "render-restart", extra_env={"MOTOR_DEMO_ADMIN_KEY": ADMIN_KEY},
    )
    engine = stack.engine_specs(cfg)[0]
    # A token every 150 ms and no EOS: the stream lives for minutes unless the test ends it.
    engine = replace(engine, argv=[*engine.argv, "--tpot-ms", "150", "--eos-probability", "0"])
    ready_file = tmp / "launcher-ready.json"
    opts = {
        "model_dir": cfg.model_dir, "render_python": cfg.render_python, "render_port": cfg.render_port,
        "log_dir": str(cfg.log_dir), "ready_file": str(ready_file), "drain_s": DRAIN_CAP_S,
    }
    launcher = ProcessSpec(
        name="launcher", argv=[sys.executable, "-c", LAUNCHER, json.dumps(opts)],
        env=stack.coordinator_env(cfg), cwd=stack.ROOT, log_path=cfg.log_dir / "launcher.log",
        ready_argv=["test", "-f", str(ready_file)], ready_timeout=300.0, stop_timeout=60.0,
    )
    # The database before the launcher: its first tick reads the render config.
    return early.Prepared(lambda: stack.prepare_database(cfg), together([engine, launcher])), Launched(cfg, db, tmp)


# Begun in the background while the tests before this module run (tests/integration/early.py).
LAUNCHED = early.rig("render-restart", _launched, fixture="launched", module=str(Path(__file__).resolve()))


@pytest.fixture
def launched(base_config: stack.StackConfig) -> Iterator[Launched]:
    try:
        with LAUNCHED.running(base_config) as (found, _):
            yield found
    finally:
        if LAUNCHED.value is not None:
            shutil.rmtree(LAUNCHED.value.tmp, ignore_errors=True)


def test_a_stream_kept_alive_across_a_restart_keeps_the_old_sidecar_until_it_ends(launched: Launched) -> None:
    cfg, db, ready_file = launched.cfg, launched.db, launched.tmp / "launcher-ready.json"
    old_port, old_url = cfg.render_port, f"http://127.0.0.1:{cfg.render_port}"
    with Supervisor([stack.coordinator_spec(cfg)]) as coordinator:
        old_pid = json.loads(ready_file.read_text())["render"]
        coordinator_pid = coordinator.pids["coordinator"]
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(base_url=cfg.coordinator_url, timeout=60, trust_env=False) as client:
            config_id = client.get("/api/render-configs", headers=admin).json()[0]["id"]
            body = {"model": cfg.served_model_name, "messages": [{"role": "user", "content": "Tell a story"}],
                    "stream": True, "max_tokens": 2000}
            with client.stream("POST", "/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {API_KEY}"}) as response:
                assert response.status_code == 200
                published_at = switched_at = None
                after_switch = 0
                next_check = 0.0
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    assert line != "data: [DONE]", "the stream ended before the test was done with it"
                    chunk = json.loads(line[len("data: "):])
                    assert "error" not in chunk, chunk  # every chunk derendered, before and after the switch
                    now = time.monotonic()
                    if switched_at is not None and now > switched_at + 1:
                        after_switch += 1
                    if now < next_check:
                        continue
                    next_check = now + 0.5
                    if published_at is None:
                        # The coordinator's reporter has written the stream against the old sidecar.
                        rows = query(db, f"SELECT counts FROM serving_renderstreamreport WHERE pid = {coordinator_pid}")
                        if rows and json.loads(rows[0][0]).get(old_url) == 1:
                            published = client.post(f"/api/render-configs/{config_id}/publish", headers=admin,
                                                    json={"renderer_num_workers": 2})
                            assert published.status_code == 200 and published.json()["restart_required"]
                            published_at = now
                        continue
                    if switched_at is None:
                        # The replacement (a second real sidecar) is up once the config points at it.
                        if query(db, "SELECT port FROM serving_renderconfig")[0][0] != old_port:
                            switched_at = now
                        continue
                    assert alive(old_pid) and health(old_port), "the old sidecar was retired under a live stream"
                    if now > switched_at + 8 and after_switch >= 20:
                        break  # well past RENDER_SETTLE_S, still derendering on the old sidecar
            closed_at = time.monotonic()  # the client hung up: the stream ends, its hold is released

        wait_for("the old sidecar to be retired", lambda: not alive(old_pid), timeout=30)
        assert time.monotonic() - closed_at < DRAIN_CAP_S / 10
        assert not health(old_port)
        wait_for("the restart flag to be cleared",
                 lambda: query(db, "SELECT restart_required FROM serving_renderconfig") == [(0,)], timeout=10)
        rows = query(db, f"SELECT counts FROM serving_renderstreamreport WHERE pid = {coordinator_pid}")
        assert json.loads(rows[0][0]).get(old_url, 0) == 0
        # New requests are served through the replacement.
        with httpx.Client(base_url=cfg.coordinator_url, timeout=60, trust_env=False) as client:
            answer = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                                 json={"model": cfg.served_model_name, "max_tokens": 4,
                                       "messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
