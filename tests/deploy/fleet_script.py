"""What the compose and k8s tests both read from a fleet script (``migrate && demo_fleet ...``):
its ``demo_fleet`` commands as argv (by served model), a flag's values in one, and the render
pool one registers."""

from __future__ import annotations

import shlex


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
