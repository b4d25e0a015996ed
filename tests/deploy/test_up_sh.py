"""docker/up.sh weighs Docker's cgroup-v1 cpu group while ``docker-compose up -d`` runs, not after.

``up -d`` returns only once the coordinator's dependencies are healthy (the sidecars' real
renders), and on a busy host they are not until the group is weighed; run for real here, the
containers got about 2 % of a core each until the group was weighed by hand (docs/deploying.md).
The script's own bring-up lines run in ``sh`` with ``compose`` stubbed: its ``up -d`` returns
only once the shares file holds 1024 per container, as the healthchecks did.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UP_SH = (ROOT / "docker" / "up.sh").read_text()
# A stand-in for docker-compose: three containers, and an `up -d` that finishes only once the
# group is weighed for them (or gives up, as the real one never would, after 20 s).
COMPOSE_STUB = r"""
compose() {
    case "$*" in
        "ps -q") printf 'a\nb\nc\n' ;;
        "up -d")
            for _ in $(seq 200); do [ "$(cat "$MOTOR_DOCKER_CPU_SHARES_FILE")" = 3072 ] && return 0; sleep 0.1; done
            echo "up -d: the sidecars never became healthy" >&2; return 1 ;;
        *) echo "unexpected: compose $*" >&2; return 2 ;;
    esac
}
log() { echo "$*" >&2; }
"""


def functions(*names: str) -> str:
    """The definitions of up.sh's shell functions ``names`` written over several lines (each ends
    at a line that is ``}``)."""
    found = {m.group(1): m.group(0) for m in re.finditer(r"(?ms)^([a-z_]+)\(\) \{[ \t]*(?:#[^\n]*)?\n.*?^\}$", UP_SH)}
    return "\n".join(found[n] for n in names if n in found)


def bring_up_lines() -> str:
    """The script's lines from its "docker-compose up" log line to its wait for the healthchecks."""
    body = UP_SH.split('log "docker-compose up', 1)[1].split("\n", 1)[1]
    return body.split("wait_healthy\n", 1)[0]


def test_it_weighs_dockers_cpu_group_before_up_returns(tmp_path: Path) -> None:
    shares = tmp_path / "cpu.shares"
    shares.write_text("1024\n")
    script = "\n".join(["set -eu", COMPOSE_STUB, functions("share_cpu", "compose_up"), bring_up_lines()])
    done = subprocess.run(["sh", "-c", script], env={"PATH": "/usr/bin:/bin", "MOTOR_DOCKER_CPU_SHARES_FILE": str(shares)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert shares.read_text().strip() == "3072"
    assert "Docker's cpu group weighs 3072 (3 containers)" in done.stderr
