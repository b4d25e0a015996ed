"""Helpers shared by the benchmarks in ``bench/``: machine description, RESULTS.md sections, /proc CPU accounting.

Every benchmark prints one Markdown section headed ``## bench/<script>.py`` and, with ``--write``,
replaces that section of ``bench/RESULTS.md`` in place; these helpers keep the sections comparable
(same machine line, same command line, same replacement rule) across scripts.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"


# --------------------------------------------------------------------------- the machine


def cpu_model() -> str:
    """The first ``model name`` of /proc/cpuinfo, or ``unknown CPU``."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def machine(*, model: bool = True, memory: bool = True) -> str:
    """``2 CPUs (<model>), 23.5 GiB RAM, Linux <release>, Python <version>``; ``model``/``memory`` drop those parts."""
    mem = ""
    if memory:
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemTotal:"):
                    mem = f", {int(line.split()[1]) / 1024 / 1024:.1f} GiB RAM"
    cpus = f"{os.cpu_count()} CPUs" + (f" ({cpu_model()})" if model else "")
    return f"{cpus}{mem}, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def loadavg() -> str:
    """The 1/5/15-minute load averages as in /proc/loadavg (``5.11 4.22 2.45``), or ``unknown``."""
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "unknown"


def command_line() -> str:
    """The command that reproduces this run, relative to the repository root."""
    # Under `python3 -m toolchain exec` argv[0] is the script path as given; under `python -m bench.x`
    # it is the module's absolute path. Either way the section names the toolchain invocation.
    script = os.path.relpath(Path(sys.argv[0]).resolve(), ROOT)
    return shlex.join(["python3", "-m", "toolchain", "exec", script, *sys.argv[1:]])


def require_env(name: str, script: str, hint: str = "") -> str:
    """``os.environ[name]``, or exit telling the user to run ``script`` through the toolchain."""
    value = os.environ.get(name)
    if not value:
        sys.exit(f"{name} is not set; run through `python3 -m toolchain exec {script}`{hint}")
    return value


# --------------------------------------------------------------------------- measurements


def group_cpu_seconds(pgid: int | None) -> float:
    """utime+stime (all threads) of every live process in process group ``pgid``."""
    if pgid is None:
        return 0.0
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        # After the command name: state(0) ppid(1) pgrp(2) ... utime(11) stime(12)
        if len(fields) > 12 and int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def nearest_rank(values: list[float], q: float) -> float:
    """The sorted value nearest to rank ``q * (n - 1)`` (no interpolation); ``values`` must not be empty."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# --------------------------------------------------------------------------- RESULTS.md


def write_section(heading: str, text: str, *, intro: str | None = None, path: Path = RESULTS) -> None:
    """Replace the section starting at the line ``heading`` (up to the next ``## `` line) with ``text``.

    A missing section is appended at the end. A missing file starts from ``intro`` (without one it is
    an error: only first_path.py may create RESULTS.md). The file always ends in exactly one newline.
    """
    current = path.read_text(encoding="utf-8") if intro is None or path.exists() else intro
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(current):
        new = pattern.sub(lambda _m: text + "\n", current, count=1)
    else:
        new = current.rstrip("\n") + "\n\n" + text
    path.write_text(new.rstrip("\n") + "\n", encoding="utf-8")
