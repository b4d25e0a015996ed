"""What an engine's answer costs to read as the data plane reads it, against msgspec's typed decode.

The data plane parses a generate answer or stream event with ``json_codec.loads`` (orjson) and
checks it with ``msgspec.convert`` against ``protocol.py``'s Struct, keeping the dict; the
alternative is ``msgspec.json.Decoder(Struct).decode`` (one step), plus ``msgspec.to_builtins``
where a dict must go on (derender). In-process, one core, microseconds per body.

    python3 -m toolchain exec bench/wire_decode.py [--rounds 7]

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

import msgspec  # noqa: E402

from serving.pipeline.json_codec import dumps, loads  # noqa: E402
from serving.pipeline.protocol import GenerateEvent, GenerateResponse  # noqa: E402

RESPONSE = {
    "request_id": "generate-tokens-x",
    "choices": [{"index": 0, "token_ids": list(range(1000, 1032)), "finish_reason": "length", "stop_reason": None,
                 "logprobs": None}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 32, "total_tokens": 42},
    "kv_transfer_params": None, "prompt_logprobs": None,
}
EVENT = {"request_id": "generate-tokens-x", "choices": [{"index": 0, "token_ids": [1234], "finish_reason": None}],
         "output_mode": "tokens"}


def per_call(fn: Any, rounds: int, number: int = 20000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=rounds)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| body | loads | loads + convert (now) | typed decode | typed decode + to_builtins |")
    print("|---|---:|---:|---:|---:|")
    for label, body, kind in (("response, 32 ids", RESPONSE, GenerateResponse), ("stream event, 1 id", EVENT, GenerateEvent)):
        raw = dumps(body)
        decoder = msgspec.json.Decoder(kind)
        now = per_call(lambda raw=raw, kind=kind: msgspec.convert(loads(raw), kind), args.rounds)
        parsed = per_call(lambda raw=raw: loads(raw), args.rounds)
        typed = per_call(lambda raw=raw, decoder=decoder: decoder.decode(raw), args.rounds)
        back = per_call(lambda raw=raw, decoder=decoder: msgspec.to_builtins(decoder.decode(raw)), args.rounds)
        print(f"| {label} | {parsed:.2f} | {now:.2f} | {typed:.2f} | {back:.2f} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
