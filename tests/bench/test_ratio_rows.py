"""bench/common.py's ratio table rows, shared by bench/sidecar_uds.py and bench/uds_transport.py."""

from __future__ import annotations

from bench.common import ratio_rows


def test_it_gives_each_variants_median_parts_and_its_ratio_to_the_base_round_by_round() -> None:
    rounds = {"tcp": [(4.0, 6.0), (5.0, 5.0), (6.0, 6.0)], "unix": [(3.0, 5.0), (4.0, 5.0), (3.0, 6.0)]}
    assert ratio_rows(rounds, "tcp", 1) == [
        "| tcp | 5.0 | 6.0 | 10.0 | 1.000x (1.00-1.00) |",
        "| unix | 3.0 | 5.0 | 9.0 | 0.800x (0.75-0.90) |",
    ]


def test_a_round_where_the_base_cost_nothing_has_no_ratio() -> None:
    rounds = {"tcp": [(0.0, 0.0), (1.0, 1.0)], "unix": [(1.0, 0.0), (1.0, 0.5)]}
    assert ratio_rows(rounds, "tcp", 2)[1] == "| unix | 1.00 | 0.25 | 1.25 | 0.750x (0.75-0.75) |"
