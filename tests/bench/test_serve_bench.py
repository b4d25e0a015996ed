"""bench/serve_bench.py's arguments and result math (the client runs are not tested here: no timings)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.serve_bench import (
    Cell,
    Run,
    all_paths,
    best_router,
    client_argv,
    finished,
    goals,
    interval_of,
    label,
    parser,
    round_ratios,
)


def run(rps: float, ttfts: list[float], latencies: list[float], lens: list[int], errors: list[str] | None = None,
        cpu: dict[str, float] | None = None) -> Run:
    result: dict[str, Any] = {
        "request_throughput": rps, "completed": sum(1 for e in (errors or [""] * len(ttfts)) if not e),
        "failed": sum(1 for e in (errors or []) if e), "ttfts": ttfts, "latencies": latencies, "output_lens": lens,
        "errors": errors or [""] * len(ttfts),
    }
    return Run(result, cpu or {}, "1.00 1.00 1.00")


def test_defaults_measure_the_issue_s_cells_on_every_path() -> None:
    args = parser().parse_args([])
    assert (args.workloads, args.apis, args.concurrency) == (["prefix"], ["completions"], [4, 16])
    assert all_paths(args) == ["direct", "motorsite", "motorsite-50ms", "motorsite-pool2", "motorsite-local", "sglang",
                               "vllm-router", "smg"]


def test_the_motorsite_variants_are_named_and_only_interval_paths_carry_an_interval() -> None:
    assert [interval_of(k) for k in ("motorsite", "motorsite-25ms", "motorsite-pool2", "motorsite-local", "smg")] == [
        0, 25, 0, 0, 0]
    assert label("motorsite-pool2") == "motorsite, render pool of 2"
    assert label("motorsite-local") == "motorsite, local_stream_detokenize"
    assert label("motorsite-25ms") == "motorsite, stream_interval_ms 25"


def test_paths_and_intervals_from_the_command_line() -> None:
    args = parser().parse_args(["--interval-ms", "25,50", "--paths", "smg,motorsite-25ms", "--concurrency", "1,4,16"])
    assert args.concurrency == [1, 4, 16]
    assert all_paths(args) == ["motorsite-25ms", "smg"]  # the tables' order, not the command line's


def test_an_unknown_path_is_refused() -> None:
    with pytest.raises(SystemExit, match="unknown paths"):
        all_paths(parser().parse_args(["--paths", "litellm"]))


def test_the_client_gets_the_workload_s_dataset_and_api(tmp_path: Path) -> None:
    args = parser().parse_args(["--prefixes", "4", "--output-len", "8"])
    argv = client_argv(args, "http://127.0.0.1:1", "prefix", "chat", 16, 7, tmp_path / "r.json", "/m")
    joined = " ".join(argv)
    assert "--backend openai-chat --base-url http://127.0.0.1:1 --endpoint /v1/chat/completions" in joined
    assert "--prefix-repetition-num-prefixes 4" in joined and "--prefix-repetition-output-len 8" in joined
    assert "--max-concurrency 16" in joined and "--seed 7" in joined and "--save-detailed" in joined
    random = " ".join(client_argv(args, "http://x", "random", "completions", 1, 1, tmp_path / "r.json", "/m"))
    assert "--dataset-name random" in random and "--backend openai --base-url http://x --endpoint /v1/completions" in random


def test_a_cell_pools_requests_and_computes_tpot_as_vllm_does() -> None:
    cell = Cell([
        run(10.0, [0.010, 0.020], [0.160, 0.320], [16, 16], cpu={"proxy": 0.03}),
        # A failed request counts in neither the latencies nor the CPU per request.
        run(20.0, [0.030, 0.5], [0.330, 0.0], [16, 0], errors=["", "boom"], cpu={"proxy": 0.03}),
    ])
    assert cell.rps() == 15.0
    assert cell.completed() == 3 and cell.failed() == 1
    assert cell.per_request()["tpot"] == pytest.approx([10.0, 20.0, 20.0])
    assert cell.stat("ttft", 0.5) == pytest.approx(20.0)
    assert cell.cpu_ms("proxy") == pytest.approx(20.0)  # 60 ms over 3 requests
    assert cell.cpu_ms("sidecar") is None


def test_goals_are_read_against_the_best_router_of_the_same_cell() -> None:
    cells = {
        "motorsite": Cell([run(40.0, [0.010], [0.100], [10]), run(60.0, [0.010], [0.100], [10])]),
        "sglang": Cell([run(45.0, [0.020], [0.110], [10]), run(45.0, [0.020], [0.110], [10])]),
        "smg": Cell([run(50.0, [0.020], [0.110], [10]), run(44.0, [0.020], [0.110], [10])]),
        "direct": Cell([run(99.0, [0.001], [0.010], [10])]),  # not a router: never "best"
    }
    assert best_router(cells) == "smg"  # 47 req/s on average against SGLang's 45
    # Per round the best router of that round: SMG's 50 in the first, SGLang's 45 in the second.
    assert round_ratios(cells, "motorsite") == pytest.approx([40 / 50, 60 / 45])
    text = goals(cells, "motorsite")
    assert "req/s 1.06x (held)" in text and "TTFT p50 0.50x (held)" in text
    assert "TPOT p50 1.00x (held)" in text and text.endswith("SMG gateway")


def test_goals_say_not_held_where_motorsite_is_behind() -> None:
    cells = {
        "motorsite": Cell([run(30.0, [0.030], [0.300], [10])]),
        "vllm-router": Cell([run(50.0, [0.020], [0.110], [10])]),
    }
    text = goals(cells, "motorsite")
    assert "req/s 0.60x (not held)" in text and "TTFT p50 1.50x (not held)" in text and "TPOT p50 3.00x (not held)" in text


def test_requests_per_engine_come_from_vllm_s_success_counter_summed_over_reasons() -> None:
    metrics = (
        "# TYPE vllm:request_success_total counter\n"
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 40.0\n'
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 2.0\n'
        'vllm:request_prompt_tokens_count{engine="0",model_name="tiny"} 99.0\n'
    )
    assert finished(metrics) == 42
    cell = Cell([run(1.0, [], [], []), run(1.0, [], [], [])])
    cell.runs[0].split, cell.runs[1].split = (10, 6), (7, 9)
    assert cell.split() == "17 / 15"
