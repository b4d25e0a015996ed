"""The benchmark's pure parts: /proc stat parsing, process-tree CPU, and the peer table's arithmetic.

The benchmark itself (bench/peers.py) starts engines and gateways and is never run by the suite.
"""

from __future__ import annotations

import subprocess
import sys

from bench.common import ProcStat, parse_stat, tree_cpu_seconds, tree_ticks
from bench.first_path import Sample
from bench.peers import Cell, Route, per_request, ratio, table


def test_stat_parsing_survives_a_command_name_with_spaces_and_parentheses() -> None:
    line = "4242 (my (odd) name) S 17 4242 4242 0 -1 4194560 10 0 0 0 7 3 5 6 20 0 1 0 100 0 0"
    assert parse_stat(line) == ProcStat(ppid=17, pgrp=4242, own=10, reaped=11)


def test_a_tree_counts_its_descendants_and_their_reaped_children_but_nothing_beside_it() -> None:
    stats = {
        10: ProcStat(1, 10, own=5, reaped=2),  # the proxy; 2 ticks of a worker it already waited for
        11: ProcStat(10, 10, own=7, reaped=0),  # its worker
        12: ProcStat(11, 99, own=3, reaped=0),  # a grandchild in a session of its own: still in the tree
        20: ProcStat(1, 20, own=100, reaped=0),  # another process on the machine
    }
    assert tree_ticks(stats, 10) == 5 + 2 + 7 + 3
    assert tree_ticks(stats, 11) == 10
    assert tree_ticks(stats, 404) == 0  # a proxy that is gone costs nothing more


def test_the_cpu_of_a_finished_grandchild_stays_in_its_parents_tree() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys, time\nsubprocess.run([sys.executable, '-c', {burn!r}])\nprint('done', flush=True)\ntime.sleep(30)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline() == "done\n"
        # The grandchild has exited and been waited for: only the parent's cutime still holds its CPU.
        assert tree_cpu_seconds(parent.pid) >= 0.25
    finally:
        parent.kill()
        parent.wait()


def _cell(*samples: Sample, proxy: float = 0.0, render: float = 0.0) -> Cell:
    return Cell(list(samples), proxy_cpu=proxy, render_cpu=render)


def test_ratios_and_cpu_per_request_come_from_successful_samples_and_all_requests() -> None:
    base = _cell(Sample(ttft=0.010, e2e=0.100, tokens=32), Sample(ttft=0.010, e2e=0.100, tokens=32))
    proxy = _cell(Sample(ttft=0.015, e2e=0.120, tokens=32), Sample(error="HTTP 502"), proxy=0.004)
    assert ratio(proxy, base, "ttft") == "1.50×"
    assert ratio(proxy, None, "ttft") == "–"
    assert per_request(proxy.proxy_cpu, proxy) == "2.0"  # 4 ms over two requests, the failed one included


def test_the_table_reports_the_sidecar_apart_and_summed_and_no_ttft_for_json() -> None:
    runs = {"stream": None, "json": None}
    paths = [Route("direct", runs), Route("motorsite", runs, cpu_roots=(1,), sidecar=True)]  # type: ignore[arg-type]
    stream = Sample(ttft=0.010, e2e=0.041, tokens=32)
    cells = {
        ("direct", "stream", 1): _cell(stream),
        ("motorsite", "stream", 1): _cell(stream, proxy=0.003, render=0.001),
        ("direct", "json", 1): _cell(Sample(e2e=0.040, tokens=32)),
        ("motorsite", "json", 1): _cell(Sample(e2e=0.080, tokens=32), proxy=0.002, render=0.001),
    }
    rows = table(cells, paths, "direct").splitlines()[2:]
    assert rows[1].startswith("| stream | 1 | motorsite | 10.0 | 10.0 | 1.00× | 1.0 | 1.0 | 41.0 | 41.0 | 1.00× | 3.0 | 1.0 | 4.0 |")
    assert rows[3].startswith("| json | 1 | motorsite | – | – | – | – | – | 80.0 | 80.0 | 2.00× | 2.0 | 1.0 | 3.0 |")
    assert "| – | – | – |" in rows[0]  # vLLM direct: no proxy, no sidecar

