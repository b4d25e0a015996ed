"""Scale-out: throughput and TTFT with one coordinator process vs two on the same simulated fleet.

Starts its own stack on free ports of 127.0.0.1 (logs in a temp directory): the real vLLM render
sidecar, two ``enginesim`` union engines, a PostgreSQL database of its own and Redis db 11 (both
must answer on 127.0.0.1; flushed before and after), and three Daphne coordinators on that one
database and Redis: the first alone is the one-process setup, the other two the two-process one
(so one process pays the same shared-state costs as two: Redis admission leases, the shared
breakers). The client spreads streaming chat requests round-robin over the setup's
coordinators, as a load balancer would, at each concurrency, the setups alternating round by
round; every request asks for ``--max-tokens`` and the engines never stop early, so each moves
the same tokens. Per setup and concurrency: requests per second, output tokens per second, TTFT (first
content chunk) p50/p99 and end-to-end p50/p99, errors.

    python3 -m toolchain exec bench/replicas.py [--requests 48] [--rounds 3] [--concurrency 4 16 32] [--write]

The load generator runs on the same machine (one asyncio loop, httpx), so on a small machine it
competes with the coordinators for CPU; the section records the CPU count and load average.
``--write`` replaces this benchmark's section of ``bench/RESULTS.md`` (or appends it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import RESULTS, bench_stack, loadavg, percentile, section_head, write_section  # noqa: E402
from motorsite import stack  # noqa: E402
from motorsite.processes import ProcessSpec  # noqa: E402
from motorsite.supervisor import Supervisor, free_port  # noqa: E402

SECTION = "## bench/replicas.py"
CLIENT_KEY = "sk-bench-" + uuid.uuid4().hex[:12]
REDIS_URL = "redis://127.0.0.1:6379/11"
PSQL = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-qc"]


@dataclasses.dataclass
class Sample:
    ok: bool
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0


async def one(client: httpx.AsyncClient, url: str, max_tokens: int) -> Sample:
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "count to a hundred"}], "max_tokens": max_tokens,
        "stream": True, "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    tokens = 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {CLIENT_KEY}"}) as response:
            if response.status_code != 200:
                await response.aread()
                return Sample(False)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.HTTPError:
        return Sample(False)
    return Sample(tokens == max_tokens, ttft, time.perf_counter() - start, tokens)


async def run(urls: list[str], requests: int, concurrency: int, max_tokens: int) -> tuple[list[Sample], float]:
    """``requests`` streams, at most ``concurrency`` at once, round-robin over ``urls``."""
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0), limits=limits, trust_env=False) as client:
        gate = asyncio.Semaphore(concurrency)

        async def bounded(n: int) -> Sample:
            async with gate:
                return await one(client, urls[n % len(urls)], max_tokens)

        # Warm-up: connections and first-request paths of every coordinator.
        await asyncio.gather(*(one(client, u, 4) for u in urls for _ in range(2)))
        start = time.perf_counter()
        samples = await asyncio.gather(*(bounded(n) for n in range(requests)))
        return list(samples), time.perf_counter() - start


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.1f}"


def row(setup: str, concurrency: int, samples: list[Sample], wall: float) -> str:
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft for s in ok if s.ttft is not None]
    e2e = [s.e2e for s in ok if s.e2e is not None]
    tokens = sum(s.tokens for s in ok)
    return (
        f"| {setup} | {concurrency} | {len(ok) / wall:.1f} | {tokens / wall:.0f} | {_ms(percentile(ttft, 0.5))} | "
        f"{_ms(percentile(ttft, 0.99))} | {_ms(percentile(e2e, 0.5))} | {_ms(percentile(e2e, 0.99))} | "
        f"{len(ok)} ok / {len(samples) - len(ok)} err |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48, help="streams per setup, concurrency and round")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per setup and concurrency")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tpot-ms", type=float, default=5.0, help="the simulated engines' time per output token")
    parser.add_argument("--write", action="store_true", help=f"write the section into {RESULTS.relative_to(ROOT)}")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    script = "bench/replicas.py"

    tmp = Path(tempfile.mkdtemp(prefix="motorsite-bench-replicas-"))
    db = f"motorsite_bench_{uuid.uuid4().hex[:8]}"
    cfg = bench_stack(
        script, engines="sim", engine_count=2, api_key=CLIENT_KEY, log_dir=tmp,
        database_url=f"postgresql://postgres@127.0.0.1:5432/{db}",
        redis_url=REDIS_URL,
        celery=False,
        restart=None,
        extra_env={"SECRET_KEY": "bench-" + uuid.uuid4().hex + uuid.uuid4().hex},  # 50+ characters
    )
    print(f"logs: {tmp}", flush=True)
    subprocess.run([*PSQL, f"CREATE DATABASE {db}"], check=True)
    subprocess.run(["redis-cli", "-n", "11", "flushdb"], check=True, capture_output=True)
    lines: list[str] = []
    ratios: list[str] = []  # output tok/s of two coordinators over one, per concurrency
    try:
        with contextlib.ExitStack() as exits:
            print("starting render sidecar and two enginesim engines ...", flush=True)
            engines = [
                dataclasses.replace(spec, argv=[*spec.argv, "--tpot-ms", str(args.tpot_ms), "--eos-probability", "0"])
                for spec in stack.engine_specs(cfg)
            ]
            exits.enter_context(Supervisor([stack.render_spec(cfg), *engines]))
            stack.prepare_database(cfg)
            # All three coordinators run throughout (an idle one costs a snapshot poll every 250 ms),
            # so the setups can alternate round by round and drift in the machine's load hits both.
            ports = [free_port() for _ in range(3)]
            specs: list[ProcessSpec] = []
            for n, port in enumerate(ports):
                spec = stack.coordinator_spec(dataclasses.replace(cfg, coordinator_port=port))
                specs.append(dataclasses.replace(spec, name=f"coordinator-{n + 1}", log_path=tmp / f"coordinator-{n + 1}.log"))
            print("starting three coordinators (one for the first setup, two for the second) ...", flush=True)
            exits.enter_context(Supervisor(specs))
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            setups = {"one coordinator": urls[:1], "two coordinators": urls[1:]}
            load_before = loadavg()
            for c in args.concurrency:
                runs: dict[str, tuple[list[Sample], float]] = {name: ([], 0.0) for name in setups}
                for r in range(args.rounds):
                    order = list(setups) if r % 2 == 0 else list(reversed(setups))
                    for name in order:
                        samples, wall = asyncio.run(run(setups[name], args.requests, c, args.max_tokens))
                        runs[name] = (runs[name][0] + samples, runs[name][1] + wall)
                        print(f"  {name}, concurrency {c}, round {r + 1}: {wall:.1f} s", flush=True)
                for name, (samples, wall) in runs.items():
                    lines.append(row(name, c, samples, wall))
                    print(lines[-1], flush=True)
                one, two = (sum(x.tokens for x in runs[n][0] if x.ok) / runs[n][1] for n in setups)
                ratios.append(f"{two / one:.2f}× at concurrency {c}")
            load_after = loadavg()
    finally:
        subprocess.run([*PSQL, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"], check=False)
        subprocess.run(["redis-cli", "-n", "11", "flushdb"], check=False, capture_output=True)
    ordered = sorted(lines, key=lambda line: (int(line.split("|")[2]), line.split("|")[1]))
    text = "\n".join(
        [
            *section_head(SECTION, (load_before, load_after), "the load generator shares the machine"),
            f"- fleet: two enginesim union engines at {args.tpot_ms:g} ms per output token (no early EOS), the real "
            f"render sidecar (one, 4 workers), PostgreSQL and Redis on 127.0.0.1 for both setups; "
            f"{args.rounds} alternating rounds of {args.requests} streaming chat requests of {args.max_tokens} "
            "output tokens per row, round-robin over the setup's coordinators (req/s and tok/s over the rounds' "
            "summed wall time)",
            "- TTFT is the first content chunk; times in ms",
            f"- two coordinators over one, output tokens per second: {', '.join(ratios)}. Everything (both "
            "engines, the sidecar, the coordinators, PostgreSQL, Redis and the load generator) shares this "
            "machine's CPUs, so this is what a second process buys where the coordinator's own CPU is the "
            "limit, not what a second machine would",
            "",
            "| setup | concurrency | req/s | output tok/s | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 | requests |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
            *ordered,
        ]
    )
    print()
    print(text)
    if args.write:
        write_section(SECTION, text)
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    if not args.keep_logs:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
