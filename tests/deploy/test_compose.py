"""docker/compose.yaml runs what ``make run`` runs: held against motorsite.stack's process specs.

Bringing the file up takes image builds and minutes of vLLM start-ups (docker/up.sh and
docker/smoke.py do it, outside make test; docs/deploying.md records the run), so these are static checks: docker-compose's own schema check of the file, and every process ``make run`` starts is a compose service with the same
arguments, environment and readiness request, up to the differences a container implies (bind
0.0.0.0, the model at /model, ``taskset`` as ``cpuset``, the repository at /app), each named here.
"""

from __future__ import annotations

import ast
import io
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command

from catalog.management.commands.render_image import DEFAULT_RENDER_IMAGE
from catalog.models import RenderConfig
from fleet.ascend import EngineRecord, launch_config
from motorsite import stack, tiers
from motorsite.settings import check_secret_key
from motorsite.supervisor import ProcessSpec
from tests.deploy.fleet_script import commands_by_model, render_pool, run_fleet_script, values

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
# What compose passes where make run passes a local value (kept literal: compose interpolates it).
DATABASE_URL = "postgresql://motorsite:${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD to a generated password}@postgres:5432/motorsite"
REDIS_URL = "redis://redis:6379/0"
API_KEY = "${MOTOR_DEMO_API_KEY:?set a client key}"
VLLM_PREFIX = ["python", "-m", "vllm.entrypoints.cli.main"]  # the vLLM image's ENTRYPOINT
DOCKER_COMPOSE = shutil.which("docker-compose")
STRONG_KEY = "compose-test-" + "0123456789abcdefghijklmnopqrstuvwxyzABCDEF"  # passes check_secret_key
# What the file's header tells a user to export, generated the way it says.
USER_ENV = {
    "SECRET_KEY": STRONG_KEY,
    "MOTOR_DEMO_API_KEY": "sk-" + secrets.token_urlsafe(32),
    "POSTGRES_PASSWORD": secrets.token_urlsafe(16),
}


@pytest.fixture
def specs(monkeypatch: pytest.MonkeyPatch) -> dict[str, ProcessSpec]:
    # The compose file is written for a 2-core host, as make run's pinning is on this one.
    monkeypatch.setattr(stack.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(tiers, "check_engine_cpu", lambda: None)
    return {spec.name: spec for spec in stack.build_specs(TWO_MODELS)}


# The fleet compose runs, as make run's stack: two models, each a render pool of two sidecars.
TWO_MODELS = stack.StackConfig(
    model_dir="/model", render_python="python", engine_python="python", app_python="python", engines="vllm",
    database_url=DATABASE_URL, redis_url=REDIS_URL, api_keys=(API_KEY,), celery_dir=Path("/data/celery"),
    render_member_ports=(8101,),
    extra_models=(stack.ExtraModel("tiny-b", "/model-b", 8102, (8203,), render_member_ports=(8103,)),),
)


def in_container(spec: ProcessSpec) -> tuple[list[str], str | None]:
    """The spec's argv as the container runs it, and the core it was pinned to."""
    argv, core = list(spec.argv), None
    if argv[0] == "taskset":
        core, argv = argv[2], argv[3:]
    if argv[:3] == VLLM_PREFIX:
        argv = argv[3:]
    for flag in ("--host", "-b"):  # a container binds all its interfaces; its network is its own
        if flag in argv:
            argv[argv.index(flag) + 1] = "0.0.0.0"
    # The worker's node name carries a fresh id per make run; one name per container is enough.
    return [re.sub(r"^motor-[0-9a-f]+@%h$", "motor@%h", a) for a in argv], core


def expected_env(spec: ProcessSpec) -> dict[str, str]:
    env = dict(spec.env)
    if "PYTHONPATH" in env:
        env["PYTHONPATH"] = {str(tiers.ENGINE_SITE_DIR): "/opt/motorsite/engine_site", str(stack.ROOT): "/app",
                             str(tiers.RENDER_SITE_DIR): "/opt/motorsite/render_site"}[env["PYTHONPATH"]]
    if "MOTOR_METASERVER_BASE_URL" in env:
        env["MOTOR_METASERVER_BASE_URL"] = "http://coordinator:8000"
    if "MOTOR_CELERY_READY_FILE" in env:
        env["MOTOR_CELERY_READY_FILE"] = "/tmp/celery-ready"
    return env


def health_request(service: dict[str, Any]) -> tuple[str, Any]:
    """The URL and JSON body a service's healthcheck posts (or gets: body None)."""
    test = " ".join(service["healthcheck"]["test"][1:])
    url = re.search(r"'(http://[^']+)'", test)
    assert url, test
    body = re.search(r"json\.dumps\((\{.*\})\)\.encode", test)
    return url.group(1), ast.literal_eval(body.group(1)) if body else None


def test_every_make_run_process_is_a_compose_service(specs: dict[str, ProcessSpec]) -> None:
    assert set(specs) <= set(SERVICES), set(specs) - set(SERVICES)
    # Beyond make run: the servers it finds on the host, the migration step, and Ascend (a profile).
    extra = set(SERVICES) - set(specs)
    assert extra == {"postgres", "redis", "migrate", "ascend-prefill-1", "ascend-decode-1"}
    started_by_default = {name for name, s in SERVICES.items() if not s.get("profiles")}
    assert started_by_default == set(specs) | {"postgres", "redis", "migrate"}


def test_each_service_runs_the_same_command_and_environment(specs: dict[str, ProcessSpec]) -> None:
    for name, spec in specs.items():
        service = SERVICES[name]
        argv, core = in_container(spec)
        assert [str(a) for a in service["command"]] == argv, name
        assert (str(service["cpuset"]) if "cpuset" in service else None) == core, name
        env = {k: str(v) for k, v in service["environment"].items()}
        missing = {k: v for k, v in expected_env(spec).items() if env.get(k) != v}
        assert not missing, (name, missing, {k: env.get(k) for k in missing})


def test_each_service_is_checked_by_the_request_make_run_checks_it_with(specs: dict[str, ProcessSpec]) -> None:
    for name, spec in specs.items():
        service = SERVICES[name]
        if spec.ready_post is not None:
            path, body = spec.ready_post
            port = spec.ready_base_url.rsplit(":", 1)[1]
            assert health_request(service) == (f"http://127.0.0.1:{port}{path}", body), name
        elif spec.ready_url is not None:
            assert health_request(service) == (spec.ready_url, None), name
        else:  # Celery: make run waits for the ready file; the worker's check also pings it through the broker
            test = " ".join(service["healthcheck"]["test"])
            assert "/tmp/celery-ready" in test or "inspect ping" in test, name


def test_the_fleet_registered_is_the_fleet_started(specs: dict[str, ProcessSpec]) -> None:
    # decode-1 lives in prefill-1's network namespace, so it is reached at prefill-1.
    hosts = {name: SERVICES[name].get("network_mode", f"service:{name}").split(":", 1)[1] for name in specs}
    for model, argv in commands_by_model(SERVICES["migrate"]["command"][-1]).items():
        mine = {n: s for n, s in specs.items() if values(s.argv, "--served-model-name") == [model]}
        renders = [n for n in mine if n.startswith("render")]
        assert len(renders) == 2, renders  # a pool of two sidecars per model
        # Each member by its own address: the first as the render config's, the others as members.
        addresses = [f"{hosts[n]}:{mine[n].ports[0][1]}" for n in renders]
        assert render_pool(argv) == (addresses[:1], addresses[1:])
        assert values(argv, "--model-dir") == [SERVICES[renders[0]]["command"][3]]
        for flag, role in (("--engine", "engine"), ("--prefill", "prefill"), ("--decode", "decode")):
            names = sorted(n for n in mine if n.startswith(role + "-"))
            assert values(argv, flag) == [f"http://{hosts[n]}:{mine[n].ports[0][1]}" for n in names], (model, flag)
    # The container side is make run's port; the host side is the operator's (docker/up.sh PORT).
    assert SERVICES["coordinator"]["ports"] == ["${MOTOR_BIND:-127.0.0.1}:${MOTOR_PORT:-8000}:8000"]
    assert specs["coordinator"].ready_url == "http://127.0.0.1:8000/healthz"


def test_the_migrate_service_registers_each_models_pool_and_engines(tmp_path: Path) -> None:
    # The migrate service's own script, run here on SQLite with the models on this host: what it
    # registers is what the coordinator serves (a refused address would stop the bring-up).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOTOR_", "DATABASE_URL", "REDIS_URL", "SECRET_KEY"))}
    env.update(PYTHONPATH=str(ROOT), MOTOR_VAR_DIR=str(tmp_path), MOTOR_CELERY_DIR=str(tmp_path / "celery"),
               SECRET_KEY=STRONG_KEY)
    pools, engines, active = run_fleet_script(SERVICES["migrate"]["command"][-1], env, tmp_path / "db.sqlite3")
    assert pools == [("tiny", "render", 8100), ("tiny", "render-member-2", 8101),
                     ("tiny-b", "render-tiny-b", 8102), ("tiny-b", "render-tiny-b-member-2", 8103)]
    assert sorted(engines) == [
        ("tiny", "http://engine-1:8201"), ("tiny", "http://engine-2:8202"), ("tiny", "http://prefill-1:8211"),
        ("tiny", "http://prefill-1:8221"), ("tiny-b", "http://engine-tiny-b-1:8203"),
    ]
    assert active == ["tiny", "tiny-b"]


def test_the_coordinator_is_published_on_the_operators_port_on_loopback(tmp_path: Path, generated: Generated) -> None:
    if DOCKER_COMPOSE is None:
        pytest.skip("no docker-compose: `python3 -m toolchain ensure docker-compose` installs it (as root)")
    published = {None: generated.services["coordinator"]["ports"]}  # MOTOR_PORT and MOTOR_BIND unset
    done = compose_config(tmp_path, **USER_ENV, MOTOR_PORT="18123")
    assert done.returncode == 0, done.stderr
    published["18123"] = yaml.safe_load(done.stdout)["services"]["coordinator"]["ports"]
    assert published == {None: ["127.0.0.1:8000:8000/tcp"], "18123": ["127.0.0.1:18123:8000/tcp"]}


def test_the_ascend_services_run_what_fleet_ascend_makes() -> None:
    common = dict(served_model_id=1, served_model_name="tiny", model_path="/model", hardware="A3",
                  kv_connector="MooncakeConnector", kv_transfer="", max_model_len=2048)
    p = EngineRecord(name="ascend-prefill-1", role="prefill", host="ascend-prefill-1", http_port=8301, kv_port=36000, tp=2, **common)
    d = EngineRecord(name="ascend-decode-1", role="decode", host="ascend-decode-1", http_port=8302, kv_port=36200, **common)
    for record, peer in ((p, d), (d, p)):
        launch = launch_config(record, [peer])
        service = SERVICES[record.name]
        assert service["command"] == launch.argv and service.get("environment", {}) == launch.env
        assert service["profiles"] == ["ascend"]
        assert health_request(service)[0] == f"http://127.0.0.1:{record.http_port}/inference/v1/generate"


def test_the_sidecar_image_is_the_render_configs(db: None) -> None:
    assert SERVICES["render"]["image"] == "${MOTOR_RENDER_IMAGE:-" + DEFAULT_RENDER_IMAGE + "}"
    out = io.StringIO()
    call_command("render_image", stdout=out)
    assert out.getvalue().strip() == DEFAULT_RENDER_IMAGE  # no render config yet
    RenderConfig.objects.create(image_name="registry.example/render:0.33.0-custom")
    out = io.StringIO()
    call_command("render_image", stdout=out)
    assert out.getvalue().strip() == "registry.example/render:0.33.0-custom"


def test_the_compose_file_passes_compose_s_own_schema_check(tmp_path: Path) -> None:
    # docker-compose parses and validates without a Docker engine; the toolchain installs it for the suite.
    if DOCKER_COMPOSE is None:
        pytest.skip("no docker-compose: `python3 -m toolchain ensure docker-compose` installs it (as root)")
    env = {**os.environ, "MOTOR_MODEL_DIR": str(tmp_path), "MOTOR_MODEL_B_DIR": str(tmp_path), **USER_ENV}
    for profile in ([], ["--profile", "ascend"]):
        done = subprocess.run(
            [DOCKER_COMPOSE, "-f", str(ROOT / "docker" / "compose.yaml"), *profile, "config", "--services"],
            env=env, capture_output=True, text=True, timeout=60,
        )
        assert done.returncode == 0, done.stderr
        # Compose 1.29 lists profiled services too; which start by default is checked above.
        assert set(done.stdout.split()) == set(SERVICES)
    # And it does refuse what it does not know (the check above can fail).
    bad = tmp_path / "compose.yaml"
    bad.write_text((ROOT / "docker" / "compose.yaml").read_text().replace('    cpuset: "1"', '    cpusett: "1"', 1))
    done = subprocess.run([DOCKER_COMPOSE, "-f", str(bad), "config", "-q"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "cpusett" in done.stderr


def test_the_app_services_need_a_secret_key_the_settings_accept(tmp_path: Path, generated: Generated) -> None:
    if DOCKER_COMPOSE is None:
        pytest.skip("no docker-compose: `python3 -m toolchain ensure docker-compose` installs it (as root)")
    done = compose_config(tmp_path, **{k: v for k, v in USER_ENV.items() if k != "SECRET_KEY"})
    assert done.returncode != 0 and "set SECRET_KEY to 50 or more random characters" in done.stderr
    assert USER_ENV["SECRET_KEY"] == STRONG_KEY  # what the shared run below was given
    services = generated.services
    keys = {name: s["environment"]["SECRET_KEY"] for name, s in services.items() if "SECRET_KEY" in s.get("environment", {})}
    assert set(keys) == {"migrate", "celery-worker", "celery-beat", "coordinator"}
    assert {check_secret_key(k) for k in keys.values()} == {STRONG_KEY}


def test_the_coordinator_names_its_replica() -> None:
    # motor_coordinator_info{replica}; the default keeps a plain `up` naming it after its service.
    assert SERVICES["coordinator"]["environment"]["MOTOR_REPLICA"] == "${MOTOR_REPLICA-coordinator}"


def compose_config(tmp_path: Path, **user: str) -> subprocess.CompletedProcess[str]:
    """``docker-compose config`` with the user's values only (none of this shell's secrets, port or bind)."""
    env = {k: v for k, v in os.environ.items() if k not in {*USER_ENV, "MOTOR_PORT", "MOTOR_BIND"}}
    env.update(MOTOR_MODEL_DIR=str(tmp_path), MOTOR_MODEL_B_DIR=str(tmp_path), **user)
    return subprocess.run([DOCKER_COMPOSE or "docker-compose", "-f", str(ROOT / "docker" / "compose.yaml"), "config"],
                          env=env, capture_output=True, text=True, timeout=60)


class Generated:
    """The file as compose interpolates it with the secrets its header says to generate, and the
    coordinator's settings loaded from it: run once for the module (each docker-compose and each
    Django start costs about a second of CPU), each test asserting what it needs of it."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        done = compose_config(tmp_path, **USER_ENV)
        assert done.returncode == 0, done.stderr
        self.services: dict[str, dict[str, Any]] = yaml.safe_load(done.stdout)["services"]
        self._settings: subprocess.CompletedProcess[str] | None = None

    def settings_load(self) -> subprocess.CompletedProcess[str]:
        if self._settings is None:
            self._settings = load_settings(coordinator_env(self.services, self.tmp_path))
        return self._settings


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Generated:
    if DOCKER_COMPOSE is None:
        pytest.skip("no docker-compose: `python3 -m toolchain ensure docker-compose` installs it (as root)")
    return Generated(tmp_path_factory.mktemp("generated"))


@pytest.mark.parametrize("name", sorted(USER_ENV))
def test_compose_ships_no_secret_and_needs_each_one(tmp_path: Path, name: str) -> None:
    # It once defaulted the database password to "motorsite"; now every secret is the user's.
    if DOCKER_COMPOSE is None:
        pytest.skip("no docker-compose: `python3 -m toolchain ensure docker-compose` installs it (as root)")
    done = compose_config(tmp_path, **{k: v for k, v in USER_ENV.items() if k != name})
    assert done.returncode != 0 and name in done.stderr


def test_compose_needs_the_second_models_directory(tmp_path: Path) -> None:
    if DOCKER_COMPOSE is None:
        pytest.skip("no docker-compose: `python3 -m toolchain ensure docker-compose` installs it (as root)")
    env = {k: v for k, v in os.environ.items() if k != "MOTOR_MODEL_B_DIR"}
    env.update(MOTOR_MODEL_DIR=str(tmp_path), **USER_ENV)
    done = subprocess.run([DOCKER_COMPOSE, "-f", str(ROOT / "docker" / "compose.yaml"), "config", "-q"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "python3 -m toolchain path model-b" in done.stderr, done.stderr


def app_env(tmp_path: Path, **user: str) -> dict[str, str]:
    """The coordinator container's environment as compose interpolates it, run from this checkout."""
    done = compose_config(tmp_path, **user)
    assert done.returncode == 0, done.stderr
    return coordinator_env(yaml.safe_load(done.stdout)["services"], tmp_path)


def coordinator_env(services: dict[str, dict[str, Any]], tmp_path: Path) -> dict[str, str]:
    env = services["coordinator"]["environment"]
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("MOTOR_", "SECRET_KEY", "DATABASE_URL", "REDIS_URL"))}
    return {**inherited, **{k: str(v) for k, v in env.items()}, "PYTHONPATH": str(ROOT), "MOTOR_VAR_DIR": str(tmp_path),
            "MOTOR_CELERY_DIR": str(tmp_path / "celery")}


def load_settings(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "import django; django.setup()"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MOTOR_DEMO_API_KEY", "sk-..."),  # the header's example before it said how to generate one
        ("MOTOR_DEMO_API_KEY", "sk-test"),
        ("SECRET_KEY", "change-me-to-the-output-of-secrets-token-urlsafe-50-before-applying"),
        ("POSTGRES_PASSWORD", "change-me"),
    ],
)
def test_the_app_services_refuse_a_weak_or_placeholder_secret(tmp_path: Path, generated: Generated, name: str, value: str) -> None:
    if DOCKER_COMPOSE is None:
        pytest.skip("no docker-compose: `python3 -m toolchain ensure docker-compose` installs it (as root)")
    done = load_settings(app_env(tmp_path, **{**USER_ENV, name: value}))
    assert done.returncode != 0 and "ImproperlyConfigured" in done.stderr, done.stderr[-1500:]
    assert "generate one with python3 -c" in done.stderr
    # ...and the values the header says to generate start (the refusal above can fail).
    done = generated.settings_load()
    assert done.returncode == 0, done.stderr[-1500:]
