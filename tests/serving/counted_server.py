"""Run an ASGI server's command line (``daphne ...`` or ``uvicorn ...``) for ``test_held_stream_objects.py``:
on each SIGUSR1 the process collects garbage and writes to ``MOTOR_TEST_COUNT_FILE``, as JSON, how
many of these are alive:

- ``async_generators``: async generator objects of the project's own code (``serving/`` and
  ``motorsite/``), by where their code is (``path:qualname``);
- ``context_managers``: ``contextlib.contextmanager`` / ``asynccontextmanager`` objects of the
  project's code (a suspended generator each), by their generator's ``path:qualname``;
- ``exit_callbacks``: contextlib's closures around an exit stack's ``callback`` and
  ``push_async_callback`` (``_exit_wrapper``, with a ``__wrapped__`` attribute), by what they wrap.

    python tests/serving/counted_server.py daphne -b 127.0.0.1 -p 8000 motorsite.asgi:application
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import os
import runpy
import signal
import sys
import types
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[2]
OWN = tuple(str(ROOT / package) + os.sep for package in ("serving", "motorsite"))


def _where(code: types.CodeType) -> str | None:
    if not code.co_filename.startswith(OWN):
        return None
    return f"{Path(code.co_filename).relative_to(ROOT)}:{code.co_qualname}"


def _count(signum: int, frame: FrameType | None) -> None:
    gc.collect()
    counts: dict[str, collections.Counter[str]] = {
        "async_generators": collections.Counter(), "context_managers": collections.Counter(),
        "exit_callbacks": collections.Counter(),
    }
    generator_cms = (contextlib._GeneratorContextManager, contextlib._AsyncGeneratorContextManager)
    for obj in gc.get_objects():
        if isinstance(obj, types.AsyncGeneratorType):
            if (where := _where(obj.ag_code)) is not None:
                counts["async_generators"][where] += 1
        elif isinstance(obj, generator_cms):
            code = getattr(obj.gen, "gi_code", None) or getattr(obj.gen, "ag_code", None)
            if code is not None and (where := _where(code)) is not None:
                counts["context_managers"][where] += 1
        elif isinstance(obj, types.FunctionType) and obj.__module__ == "contextlib" and obj.__name__ == "_exit_wrapper":
            wrapped = getattr(obj, "__wrapped__", None)
            counts["exit_callbacks"][getattr(wrapped, "__qualname__", repr(wrapped))] += 1
    out = Path(os.environ["MOTOR_TEST_COUNT_FILE"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(counts))
    tmp.replace(out)  # the test reads a whole file or none


def main() -> None:
    module = sys.argv[1]
    signal.signal(signal.SIGUSR1, _count)
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
