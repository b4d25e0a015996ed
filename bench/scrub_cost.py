"""What the JSON answer's scrub would cost as the stream's: two look-ups against one deep walk.

``request_checks.scrub_response`` nulls ``kv_transfer_params`` and ``ec_transfer_params`` at a
JSON answer's top level; ``sse.FieldScrub`` walks a stream event's whole JSON (``_null_fields``),
because stream events nest them. This prices using the walk for JSON answers too, in-process, on
chat answers as vLLM writes them (``logprobs.content`` with ``bytes`` and ``top_logprobs``):
values the walk visits (a count, the same on every machine) and microseconds of each.

    python3 -m toolchain exec bench/scrub_cost.py [--rounds 5]

Reports numbers only; nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving.pipeline import sse  # noqa: E402
from serving.pipeline.request_checks import RESPONSE_CONTROLS, scrub_response  # noqa: E402

FIELDS = frozenset(RESPONSE_CONTROLS)


def answer(tokens: int, top: int | None) -> dict[str, Any]:
    """A chat answer of ``tokens`` tokens; ``top``: its ``top_logprobs`` (None: no logprobs)."""

    def entry(i: int) -> dict[str, Any]:
        return {"token": f"t{i}", "logprob": -0.5, "bytes": [116, 49]}

    logprobs = None if top is None else {"content": [{**entry(i), "top_logprobs": [entry(j) for j in range(top)]}
                                                     for i in range(tokens)]}
    return {
        "id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * tokens, "tool_calls": []},
                     "logprobs": logprobs, "finish_reason": "length", "stop_reason": None,
                     "token_ids": list(range(tokens))}],
        "usage": {"prompt_tokens": 10, "completion_tokens": tokens, "total_tokens": 10 + tokens},
        "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None,
    }


def visits(value: Any) -> int:
    """The values ``sse._null_fields`` visits in ``value`` (itself included)."""
    if isinstance(value, dict):
        return 1 + sum(visits(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(visits(v) for v in value)
    return 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| answer | values the walk visits | deep walk, us | two look-ups, us |")
    print("|---|---:|---:|---:|")
    for tokens, top in ((32, None), (32, 5), (256, 5)):
        body = answer(tokens, top)
        walk = min(timeit.repeat(lambda body=body: sse._null_fields(body, FIELDS), number=200, repeat=args.rounds)) / 200
        two = min(timeit.repeat(lambda body=body: scrub_response(body), number=2000, repeat=args.rounds)) / 2000
        label = f"{tokens} tokens, " + ("no logprobs" if top is None else f"top_logprobs {top}")
        print(f"| {label} | {visits(body)} | {walk * 1e6:.1f} | {two * 1e6:.2f} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
