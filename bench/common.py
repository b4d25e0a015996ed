"""Helpers shared by the benchmarks in ``bench/``: machine description, RESULTS.md sections, /proc CPU accounting.

Every benchmark prints one Markdown section headed ``## bench/<script>.py`` and, with ``--write``,
replaces that section of ``bench/RESULTS.md`` in place; these helpers keep the sections comparable
(same machine line, same command line, same replacement rule) across scripts.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import re
import shlex
import shutil
import sqlite3
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from motorsite import stack
from motorsite.supervisor import ProcessSpec, free_port

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


def bench_stack(
    script: str, *, engines: str, engine_count: int, api_key: str, log_dir: Path, database_url: str, **changes: Any,
) -> stack.StackConfig:
    """The stack a benchmark starts: the toolchain's model and tiers
    (exit through ``require_env`` without them), fresh ports, union engines only, ``changes`` on top."""
    return stack.StackConfig(
        model_dir=require_env("MOTOR_MODEL_DIR", script),
        render_python=require_env("MOTOR_RENDER_PYTHON", script),
        engine_python=require_env("MOTOR_ENGINE_PYTHON", script),
        engines=engines,
        render_port=free_port(),
        engine_ports=tuple(free_port() for _ in range(engine_count)),
        prefill_ports=(),
        decode_ports=(),
        coordinator_port=free_port(),
        api_keys=(api_key,),
        log_dir=log_dir,
        database_url=database_url,
        **changes,
    )


# --------------------------------------------------------------------------- measurements


class ProcStat(NamedTuple):
    """What CPU accounting needs from one /proc/<pid>/stat line (times in clock ticks)."""

    ppid: int
    pgrp: int
    own: int  # utime + stime of every thread of the process
    reaped: int  # cutime + cstime: its children that exited and were waited for


def parse_stat(stat: str) -> ProcStat:
    """Parse one /proc/<pid>/stat line (the command name may hold spaces and parentheses)."""
    fields = stat[stat.rfind(")") + 2 :].split()
    # After the command name: state(0) ppid(1) pgrp(2) ... utime(11) stime(12) cutime(13) cstime(14)
    return ProcStat(int(fields[1]), int(fields[2]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]))


def proc_stats() -> dict[int, ProcStat]:
    """``pid -> ProcStat`` of every live process (one that ends while we look is left out)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            out[int(entry.name)] = parse_stat((entry / "stat").read_text())
        except (OSError, IndexError, ValueError):
            continue
    return out


def tree_ticks(stats: dict[int, ProcStat], root: int) -> int:
    """CPU ticks of ``root`` and all its live descendants, each with its reaped children's.

    A child that exited and was waited for lives on in its parent's ``reaped`` count, so workers a
    proxy forks and replaces are still counted; ``root`` missing from ``stats`` counts 0.
    """
    children: dict[int, list[int]] = {}
    for pid, st in stats.items():
        children.setdefault(st.ppid, []).append(pid)
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += stats[pid].own + stats[pid].reaped
        todo += children.get(pid, [])
    return total


def tree_cpu_seconds(*roots: int | None) -> float:
    """CPU seconds (all threads, reaped children included) of the process trees under ``roots``."""
    stats = proc_stats()
    return sum(tree_ticks(stats, r) for r in roots if r is not None) / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int | None) -> float:
    """utime+stime (all threads) of every live process in process group ``pgid``."""
    if pgid is None:
        return 0.0
    ticks = sum(st.own for st in proc_stats().values() if st.pgrp == pgid)
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


def section_head(heading: str, load: tuple[str, str], caveat: str) -> list[str]:
    """The first lines of a section: heading, date, machine with the load before and after the runs, command."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        heading,
        "",
        f"- date: {now}",
        f"- machine: {machine()}; load average (1/5/15 min) {load[0]} before, {load[1]} after ({caveat})",
        f"- command: `{command_line()}` (run from the repository root)",
    ]


def ratio_rows(rounds: dict[str, list[tuple[float, float]]], base: str, digits: int) -> list[str]:
    """A table's rows, one a variant of ``rounds`` (its cost per round as two parts, such as server and
    client): the median round of each part and of their sum, with ``digits`` decimals, then the sum's
    ratio to ``base``'s round by round, median (range). A round where ``base`` cost nothing has no ratio."""
    totals = {n: [a + b for a, b in parts] for n, parts in rounds.items()}
    rows = []
    for n, parts in rounds.items():
        ratios = sorted(t / b for t, b in zip(totals[n], totals[base], strict=True) if b)
        rows.append(
            f"| {n} | {statistics.median(a for a, _ in parts):.{digits}f} | "
            f"{statistics.median(b for _, b in parts):.{digits}f} | {statistics.median(totals[n]):.{digits}f} | "
            f"{statistics.median(ratios):.3f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) |"
        )
    return rows


def publish(heading: str, text: str, *, write: bool) -> None:
    """Print a finished section and, with ``write``, put it into RESULTS.md in place of the old one."""
    print()
    print(text)
    if write:
        write_section(heading, text)
        print(f"wrote {RESULTS.relative_to(ROOT)}")


def tidy(tmp: Path, *, keep: bool, logs: Path) -> None:
    """Remove a run's temp directory, or say where its logs are when they are worth reading (``keep``)."""
    if keep:
        print(f"logs kept in {logs}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


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


def baseline_tree(rev: str, tmp: Path, exits: contextlib.ExitStack) -> Path:
    """A checkout of ``rev`` (a detached git worktree under ``tmp``), removed when ``exits`` closes."""
    tree = tmp / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    exits.callback(subprocess.run, ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    return tree


def coordinator_from(tree: Path, cfg: stack.StackConfig, name: str) -> ProcessSpec:
    """``cfg``'s coordinator, run from another checkout after that checkout migrated its database
    and wrote its demo fleet (``cfg``'s sidecar and union engines)."""
    env = {**os.environ, **stack.coordinator_env(cfg), "PYTHONPATH": str(tree)}
    manage = [cfg.app_python, str(tree / "manage.py")]
    subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], check=True, env=env, cwd=tree)
    subprocess.run(
        [*manage, "demo_fleet", "--model-dir", cfg.model_dir, "--served-model-name", cfg.served_model_name,
         "--max-model-len", str(cfg.max_model_len), "--render-port", str(cfg.render_port), "--engine-kind", cfg.engines,
         *[a for url in cfg.engine_urls for a in ("--engine", url)]],
        check=True, env=env, cwd=tree,
    )
    spec = stack.coordinator_spec(cfg)
    return replace(spec, name=name, cwd=tree, env={**spec.env, "PYTHONPATH": str(tree)})


def interval_of(key: str) -> int:
    """The ``stream_interval_ms`` of a ``motorsite-<ms>ms`` path (0 for every other path)."""
    return int(key[len("motorsite-"):-2]) if key.startswith("motorsite-") and key.endswith("ms") else 0


def motorsite_config(cfg: stack.StackConfig, tmp: Path, name: str, interval_ms: int, *,
                     member_ports: tuple[int, ...] = (), local: bool = False) -> stack.StackConfig:
    """A coordinator of its own (database, port, logs) over ``cfg``'s fleet; ``interval_ms`` 0 leaves the defaults,
    ``member_ports`` are more sidecars of its render pool, ``local`` turns ``local_stream_detokenize`` on."""
    db = tmp / f"{name}.sqlite3"
    one = replace(cfg, coordinator_port=free_port(), database_url=f"sqlite:///{db}", log_dir=cfg.log_dir / name,
                  render_member_ports=member_ports)
    one.log_dir.mkdir(parents=True, exist_ok=True)
    stack.prepare_database(one)
    if interval_ms or local:
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE serving_renderconfig SET stream_interval_ms = ?, local_stream_detokenize = ?",
                         (interval_ms, local))
    return one
