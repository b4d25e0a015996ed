"""KV-cache affinity benchmark: round-robin vs approximate vs event-driven placement.

A shared-prefix multi-tenant workload (each tenant has a long system prompt, every request adds
a unique question) over several simulated union engines whose latency model charges prefill
time only for tokens missing from their prefix cache, and whose caches are too small to hold
every tenant on every instance. The same request sequence runs under each placement policy in
one run; then the cost of one scoring decision is timed at 10, 100 and 1000 instances.

    python3 -m toolchain exec bench/affinity.py [--write]

Placement here is the index plus a simple scorer (cached blocks minus a load penalty), driven
directly against the simulators' ``/inference/v1/generate``; the coordinator's scheduler wires
the same index.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import loadavg, machine, write_section  # noqa: E402
from bench.common import nearest_rank as pct  # noqa: E402
from enginesim import SimConfig  # noqa: E402
from enginesim.testing import LiveServer  # noqa: E402
from motorsite.supervisor import free_port  # noqa: E402
from serving.pipeline.placement.kv_affinity import KVAffinityIndex  # noqa: E402
from serving.pipeline.placement.kv_events import KVEventSubscriber  # noqa: E402

SECTION = "## bench/affinity.py"
BLOCK = 128
INSTANCES = 4
TENANTS = 12
SYSTEM_BLOCKS = 8  # 1024-token system prompts
QUESTION = 100
REQUESTS = 192
CONCURRENCY = 8
MAX_TOKENS = 8
CACHE_BLOCKS = 40  # per instance: 5 tenants' prefixes, not all 12
TTFT_MS_PER_TOKEN = 0.4
TPOT_MS = 2.0
LOAD_PENALTY_BLOCKS = 2.0  # one request in flight is worth this many cached blocks


@dataclass
class Result:
    policy: str
    ttft: list[float]
    elapsed: float
    hit_tokens: int
    prompt_tokens: int
    placements: Counter[str]


def workload(seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 4000) for _ in range(SYSTEM_BLOCKS * BLOCK)] for _ in range(TENANTS)]
    # Zipf-ish tenant popularity: a few tenants send most of the traffic.
    weights = [1.0 / (i + 1) for i in range(TENANTS)]
    out = []
    for _ in range(REQUESTS):
        tenant = rng.choices(range(TENANTS), weights)[0]
        out.append(systems[tenant] + [rng.randrange(10, 4000) for _ in range(QUESTION)])
    return out


class Policy:
    name = "round-robin"

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.inflight: Counter[str] = Counter()
        self._next = 0

    def place(self, prompt: list[int]) -> str:
        name = self.names[self._next % len(self.names)]
        self._next += 1
        return name


class Affinity(Policy):
    def __init__(self, names: list[str], index: KVAffinityIndex, *, record: bool, name: str) -> None:
        super().__init__(names)
        self.index = index
        self.record = record
        self.name = name

    def place(self, prompt: list[int]) -> str:
        return choose(self.index, self.names, self.inflight, prompt, record=self.record)


def choose(index: KVAffinityIndex, names: list[str], inflight: Counter[str], prompt: list[int], *, record: bool) -> str:
    """The scorer: cached leading blocks minus a load penalty; ties to the least loaded."""
    depths = index.depths(prompt)
    best = max(names, key=lambda n: (depths.get(n, 0) - LOAD_PENALTY_BLOCKS * inflight[n], -inflight[n]))
    if record:
        index.record(best, prompt)
    return best


async def run_policy(policy: Policy, servers: dict[str, LiveServer], prompts: list[list[int]]) -> Result:
    async with httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=64)) as http:
        for server in servers.values():
            await http.delete(server.url + "/sim/cache")
        before = {n: (await http.get(s.url + "/sim/stats")).json() for n, s in servers.items()}
        queue: asyncio.Queue[list[int]] = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        ttft: list[float] = []
        placements: Counter[str] = Counter()

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                name = policy.place(prompt)
                placements[name] += 1
                policy.inflight[name] += 1
                body = {
                    "token_ids": prompt,
                    "sampling_params": {"max_tokens": MAX_TOKENS, "ignore_eos": True},
                    "stream": True,
                }
                start = time.perf_counter()
                first = None
                try:
                    async with http.stream("POST", servers[name].url + "/inference/v1/generate", json=body) as r:
                        async for line in r.aiter_lines():
                            if first is None and line.startswith("data: {"):
                                first = time.perf_counter() - start
                finally:
                    policy.inflight[name] -= 1
                ttft.append(first if first is not None else float("nan"))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        elapsed = time.perf_counter() - start
        hit = prompt_tokens = 0
        for n, s in servers.items():
            after = (await http.get(s.url + "/sim/stats")).json()
            src_a, src_b = after["prompt_tokens_by_source"], before[n]["prompt_tokens_by_source"]
            hit += src_a.get("local_cache_hit", 0) - src_b.get("local_cache_hit", 0)
            prompt_tokens += sum(src_a.values()) - sum(src_b.values())
    return Result(policy.name, ttft, elapsed, hit, prompt_tokens, placements)


async def wait_subscribed(servers: dict[str, LiveServer], subscribers: list[KVEventSubscriber]) -> None:
    async with httpx.AsyncClient(timeout=10.0) as http:
        for n in range(500):
            pending = [s for s in subscribers if not s.batches]
            if not pending:
                return
            for sub in pending:
                body = {"token_ids": [5 + n % 50] * BLOCK, "sampling_params": {"max_tokens": 1}}
                await http.post(servers[sub.instance].url + "/inference/v1/generate", json=body)
            await asyncio.sleep(0.01)
    raise RuntimeError("KV event subscribers never received an event")


def microbench() -> list[tuple[int, float, float, float]]:
    """Per instance count: µs per ``Scheduler.place``, µs scoring every candidate as the previous
    scheduler did (``candidates()`` sorted, the index asked about each rival), µs hashing alone."""
    rng = random.Random(3)
    prompt = [rng.randrange(10, 4000) for _ in range(2048)]  # 16 blocks
    return [(count, *decision_costs(count, rng, prompt)) for count in (10, 100, 1000)]


def decision_costs(count: int, rng: random.Random, prompt: list[int]) -> tuple[float, float, float]:
    from contextlib import ExitStack
    from dataclasses import replace

    from serving.pipeline.flow_control.admission import TokenAdmission
    from serving.pipeline.placement.kv_affinity import chain_hashes
    from serving.pipeline.placement.load import LoadTracker
    from serving.pipeline.placement.scheduler import Scheduler
    from serving.pipeline.snapshot import FleetSnapshot, InstanceView, ModelView, RenderView

    template = InstanceView(
        id=0, name="", url="", role="union", model="m", weight=1, token_capacity=65536,
        max_model_len=4096, token_generate=True, native_openai=False, tokenizer=False, state="active",
    )
    fleet = tuple(replace(template, id=n, name=f"i{n}", url=f"http://127.0.0.1:{10000 + n}") for n in range(count))
    snapshot = FleetSnapshot(
        version=1, models={"m": ModelView("m", "/m", 4096)},
        render=RenderView(enable=True, base_url="http://127.0.0.1:1", timeout_s=5.0), instances=fleet,
    )
    index = KVAffinityIndex()
    scheduler = Scheduler(LoadTracker(), admission=TokenAdmission(), affinity=index)
    for i in fleet:
        for _ in range(4):
            index.record(i.name, prompt[: rng.randrange(1, 16) * BLOCK] + [rng.randrange(10, 4000)] * BLOCK)
    rounds = max(50, 50_000 // count)

    def per_call(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        for _ in range(rounds):
            fn()
        return (time.perf_counter() - start) / rounds * 1e6

    def scored_all() -> object:
        candidates = scheduler.candidates(snapshot, "m", tokens=len(prompt))
        depths = index.depths(prompt)
        return max(candidates, key=lambda c: depths.get(c.name, 0))

    with ExitStack() as held:
        for i in fleet:  # three in four instances busy, 0-3 requests each
            for _ in range(rng.randrange(0, 4)):
                held.enter_context(scheduler.load.hold(i))
        place = per_call(lambda: scheduler.place(snapshot, "m", prompt, tokens=len(prompt)))
        previous = per_call(scored_all)
        hashing = per_call(lambda: chain_hashes(prompt, BLOCK))
    return place, previous, hashing


async def main_async() -> tuple[list[Result], list[tuple[int, float, float]]]:
    ports = [free_port() for _ in range(INSTANCES)]
    names = [f"sim-{n + 1}" for n in range(INSTANCES)]
    event_index = KVAffinityIndex()
    subscribers = [
        KVEventSubscriber(name, f"tcp://127.0.0.1:{port}", event_index, topic="kv")
        for name, port in zip(names, ports, strict=True)
    ]
    for sub in subscribers:
        sub.start()
        await sub.wait_ready()
    servers: dict[str, LiveServer] = {}
    for name, port in zip(names, ports, strict=True):
        config = SimConfig(
            vocab_size=4096, max_model_len=4096, block_size=BLOCK, cache_blocks=CACHE_BLOCKS,
            ttft_per_token_ms=TTFT_MS_PER_TOKEN, tpot_ms=TPOT_MS, seed=0,
            kv_events_endpoint=f"tcp://127.0.0.1:{port}", kv_events_topic="kv",
        )  # fmt: skip
        servers[name] = LiveServer(config)
        servers[name].start()
    try:
        await wait_subscribed(servers, subscribers)
        prompts = workload()
        results = []
        for policy in (
            Policy(names),
            Affinity(
                names, KVAffinityIndex(max_blocks_per_instance=CACHE_BLOCKS), record=True, name="approximate affinity"
            ),
            Affinity(names, event_index, record=False, name="event-driven affinity"),
            # Both at once: placements fill the gap until the engine's events arrive.
            Affinity(names, event_index, record=True, name="event-driven + placements"),
        ):
            event_index.clear_all()
            results.append(await run_policy(policy, servers, prompts))
            await asyncio.sleep(0.2)  # let the last events land before the next policy clears
    finally:
        for server in servers.values():
            server.stop()
        for sub in subscribers:
            await sub.aclose()
    return results, microbench()


def machine_line() -> str:
    return f"{machine(memory=False)}; load average {loadavg()} at the end"


def decision_table(micro: list[tuple[int, float, float, float]]) -> list[str]:
    return [
        "Cost of one placement decision: the coordinator's `Scheduler.place` (filter, score, pick, KV-affinity "
        "lookup and the approximate-mode record, prefix hashing included) beside scoring every candidate as the "
        "previous scheduler did (sort all candidates by load, ask the index about each), in the same run; "
        "a 2048-token prompt (16 blocks of 128), each instance indexed with 4 prompts, three in four instances busy:",
        "",
        "| instances | µs per `Scheduler.place` | µs scoring every candidate (previous algorithm, this hashing) | ratio | µs hashing the prompt alone |",
        "|---:|---:|---:|---:|---:|",
        *(f"| {count} | {place:.1f} | {previous:.1f} | {previous / place:.1f}x | {hashing:.1f} |"
          for count, place, previous, hashing in micro),
    ]


def report(results: list[Result], micro: list[tuple[int, float, float, float]]) -> str:
    lines = [
        SECTION,
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- machine: {machine_line()} (shared with other work: compare columns, not runs)",
        "- command: `python3 -m toolchain exec bench/affinity.py --write` (from the repository root)",
        f"- workload: {REQUESTS} streaming generate requests, concurrency {CONCURRENCY}, {TENANTS} tenants "
        f"(Zipf-like popularity), each prompt = the tenant's {SYSTEM_BLOCKS * BLOCK}-token system prompt + "
        f"{QUESTION} unique tokens, max_tokens {MAX_TOKENS}; {INSTANCES} in-process enginesim union instances, "
        f"block size {BLOCK}, {CACHE_BLOCKS} cached blocks each (holds 5 of the 12 tenant prefixes), "
        f"prefill {TTFT_MS_PER_TOKEN} ms per uncached prompt token, {TPOT_MS} ms per output token; "
        "the same request sequence for every policy, caches emptied between policies",
        f"- scorer: cached leading blocks − {LOAD_PENALTY_BLOCKS:g} × requests in flight, ties to the least loaded; "
        "approximate = index fed by its own placements (LRU sized like the engine cache), "
        "event-driven = index fed only by the engines' ZMQ KV events (BlockStored / BlockRemoved), "
        "event-driven + placements = both",
        "",
        "| policy | prefix hit rate | TTFT p50 (ms) | TTFT p90 (ms) | throughput (req/s) | requests per instance |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        rate = r.hit_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        spread = " / ".join(str(r.placements[n]) for n in sorted(r.placements))
        lines.append(
            f"| {r.policy} | {rate:.1%} | {pct(r.ttft, 0.5) * 1000:.1f} | {pct(r.ttft, 0.9) * 1000:.1f} "
            f"| {len(r.ttft) / r.elapsed:.1f} | {spread} |"
        )
    lines += ["", *decision_table(micro)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite this section of bench/RESULTS.md")
    parser.add_argument("--decisions", action="store_true", help="only time placement decisions; print, never write")
    args = parser.parse_args()
    if args.decisions:
        print("\n".join(decision_table(microbench())))
        return
    results, micro = asyncio.run(main_async())
    section = report(results, micro)
    print(section)
    if args.write:
        write_section(SECTION, section)


if __name__ == "__main__":
    main()
