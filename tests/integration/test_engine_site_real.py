"""The session's real vLLM engines ran the engine site: each logged the AMX line that matches this
machine's CPU exactly once, and (the fixture's readiness check is one real greedy token) survived
its first forward pass, with AMX kernels where the CPU has them."""

from __future__ import annotations

from pathlib import Path

from motorsite import stack
from motorsite.engine_site import motorsite_cpu

AMX_LINES = {
    "motorsite: AMX tile data found; permission granted",
    "motorsite: no AMX on this CPU; nothing to request",
}


def _this_run(log: Path, name: str) -> str:
    """The part of ``log`` written since the supervisor last started ``name`` (logs are appended)."""
    text = log.read_text(errors="replace")
    header = f"--- supervisor: starting {name}:"
    start = text.rfind(header)
    assert start >= 0, f"{log} has no start of {name}"
    return text[start:]


def test_each_real_engine_logged_the_amx_line_of_this_cpu_once(tiers: stack.StackConfig) -> None:
    flags = motorsite_cpu.cpu_flags(Path("/proc/cpuinfo").read_text())
    expected = motorsite_cpu.request_amx_permission().message
    assert ("AMX tile data found; permission granted" in expected) == ("amx_tile" in flags)
    for n in range(1, len(tiers.engine_ports) + 1):
        name = f"engine-{n}"
        run = _this_run(tiers.log_dir / f"{name}.log", name)
        lines = [line for line in run.splitlines() if line in AMX_LINES or "AMX tile data found but" in line]
        assert lines == [expected], f"{name}: {lines}"
        # Served its readiness token, so its engine core ran the model; nothing died on the way.
        assert "Fatal Python error" not in run
