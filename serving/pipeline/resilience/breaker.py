"""Per-instance circuit breakers (after Saleor's ``breaker_board``), one board per process.

closed --(``threshold`` consecutive failures)--> open --(open time passed)--> half_open
half_open --(its one trial succeeds)--> closed;  half_open --(trial fails)--> open, time doubled

Open time starts at ``base_open_s`` and doubles on each re-open up to ``max_open_s``; a close
resets it. Only engine faults count (connect errors, timeouts, 5xx other than the engine's own
admission 503, broken streams): the caller decides, this module only counts.

Operators act through the database (reset, force open): the snapshot carries each instance's
``breaker_state`` and ``breaker_epoch``, and a higher epoch than the board has seen is adopted
as is. Every transition the request path makes is reported to ``sink`` so the control plane
can record it (write-back, no epoch bump).
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from serving.pipeline.snapshot import InstanceView

logger = logging.getLogger(__name__)


class State(enum.Enum):
    CLOSED = "closed"  # traffic flows, failures are counted
    OPEN = "open"  # no traffic until open_until
    HALF_OPEN = "half_open"  # exactly one trial request is let through


class TransitionSink(Protocol):
    """Receives every transition; ``epoch`` is the operator epoch the breaker had adopted when it
    moved, so the control plane can drop a transition that an operator action has overtaken."""

    def __call__(
        self, instance_id: int, new_state: str, reason: str, consecutive_failures: int,
        open_until: float | None, open_seconds: float, epoch: int,
    ) -> None: ...


@dataclass
class Breaker:
    state: State = State.CLOSED
    failures: int = 0
    open_until: float = 0.0  # monotonic clock
    open_s: float = 0.0  # the current open time; 0 until first tripped
    epoch: int = 0
    trial: bool = False  # a half-open trial is in flight


class BreakerBoard:
    def __init__(
        self, *, threshold: int = 3, base_open_s: float = 5.0, max_open_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
        sink: TransitionSink | None = None,
    ) -> None:
        self.threshold = threshold
        self.base_open_s = base_open_s
        self.max_open_s = max_open_s
        self._clock = clock
        self._wall = wall
        self.sink = sink
        self._breakers: dict[int, Breaker] = {}

    def _get(self, instance: InstanceView) -> Breaker:
        b = self._breakers.get(instance.id)
        if b is None:
            b = self._breakers[instance.id] = Breaker(epoch=instance.breaker_epoch)
            if instance.breaker_state != "closed":
                self._adopt(b, instance)
        elif instance.breaker_epoch > b.epoch:
            self._adopt(b, instance)
        return b

    def _adopt(self, b: Breaker, instance: InstanceView) -> None:
        """An operator reset or forced the breaker open: start over from their state."""
        b.epoch = instance.breaker_epoch
        b.failures = 0
        b.trial = False
        if instance.breaker_state == "closed":
            b.state, b.open_s = State.CLOSED, 0.0
        else:
            b.state = State.OPEN
            b.open_s = max(b.open_s, self.base_open_s)
            b.open_until = self._clock() + b.open_s
        logger.info("breaker instance=%s adopted state=%s epoch=%d", instance.name, b.state.value, b.epoch)

    def state(self, instance: InstanceView) -> State:
        b = self._get(instance)
        if b.state is State.OPEN and self._clock() >= b.open_until:
            return State.HALF_OPEN
        return b.state

    def allows(self, instance: InstanceView) -> bool:
        """Whether placement may consider ``instance`` now (without claiming a half-open trial)."""
        b = self._get(instance)
        if b.state is State.CLOSED:
            return True
        if b.state is State.OPEN:
            return self._clock() >= b.open_until
        return not b.trial

    def begin(self, instance: InstanceView) -> bool:
        """Claim the right to send one request; False when the breaker keeps it away."""
        b = self._get(instance)
        if b.state is State.CLOSED:
            return True
        if b.state is State.OPEN:
            if self._clock() < b.open_until:
                return False
            self._move(instance, b, State.HALF_OPEN, "open time passed")
        if b.trial:
            return False
        b.trial = True
        return True

    async def claim(self, instance: InstanceView) -> bool:
        """``begin`` for the request path: a shared board (``SharedBreakerBoard``) also claims a
        half-open trial across processes there; this one keeps it per process."""
        return self.begin(instance)

    def release(self, instance: InstanceView) -> None:
        """The claimed request ended without a verdict on the engine (4xx, busy, cancelled)."""
        self._get(instance).trial = False

    def success(self, instance: InstanceView) -> None:
        b = self._get(instance)
        b.trial = False
        b.failures = 0
        if b.state is not State.CLOSED:
            b.open_s = 0.0
            self._move(instance, b, State.CLOSED, "trial succeeded")

    def failure(self, instance: InstanceView, reason: str) -> None:
        b = self._get(instance)
        b.trial = False
        b.failures += 1
        if b.state is State.HALF_OPEN or (b.state is State.CLOSED and b.failures >= self.threshold):
            b.open_s = self.base_open_s if b.open_s == 0 else min(b.open_s * 2, self.max_open_s)
            b.open_until = self._clock() + b.open_s
            self._move(instance, b, State.OPEN, reason)

    def _move(self, instance: InstanceView, b: Breaker, new: State, reason: str) -> None:
        old, b.state = b.state, new
        logger.warning(
            "breaker instance=%s %s->%s failures=%d open_s=%.1f reason=%s",
            instance.name, old.value, new.value, b.failures, b.open_s, reason,
        )
        if self.sink is not None:
            open_until = self._wall() + (b.open_until - self._clock()) if new is State.OPEN else None
            try:
                self.sink(instance.id, new.value, reason, b.failures, open_until, b.open_s, b.epoch)
            except Exception:  # the write-back must never break a request
                logger.exception("breaker sink failed instance=%s", instance.name)

    def snapshot(self) -> dict[int, str]:
        """State per instance id, for metrics and tests."""
        return {i: b.state.value for i, b in self._breakers.items()}
