"""What the compose and k8s tests both read from a fleet script (``migrate && demo_fleet ...``):
its ``demo_fleet`` commands as argv (by served model), a flag's values in one, the render pool one
registers, and what the script writes when it runs here (``run_fleet_script``)."""

from __future__ import annotations

import contextlib
import os
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]


def fleet_commands(script: str) -> list[list[str]]:
    """The ``demo_fleet`` commands of a fleet script, each as argv, after its migration."""
    steps = [shlex.split(step) for step in script.split("&&")]
    assert steps[0] == ["python", "manage.py", "migrate", "--noinput", "-v", "0"]
    assert all(step[:3] == ["python", "manage.py", "demo_fleet"] for step in steps[1:]), steps
    return steps[1:]


def values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def commands_by_model(script: str) -> dict[str, list[str]]:
    """The ``demo_fleet`` commands of a fleet script by served model, ``tiny`` then ``tiny-b``: the
    first model's command writes the fleet; the second only adds its own rows beside it."""
    commands = {values(argv, "--served-model-name")[0]: argv for argv in fleet_commands(script)}
    assert list(commands) == ["tiny", "tiny-b"]
    assert "--only-this-model" not in commands["tiny"] and "--only-this-model" in commands["tiny-b"]
    return commands


def render_pool(argv: list[str]) -> tuple[list[str], list[str]]:
    """The render pool a ``demo_fleet`` command registers, each ``host:port``: the render config's
    own address, and its other members."""
    config = [f"{h}:{p}" for h, p in zip(values(argv, "--render-host"), values(argv, "--render-port"), strict=True)]
    return config, values(argv, "--render-member")


class Registered(NamedTuple):
    """What a fleet script wrote to its database."""

    pools: list[tuple[str, str, int]]  # each render pool member: (model, host, port), in the order written
    engines: list[tuple[str, str]]  # each engine: (model, url), by url
    active: list[str]  # the active served models, in the order written


def run_fleet_script(script: str, env: dict[str, str], db: Path) -> Registered:
    """Run a deployment's fleet script (``sh -c``) here on the SQLite database ``db``, with ``env``
    and the models this host built in place of the containers' ``/model`` and ``/model-b`` (the
    test is skipped without them); returns what it registered (a refused address fails the run)."""
    models = {"/model-b": os.environ.get("MOTOR_MODEL_B_DIR", ""), "/model": os.environ.get("MOTOR_MODEL_DIR", "")}
    if not all(models.values()):
        pytest.skip("MOTOR_MODEL_DIR and MOTOR_MODEL_B_DIR (python3 -m toolchain exec sets them)")
    for container, host in models.items():
        script = script.replace(f" {container} ", f" {host} ")
    env = {**env, "DATABASE_URL": f"sqlite:///{db}",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}
    done = subprocess.run(["sh", "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with contextlib.closing(sqlite3.connect(db)) as conn:
        pools = conn.execute(
            "SELECT m.name, s.host, s.port FROM serving_rendersidecar s JOIN serving_renderconfig c"
            " ON s.render_config_id = c.id JOIN serving_servedmodel m ON c.served_model_id = m.id ORDER BY s.id"
        ).fetchall()
        engines = conn.execute(
            "SELECT m.name, e.url FROM fleet_engineinstance e JOIN serving_servedmodel m ON e.served_model_id = m.id"
            " ORDER BY e.url"
        ).fetchall()
        active = conn.execute("SELECT name FROM serving_servedmodel WHERE state = 'active' ORDER BY id").fetchall()
    return Registered(pools, engines, [name for name, in active])
