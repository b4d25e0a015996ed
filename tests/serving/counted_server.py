"""Run an ASGI server's command line (``daphne ...`` or ``uvicorn ...``) for ``test_held_stream_objects.py``:
on each SIGUSR1 the process collects garbage and writes to ``MOTOR_TEST_COUNT_FILE``, as JSON, how
many async generator objects are alive, by where their code is (``path:qualname``, the project's
own code only: ``serving/`` and ``motorsite/``).

    python tests/serving/counted_server.py daphne -b 127.0.0.1 -p 8000 motorsite.asgi:application
"""

from __future__ import annotations

import collections
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


def _count(signum: int, frame: FrameType | None) -> None:
    gc.collect()
    alive: collections.Counter[str] = collections.Counter()
    for obj in gc.get_objects():
        if isinstance(obj, types.AsyncGeneratorType):
            code = obj.ag_code
            if code.co_filename.startswith(OWN):
                alive[f"{Path(code.co_filename).relative_to(ROOT)}:{code.co_qualname}"] += 1
    out = Path(os.environ["MOTOR_TEST_COUNT_FILE"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"async_generators": alive}))
    tmp.replace(out)  # the test reads a whole file or none


def main() -> None:
    module = sys.argv[1]
    signal.signal(signal.SIGUSR1, _count)
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
