"""``vllm bench serve``, run again and again in one process: what ``bench/serve_bench.py`` drives.

Runs under the render environment's Python (vLLM 0.33.0), never the app's. Each line of stdin is
the JSON list of arguments of one ``vllm bench serve`` run; the run is vLLM's own code, the
parser and ``main`` the CLI's ``vllm bench serve`` subcommand calls, so the client is the one a
user would run. Importing vLLM costs 6-7 s of CPU (25-30 s of wall time on a loaded 2-core
machine): paid once here instead of once per run. Each run's output goes to stderr; stdout
carries one JSON line per run: its exit status (0, or 1 and the error) and the CPU seconds this
process spent in it.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import traceback


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    out = sys.stdout
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        start = cpu()
        reply: dict[str, object] = {"status": 0}
        try:
            args = parser.parse_args(json.loads(line))
            with contextlib.redirect_stdout(sys.stderr):
                bench_main(args)
        except (Exception, SystemExit) as exc:  # one bad run must not end the others
            traceback.print_exc(file=sys.stderr)
            reply = {"status": 1, "error": f"{type(exc).__name__}: {exc}"}
        reply["cpu"] = cpu() - start
        print(json.dumps(reply), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
