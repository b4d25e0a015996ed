"""When to restart a child that exited, and when to give up on it (a crash loop).

Pure bookkeeping on a clock the caller passes in, so the supervisor's decisions are tested
without processes or sleeps. The shape follows what supervisord and systemd do: exponential
back-off between starts, reset once the child has stayed up for a while, and a burst limit
(``Restart=`` with ``StartLimitBurst``/``StartLimitIntervalSec``) after which only that child is
left down.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Back-off and crash-loop limits for one restartable child."""

    # First delay after an exit; doubles with each exit that follows soon after.
    backoff_initial_s: float = 1.0
    # Cap on the delay: an engine that keeps dying is retried at least this often.
    backoff_max_s: float = 30.0
    # This many exits within ``crash_loop_window_s`` stop the restarts of this child alone.
    crash_loop_exits: int = 5
    crash_loop_window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        if self.crash_loop_exits < 1 or self.crash_loop_window_s <= 0:
            raise ValueError("need crash_loop_exits >= 1 and crash_loop_window_s > 0")


class RestartTracker:
    """The exit history of one child under a ``RestartPolicy``."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.restarts = 0
        self._backoff = policy.backoff_initial_s
        self._exits: deque[float] = deque()

    def record_exit(self, now: float, up_since: float | None) -> float | None:
        """Count an exit at ``now``; return the delay before the next start, or None to give up.

        ``up_since`` is when the child last became ready (None if it never did since its last
        start): a child that stayed up for a whole crash-loop window starts again from the
        initial delay, as one that failed once after a long healthy run should.
        """
        policy = self.policy
        if up_since is not None and now - up_since >= policy.crash_loop_window_s:
            self._backoff = policy.backoff_initial_s
        self._exits.append(now)
        while self._exits and now - self._exits[0] > policy.crash_loop_window_s:
            self._exits.popleft()
        if len(self._exits) >= policy.crash_loop_exits:
            return None
        delay = self._backoff
        self._backoff = min(self._backoff * 2, policy.backoff_max_s)
        self.restarts += 1
        return delay

    @property
    def recent_exits(self) -> int:
        """Exits counted in the current crash-loop window (as of the last ``record_exit``)."""
        return len(self._exits)
