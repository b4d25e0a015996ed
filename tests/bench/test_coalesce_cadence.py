"""bench/coalesce.py's cadence table: per engine token and per second of wall time (result math only)."""

from __future__ import annotations

from bench.coalesce import ENGINE_ALONE, Run, cadence_table


def test_the_cadence_row_divides_by_tokens_and_by_wall_time() -> None:
    run = Run(chunks=[10, 30], tokens=[64, 64], gaps=[0.01, 0.02, 0.03], ttft=[0.05], e2e=[1.0, 2.0],
              render_cpu=0.64, coordinator_cpu=0.32, seconds=2.0)
    row = cadence_table([(64, "on", run), (64, ENGINE_ALONE, Run())]).splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # 40 calls for 128 tokens; 0.96 s of CPU over 128 tokens; 128 tokens, 40 calls, 0.64 + 0.32 CPU s in 2 s.
    assert cells[:4] == ["64", "on", "0.312", "7500"]
    assert cells[-4:] == ["64", "20", "0.32", "0.16"]
