"""What a tokenized prompt holds per token: the render reply's ids and what tokenization keeps of them.

A stream keeps its ``TokenizedRequest`` for its whole life (a relay continues from the prompt's
ids), so this is what a long prompt adds to every silent stream on top of ``bench/slow_reader.py``'s
floor (whose fake render answers prompts of a few tokens). Each prompt comes from a render
reply parsed as the upstream client parses it (orjson), through ``TokenizationService``; the
heap is tracemalloc's, after a garbage collection, over ``--prompts`` prompts held at once.

    python3 -m toolchain exec bench/prompt_ids.py [--tokens 2000] [--prompts 16]

Reports numbers only.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tracemalloc
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import orjson

from serving.pipeline.render.tokenization import TokenizationService
from serving.pipeline.tracing import NO_TRACE


class _Render:
    """A render sidecar's reply, bytes parsed as the upstream client parses them."""

    def __init__(self, tokens: int) -> None:
        # Ids above 256 are separate int objects, as a real vocabulary's mostly are.
        self.raw = orjson.dumps([{"request_id": "cmpl-x", "token_ids": list(range(1000, 1000 + tokens)),
                                  "sampling_params": {"max_tokens": 16}}])

    async def render_completions(
        self, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> list[dict[str, Any]]:
        return orjson.loads(self.raw)


async def held_per_prompt(tokens: int, prompts: int) -> float:
    service = TokenizationService(_Render(tokens), SimpleNamespace(name="m", model_path=""))  # type: ignore[arg-type]
    await service.tokenize("completions", {"prompt": "x"}, "warm")
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    held = [await service.tokenize("completions", {"prompt": "x"}, f"r{i}") for i in range(prompts)]
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(held) == prompts
    return (after - before) / prompts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()
    held = asyncio.run(held_per_prompt(args.tokens, args.prompts))
    print(f"{args.tokens}-token prompt: {held / 1024:.1f} KiB held per prompt, {held / args.tokens:.1f} bytes a token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
