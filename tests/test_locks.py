"""Every lock pins exact versions with the hash of each file, and the app's lock covers requirements.in.

The installs run with ``--require-hashes`` (``toolchain/__init__.py``), so a lock line without a
hash would stop a fresh machine's setup; this finds it before a clean clone does.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCKS = [ROOT / "requirements.txt", *sorted((ROOT / "requirements").glob("*.lock"))]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _entries(lock: Path) -> dict[str, list[str]]:
    """name -> the hashes its pin carries, from a pip/uv lock with continuation lines."""
    entries: dict[str, list[str]] = {}
    current = ""
    for line in lock.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("--hash=sha256:"):
            assert current, f"{lock.name}: a hash before any pin"
            entries[current].append(stripped.split(":", 1)[1].rstrip(" \\"))
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s\\;]+)(\s*;[^\\]*)?\s*\\?", stripped)
        assert m, f"{lock.name}: not an exact pin: {line!r}"
        current = _canonical(m.group(1))
        assert current not in entries, f"{lock.name}: {current} pinned twice"
        entries[current] = []
    return entries


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_every_pin_carries_its_hashes(lock: Path) -> None:
    entries = _entries(lock)
    # At least 20 pins (a parse that found a handful would pass every check below), or, for a peer's
    # small lock (smg needs 7 packages), at least the peer its header names.
    named = re.match(r"# ([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==", lock.read_text())
    assert len(entries) >= 20 or (named is not None and _canonical(named.group(1)) in entries)
    unhashed = sorted(name for name, hashes in entries.items() if not hashes)
    assert not unhashed, f"{lock.name}: pins without hashes {unhashed} (python3 -m toolchain rehash)"
    bad = [h for hashes in entries.values() for h in hashes if not re.fullmatch(r"[0-9a-f]{64}", h)]
    assert not bad


def test_the_app_lock_resolves_every_direct_dependency() -> None:
    direct = {
        _canonical(re.split(r"[\s\[<>=!~;]", line.strip(), maxsplit=1)[0])
        for line in (ROOT / "requirements.in").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert len(direct) >= 20
    missing = sorted(direct - _entries(ROOT / "requirements.txt").keys())
    assert not missing, f"requirements.in names {missing}, which requirements.txt lacks (python3 -m toolchain relock app)"
