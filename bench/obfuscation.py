"""Token obfuscation: what the semantic <-> physical mapping costs per 1k tokens, both directions.

Measures, in this process (no servers), for the tiny model's vocabulary (4,096) and a Qwen-sized
one (151,936):

- key setup: ``TokenMapping.from_key`` (once per key and process);
- ``to_physical`` / ``to_semantic`` on prompts of 1k, 8k and 32k ids, reported per 1k tokens;
- the boundary functions on realistic bodies: ``obfuscate_request`` for a prompt with stop ids
  and a logit bias, ``deobfuscate_response`` for 256 output tokens with 5 top logprobs each,
  and ``deobfuscate_event`` for one streaming event of one token (the per-token streaming cost).

    python3 -m toolchain exec bench/obfuscation.py [--repeat 7] [--write]

Each figure is the median of ``--repeat`` timed batches. ``--write`` replaces this benchmark's
section of ``bench/RESULTS.md`` (or appends it). Reports numbers only; asserts nothing on timings.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import loadavg, write_section  # noqa: E402
from serving.pipeline.obfuscation.fields import (  # noqa: E402
    deobfuscate_event,
    deobfuscate_response,
    obfuscate_request,
)
from serving.pipeline.obfuscation.mapping import TokenMapping  # noqa: E402

SECTION = "## bench/obfuscation.py"
KEY = b"bench-obfuscation-key-not-a-secret"
VOCABS = (4096, 151936)
PROMPTS = (1024, 8192, 32768)


def timed(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds per call of ``fn``, each batch sized to run ~50 ms."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    number = max(1, int(0.05 / once))
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def response_body(m: TokenMapping, tokens: int, top: int, rng: np.random.Generator) -> dict[str, Any]:
    ids = rng.integers(0, m.vocab_size, tokens).tolist()
    content = [
        {"token_id": t, "logprob": -0.5, "rank": None,
         "top_logprobs": [{"token_id": int(a), "logprob": -1.0, "rank": r} for r, a in enumerate(rng.integers(0, m.vocab_size, top))]}
        for t in ids
    ]
    return {"request_id": "x", "usage": {}, "choices": [
        {"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": ids, "logprobs": {"content": content}}
    ]}


def measure(repeat: int) -> list[tuple[str, dict[int, str]]]:
    rng = np.random.default_rng(0)
    rows: dict[str, dict[int, str]] = {}
    for vocab in VOCABS:
        setup = timed(partial(TokenMapping.from_key, KEY, vocab), max(3, repeat // 2))
        rows.setdefault("key setup (once per key), ms", {})[vocab] = f"{setup * 1e3:.2f}"
        m = TokenMapping.from_key(KEY, vocab)
        for n in PROMPTS:
            ids = rng.integers(0, vocab, n).tolist()
            phys = m.to_physical(ids)
            fwd = timed(partial(m.to_physical, ids), repeat)
            back = timed(partial(m.to_semantic, phys), repeat)
            rows.setdefault(f"to_physical, {n // 1024}k-token prompt, µs per 1k tokens", {})[vocab] = f"{fwd / n * 1e9:.1f}"
            rows.setdefault(f"to_semantic, {n // 1024}k-token list, µs per 1k tokens", {})[vocab] = f"{back / n * 1e9:.1f}"
        prompt = rng.integers(0, vocab, 8192).tolist()
        request = {"request_id": "r", "token_ids": prompt, "model": "tiny", "stream": False,
                   "sampling_params": {"temperature": 0.0, "max_tokens": 256, "stop": [], "bad_words": [],
                                       "stop_token_ids": [1, 2], "logit_bias": {"5": 1.0, "6": -1.0}}}
        t = timed(partial(obfuscate_request, request, m), repeat)
        rows.setdefault("obfuscate_request, 8k-token prompt, µs per 1k tokens", {})[vocab] = f"{t / 8.192 * 1e6:.1f}"
        resp = response_body(m, 256, 5, rng)
        t = timed(partial(deobfuscate_response, resp, m), repeat)
        rows.setdefault("deobfuscate_response, 256 tokens × (1 + 5 logprob ids), µs per 1k output tokens", {})[vocab] = (
            f"{t / 0.256 * 1e6:.1f}"
        )
        plain = response_body(m, 256, 0, rng)
        for c in plain["choices"]:
            c["logprobs"] = None
        t = timed(partial(deobfuscate_response, plain, m), repeat)
        rows.setdefault("deobfuscate_response, 256 tokens, no logprobs, µs per 1k output tokens", {})[vocab] = f"{t / 0.256 * 1e6:.1f}"
        event = {"request_id": "x", "usage": None, "output_mode": "tokens", "choices": [
            {"index": 0, "finish_reason": None, "stop_reason": None, "token_ids": [7], "logprobs": None}]}
        t = timed(partial(deobfuscate_event, event, m), repeat)
        rows.setdefault("deobfuscate_event, 1-token stream event, µs per event (= per 1k tokens: ×1000)", {})[vocab] = (
            f"{t * 1e6:.2f}"
        )
    return list(rows.items())


def section(rows: list[tuple[str, dict[int, str]]], command: str) -> str:
    load = loadavg()
    lines = [
        SECTION,
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}, numpy {np.__version__}; load average {load} at the end "
        "(shared with other work)",
        f"- command: `{command}` (from the repository root); median of timed batches, one process, no I/O",
        "- what it costs: one vectorized gather (numpy fancy indexing) plus list conversion each way; the "
        "bounds check that refuses ids outside the vocabulary is included",
        "",
        "| measurement | vocab 4,096 (tinymodel) | vocab 151,936 (Qwen-sized) |",
        "|---|---:|---:|",
    ]
    for name, by_vocab in rows:
        lines.append(f"| {name} | {by_vocab[VOCABS[0]]} | {by_vocab[VOCABS[1]]} |")
    return "\n".join(lines) + "\n"


def write_results(text: str) -> None:
    write_section(SECTION, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    args = parser.parse_args()
    text = section(measure(args.repeat), "python3 -m toolchain exec bench/obfuscation.py --write")
    print(text)
    if args.write:
        write_results(text)


if __name__ == "__main__":
    main()
