"""House rules the tools can check: ruff over the tree, mypy --strict over the data plane."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The environment's shared mypy cache (v2: only ever written whole, by rename; see _mypy_cache).
SHARED_MYPY_CACHE = Path(sys.prefix) / "mypy-cache-v2"


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True)


def test_ruff_finds_nothing() -> None:
    result = _run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def _mypy_cache(tmp_path: Path) -> Path:
    """A cache of this run's own, made of hard links to the environment's shared one.

    The shared cache lives with the environment (named by its lock's hash), not in the checkout:
    a fresh clone then checks only what changed, about 1 s instead of 50 s spent mostly on
    httpx's and asyncio's stubs. Several checkouts run the suite at once on one machine (a clean
    clone beside a working tree), and mypy run on one cache by two trees with different sources
    mixes their modules: a dependent checked against the other tree's interface. So each run
    writes to its own copy; mypy replaces a cache file (a new inode) rather than writing into
    it, so the links never change the shared files.
    """
    own = tmp_path / "mypy-cache"
    if SHARED_MYPY_CACHE.is_dir():
        shutil.copytree(SHARED_MYPY_CACHE, own, copy_function=_link_or_copy)
    return own


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # tmp_path on another file system (a tmpfs /tmp)
        shutil.copy2(src, dst)


def _publish_mypy_cache(own: Path) -> None:
    """Keep the first complete cache as the environment's shared one (a rename: whole or nothing)."""
    if not SHARED_MYPY_CACHE.exists():
        with contextlib.suppress(OSError):  # another run published first
            os.rename(own, SHARED_MYPY_CACHE)


def test_the_data_plane_type_checks_strictly(tmp_path: Path) -> None:
    cache = _mypy_cache(tmp_path)
    result = _run("mypy", "--strict", "--ignore-missing-imports", "--cache-dir", str(cache), "serving/pipeline")
    assert result.returncode == 0, result.stdout + result.stderr
    _publish_mypy_cache(cache)


def test_the_data_plane_imports_nothing_from_django() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "serving" / "pipeline").rglob("*.py")
        if any(line.startswith(("import django", "from django")) for line in p.read_text().splitlines())
    ]
    assert offenders == []
