"""Back-off and crash-loop decisions of motorsite.restarts, on a clock the test moves."""

from __future__ import annotations

import pytest

from motorsite.restarts import RestartPolicy, RestartTracker

POLICY = RestartPolicy(backoff_initial_s=1, backoff_max_s=8, crash_loop_exits=5, crash_loop_window_s=60)


def test_it_doubles_the_delay_up_to_the_cap() -> None:
    tracker = RestartTracker(replace_exits(POLICY, 100))
    delays = [tracker.record_exit(now=t * 20.0, up_since=None) for t in range(6)]
    assert delays == [1, 2, 4, 8, 8, 8]
    assert tracker.restarts == 6


def test_it_gives_up_at_the_nth_exit_within_the_window() -> None:
    tracker = RestartTracker(POLICY)
    delays = [tracker.record_exit(now=float(t), up_since=None) for t in range(5)]
    assert delays[:4] == [1, 2, 4, 8]
    assert delays[4] is None
    assert tracker.restarts == 4  # the verdict is not a restart


def test_it_forgets_exits_older_than_the_window() -> None:
    tracker = RestartTracker(POLICY)
    for t in (0.0, 1.0, 2.0, 3.0):
        assert tracker.record_exit(now=t, up_since=None) is not None
    # 61 s after the first exit only three of the four are still in the window: no verdict.
    assert tracker.record_exit(now=61.0, up_since=None) is not None
    assert tracker.recent_exits == 4


def test_it_starts_again_from_the_initial_delay_after_a_long_healthy_run() -> None:
    tracker = RestartTracker(POLICY)
    assert tracker.record_exit(now=0.0, up_since=None) == 1
    assert tracker.record_exit(now=2.0, up_since=1.5) == 2  # up for half a second: keeps doubling
    assert tracker.record_exit(now=500.0, up_since=3.0) == 1  # up for minutes: back to the start


@pytest.mark.parametrize(
    "kwargs",
    [{"backoff_initial_s": 0}, {"backoff_initial_s": 5, "backoff_max_s": 1}, {"crash_loop_exits": 0}, {"crash_loop_window_s": 0}],
)
def test_it_refuses_a_policy_that_cannot_work(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]


def replace_exits(policy: RestartPolicy, exits: int) -> RestartPolicy:
    return RestartPolicy(policy.backoff_initial_s, policy.backoff_max_s, exits, policy.crash_loop_window_s)
