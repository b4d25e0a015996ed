"""The output of a script run in another tier's environment, kept with that environment.

Some tests ask the render environment a question only it can answer (what vLLM's encoder writes,
what transformers renders), and most of the answer's cost is importing vLLM or transformers (8 s
of CPU). The answer is a function of its inputs alone: the environment, which is never changed
in place (``toolchain`` builds a new directory, named by its lock's hash, when the lock changes),
the script and the data the test hands it. So the output is kept in that environment's
directory under a name hashed from the script, its arguments and the data, and a clean clone
that finds the environment cached finds the answer too. What is kept is the script's raw
output, never a verdict: the test still checks it every run. Written by rename: whole or absent.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
from pathlib import Path

SUBDIR = "test-memo-v1"


def run_in_env(
    python: str | Path, script: str, *args: str, data: bytes | None = None, env: dict[str, str] | None = None,
    timeout: float = 300,
) -> str:
    """The stdout of ``python -c script *args`` (checked: a failure raises), from the memo of the
    environment of ``python`` when it holds one for exactly these inputs. ``data``, when given, is
    what the answer depends on in place of ``args`` (the bytes of the files they name, wherever
    they are: ``files_digest``); ``env`` is the script's environment."""
    inputs = repr((script, args if data is None else (), sorted((env or {}).items()))).encode()
    key = hashlib.sha256(inputs + b"\0" + (data or b"")).hexdigest()
    prefix = Path(python).parent.parent  # <env>/bin/python: not resolved, a venv's python is a symlink
    memo = prefix / SUBDIR / key if (prefix / "pyvenv.cfg").is_file() else None
    if memo is not None and memo.is_file():
        return memo.read_text()
    out = subprocess.run([str(python), "-c", script, *args], capture_output=True, text=True, env=env,
                         timeout=timeout, check=True).stdout
    if memo is not None:
        with contextlib.suppress(OSError):  # a read-only cache: the next run asks again
            memo.parent.mkdir(exist_ok=True)
            partial = memo.with_name(f"{key}.{os.getpid()}.partial")
            partial.write_text(out)
            os.replace(partial, memo)
    return out


def files_digest(*paths: Path) -> bytes:
    """The bytes of ``paths`` (files, or every file under a directory), hashed with their names."""
    h = hashlib.sha256()
    for root in paths:
        for p in sorted([root] if root.is_file() else (q for q in root.rglob("*") if q.is_file())):
            h.update(str(p.relative_to(root.parent)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.digest()
