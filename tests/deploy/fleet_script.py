"""What the compose and k8s tests both read from a fleet script (``migrate && demo_fleet ...``):
its ``demo_fleet`` commands as argv, and a flag's values in one."""

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
