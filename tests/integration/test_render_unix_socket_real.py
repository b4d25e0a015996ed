"""A real vLLM render sidecar on a unix socket only (``vllm launch render --uds``) behind the real
coordinator (Daphne on a socket), driven with the official ``openai`` client.

The sidecar binds no TCP port: its member is ``unix:/.../render-PORT.sock``, the coordinator's
client reaches it at ``http+unix://`` (``serving.pipeline.http11``), and the supervisor's
readiness check and the fleet's probes speak to it over the socket too. The engine is the
project's simulator (greedy, no EOS), so a whole answer and a stream of the same prompt carry the
same text. Killing the sidecar leaves its socket file behind; a start in its place must remove
it (bind() refuses an existing path) and be found ready over the socket.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from motorsite import stack, unix_http
from motorsite.processes import can_bind
from motorsite.supervisor import ProcessSpec, Supervisor, free_port, together
from tests.integration.conftest import API_KEY

from . import early

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ADMIN_KEY = "mk-test-" + uuid.uuid4().hex[:12]


class Site:
    def __init__(self, cfg: stack.StackConfig, pids: dict[str, int]) -> None:
        self.cfg = cfg
        self.pids = pids
        self.api = httpx.Client(base_url=cfg.coordinator_url, timeout=30, trust_env=False,
                                headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        self.client = openai.OpenAI(base_url=cfg.coordinator_url + "/v1", api_key=API_KEY, max_retries=0)

    def socket(self) -> str:
        assert self.cfg.render_socket_dir is not None
        return str(self.cfg.render_socket_dir.resolve() / f"render-{self.cfg.render_port}.sock")

    def ask(self, word: str) -> str:
        out = self.client.chat.completions.create(
            model=self.cfg.served_model_name, messages=[{"role": "user", "content": f"Tell a story about {word}"}],
            max_tokens=12, temperature=0,
        )
        assert out.choices[0].finish_reason == "length"
        return out.choices[0].message.content or ""

    def stream(self, word: str) -> str:
        text, finish = [], None
        for chunk in self.client.chat.completions.create(
            model=self.cfg.served_model_name, messages=[{"role": "user", "content": f"Tell a story about {word}"}],
            max_tokens=12, temperature=0, stream=True,
        ):
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        assert finish == "length"
        return "".join(text)

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.cfg.coordinator_url + "/metrics", timeout=10, trust_env=False).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def _tiers(base: stack.StackConfig) -> tuple[list[ProcessSpec], stack.StackConfig]:
    """The sidecar on its socket and the simulated engine, started together."""
    # A short directory: a unix socket's path is at most 107 bytes.
    sockets = Path(tempfile.mkdtemp(prefix="motor-uds-"))
    cfg = replace(
        base, engines="sim", render_port=free_port(), render_member_ports=(),
        render_socket_dir=sockets / "run", engine_ports=(free_port(),), prefill_ports=(), decode_ports=(),
        coordinator_port=free_port(), celery=False, restart=None,
        log_dir=base.log_dir / "render-uds", extra_env={"MOTOR_DEMO_ADMIN_KEY": ADMIN_KEY},
    )
    engine = replace(stack.engine_specs(cfg)[0], ready_timeout=120.0)
    return together([*stack.render_specs(cfg), engine]), cfg


# Begun in the background while the tests before this module run (tests/integration/early.py).
TIERS = early.rig("render-uds", _tiers, fixture="site", module=str(Path(__file__).resolve()))


@pytest.fixture(scope="module")
def site(base_config: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    db = tmp_path_factory.mktemp("render-uds") / "coordinator.sqlite3"
    try:
        with TIERS.running(base_config) as (cfg, tiers):
            cfg = replace(cfg, database_url=f"sqlite:///{db}")
            stack.prepare_database(cfg)
            with Supervisor([stack.coordinator_spec(cfg)]):
                yield Site(cfg, dict(tiers.pids))
    finally:
        sockets = TIERS.value.render_socket_dir if TIERS.value is not None else None
        if sockets is not None:  # the short directory ``_tiers`` made
            shutil.rmtree(sockets.parent, ignore_errors=True)


def test_the_sidecar_listens_on_a_private_unix_socket_only(site: Site) -> None:
    assert site.cfg.render_socket_dir is not None
    assert stat.S_IMODE(site.cfg.render_socket_dir.stat().st_mode) == 0o700
    assert stat.S_ISSOCK(os.stat(site.socket()).st_mode)
    assert can_bind(stack.HOST, site.cfg.render_port)  # nothing on its port
    [member] = site.api.get("/api/render-configs").json()[0]["sidecars"]
    assert (member["host"], member["port"], member["address"]) == (f"unix:{site.socket()}", 0, f"unix:{site.socket()}")
    assert member["base_url"].startswith("http+unix://%2F")


def test_render_and_streamed_derender_go_over_the_unix_socket(site: Site) -> None:
    render_ok = site.metric("motor_render_outcomes_total", source="render")
    local = site.metric("motor_render_outcomes_total", source="local")
    whole = site.ask("sockets")
    streamed = site.stream("sockets")
    assert whole and streamed == whole
    assert site.metric("motor_render_outcomes_total", source="render") == render_ok + 2
    assert site.metric("motor_render_outcomes_total", source="local") == local  # no fallback


PROBES = """
from fleet.probes import probe_render_health, probe_versions
from fleet.render_pool_probes import probe_render_pool
versions = probe_versions()
print(sorted(probe_render_pool().values()), probe_render_health().ok, versions.render_version, versions.errors)
"""


def test_the_fleet_probes_read_the_sidecar_over_its_socket(site: Site) -> None:
    """The Celery tasks' code (the pool's, the config's health and the version probe), run against
    the coordinator's database."""
    env = {**os.environ, **stack.coordinator_env(site.cfg)}
    out = subprocess.run(
        [site.cfg.app_python, str(stack.ROOT / "manage.py"), "shell", "-c", PROBES],
        env=env, cwd=stack.ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[True] True 0.33.0 {}"
    [member] = site.api.get("/api/render-configs").json()[0]["sidecars"]
    assert member["sidecar_version"] == "0.33.0" and member["capabilities"]["streaming_derender"]


def test_a_sidecar_started_in_place_of_a_killed_one_binds_its_socket_and_serves(site: Site) -> None:
    os.killpg(site.pids["render"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while unix_http.socket_answers(site.socket()):
        assert time.monotonic() < deadline, "the killed sidecar still answers"
        time.sleep(0.1)
    assert os.path.exists(site.socket())  # the dead sidecar's file: bind() would refuse it
    with pytest.raises(httpx.ConnectError):
        with httpx.Client(transport=httpx.HTTPTransport(uds=site.socket()), trust_env=False) as c:
            c.get("http://localhost/health", timeout=5)
    # The supervisor's start removes the stale file, and its readiness check (a real chat render)
    # answers over the socket.
    with Supervisor(stack.render_specs(site.cfg)):
        assert site.stream("restarts") == site.ask("restarts")

