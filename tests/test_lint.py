"""House rules the tools can check: ruff over the tree, mypy --strict over the data plane."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True)


def test_ruff_finds_nothing() -> None:
    result = _run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_data_plane_type_checks_strictly() -> None:
    # mypy's cache lives with the environment (named by its lock's hash), not in the checkout: a
    # fresh clone then checks only what changed, about 1 s instead of 50 s spent mostly on httpx's
    # and asyncio's stubs; mypy trusts a cached module only while its source hashes the same.
    cache = Path(sys.prefix) / "mypy-cache"
    result = _run("mypy", "--strict", "--ignore-missing-imports", "--cache-dir", str(cache), "serving/pipeline")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_data_plane_imports_nothing_from_django() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "serving" / "pipeline").rglob("*.py")
        if any(line.startswith(("import django", "from django")) for line in p.read_text().splitlines())
    ]
    assert offenders == []
