"""Admission by tokens: a request holds ``prompt + resolved max output`` tokens on its instance.

Two limits: each instance's ``token_capacity`` and a coordinator-wide budget. A request that does
not fit waits in a bounded queue up to a deadline: a full queue is ``QueueFull`` (429 with
``Retry-After``), a passed deadline ``AdmissionTimeout`` (503). A request larger than an
instance's whole capacity is admitted when that instance is otherwise idle, so it cannot starve.

Fairness: one FIFO queue per instance. A waiter for a full instance holds back only later
requests for that same instance (so a large request is not overtaken forever by small ones),
never requests for other instances. The global budget is the one thing every instance shares:
a waiter that fits its instance but not the budget holds back every later request, for the same
reason.

A request that already holds leases and needs another (the prompts of one stream, opened one
after another, in one ``LeaseGroup``) never waits: its own leases would only come back
once the client reads the stream, which cannot start before every prompt is open. So it gets the
next lease at once or fails fast with ``AdmissionUnavailable`` (503), releasing what it holds.

``acquire`` refuses a non-positive amount with ``RequestError`` (400): the callers validate
first, but a negative count would make capacity stop applying, so the mechanism fails closed.

Every ``Lease`` is released exactly once, whatever the exit path: ``release()`` is idempotent
and leases are used as context managers, so success, error, cancellation and retry all return
the tokens (tests assert ``inflight_tokens() == {}`` after each).

``TokenAdmission`` is in-process; ``redis_admission.RedisTokenAdmission`` shares one budget and
the same queues among coordinator processes.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

from serving.pipeline.errors import AdmissionTimeout, AdmissionUnavailable, QueueFull, RequestError
from serving.pipeline.snapshot import InstanceView

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    global_budget: int | None = None  # tokens in flight across all instances; None = unlimited
    queue_size: int = 256  # waiters beyond this are refused at once (429)
    wait_s: float = 30.0  # how long a request may wait for room before 503
    retry_after_s: int = 1  # the hint sent with 429 and with a fail-fast 503


class _Releaser(Protocol):
    def _release(self, lease: Lease) -> None: ...


@dataclass(eq=False)
class Lease:
    """Tokens held on one instance; ``release()`` may be called any number of times."""

    admission: _Releaser
    instance: str
    tokens: int
    lease_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._release(self)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


@dataclass(eq=False)
class LeaseGroup:
    """The leases of one response's streams, opened together (``attempts.open_together`` makes
    one and hands it down to every ``acquire`` of those streams)."""

    leases: list[Lease] = field(default_factory=list)
    # One acquire at a time (``admission_turn``): the streams of one response open concurrently,
    # but take their leases one after another, so one that waits holds none of its siblings'
    # (two requests each holding one instance and waiting for the other's would wait out the deadline).
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)

    def holding(self) -> bool:
        return any(not lease.released for lease in self.leases)


@asynccontextmanager
async def admission_turn(group: LeaseGroup | None) -> AsyncIterator[None]:
    """In ``group``, the one turn of its request to acquire a lease; without one, nothing."""
    if group is None:
        yield
        return
    async with group.turn:
        yield


def check_tokens(tokens: object) -> int:
    """``tokens`` as a positive int; raises ``RequestError`` otherwise (fail closed)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise RequestError(f"a request must hold a positive number of tokens, not {tokens!r}")
    return tokens


def must_not_wait(settings: AdmissionSettings, tokens: int) -> AdmissionUnavailable:
    """The fail-fast error of a request that would wait on its own leases."""
    return AdmissionUnavailable(
        f"no engine capacity for {tokens} more tokens while this request holds its other prompts' "
        "tokens: the prompts of one stream are admitted together or not at all",
        retry_after_s=settings.retry_after_s,
    )


def timed_out(settings: AdmissionSettings, tokens: int) -> AdmissionTimeout:
    return AdmissionTimeout(f"no engine capacity for {tokens} tokens within {settings.wait_s:g}s")


def queue_full(settings: AdmissionSettings, waiting: int) -> QueueFull:
    return QueueFull(
        f"too many requests are waiting for engine capacity ({waiting} queued)",
        retry_after_s=settings.retry_after_s,
    )


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[None]
    instance: str
    capacity: int
    tokens: int


class TokenAdmission:
    """In-process token admission (one coordinator process)."""

    def __init__(self, settings: AdmissionSettings | None = None) -> None:
        self.settings = settings or AdmissionSettings()
        self._inflight: Counter[str] = Counter()
        self._total = 0
        self._waiters: deque[_Waiter] = deque()  # arrival order, every instance
        self._queued: Counter[str] = Counter()  # waiters per instance
        self._budget_blocked = False  # some waiter fits its instance but not the global budget

    def inflight_tokens(self) -> dict[str, int]:
        """Tokens held per instance name (instances holding none are absent)."""
        return {k: v for k, v in self._inflight.items() if v}

    def waiting(self) -> int:
        return len(self._waiters)

    def _instance_fits(self, instance: str, capacity: int, tokens: int) -> bool:
        held = self._inflight[instance]
        return held + tokens <= capacity or held == 0

    def _budget_fits(self, tokens: int) -> bool:
        budget = self.settings.global_budget
        return budget is None or self._total + tokens <= budget or self._total == 0

    def _may_pass(self, instance: str, capacity: int, tokens: int) -> bool:
        """Whether a new request may take its tokens now without overtaking a waiter."""
        return (
            not self._queued[instance] and not self._budget_blocked
            and self._instance_fits(instance, capacity, tokens) and self._budget_fits(tokens)
        )

    def has_room(self, instance: InstanceView, tokens: int) -> bool:
        return self._may_pass(instance.name, instance.token_capacity, tokens)

    def _take(self, instance: str, tokens: int) -> None:
        self._inflight[instance] += tokens
        self._total += tokens

    async def acquire(self, instance: InstanceView, tokens: int, group: LeaseGroup | None = None) -> Lease:
        """Hold ``tokens`` on ``instance``, waiting FIFO for room.

        Raises ``RequestError`` for a non-positive amount, ``QueueFull``, ``AdmissionTimeout``,
        or ``AdmissionUnavailable`` when it would have to wait while ``group`` holds a lease.
        """
        tokens = check_tokens(tokens)
        name, capacity = instance.name, instance.token_capacity
        together = group
        if self._may_pass(name, capacity, tokens):
            self._take(name, tokens)
            return self._granted(Lease(self, name, tokens), together)
        if together is not None and together.holding():
            raise must_not_wait(self.settings, tokens)
        if len(self._waiters) >= self.settings.queue_size:
            raise queue_full(self.settings, len(self._waiters))
        waiter = _Waiter(asyncio.get_running_loop().create_future(), name, capacity, tokens)
        self._waiters.append(waiter)
        self._queued[name] += 1
        self._wake()  # may set _budget_blocked for those who come after
        try:
            async with asyncio.timeout(self.settings.wait_s):
                await waiter.future
        except BaseException as exc:
            # Cancelled after being granted but before resuming: the tokens were taken for us.
            if waiter.future.done() and not waiter.future.cancelled():
                self._release_tokens(name, tokens)
            if isinstance(exc, TimeoutError):
                raise timed_out(self.settings, tokens) from None
            raise
        finally:
            if self._dequeue(waiter):
                self._wake()  # a head that left may unblock those behind it
        return self._granted(Lease(self, name, tokens), together)

    @staticmethod
    def _granted(lease: Lease, together: LeaseGroup | None) -> Lease:
        if together is not None:
            together.leases.append(lease)
        return lease

    def _dequeue(self, waiter: _Waiter) -> bool:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return False
        self._queued[waiter.instance] -= 1
        if not self._queued[waiter.instance]:
            del self._queued[waiter.instance]
        return True

    def _release(self, lease: Lease) -> None:
        self._release_tokens(lease.instance, lease.tokens)

    def _release_tokens(self, instance: str, tokens: int) -> None:
        self._inflight[instance] -= tokens
        self._total -= tokens
        if self._inflight[instance] <= 0:
            del self._inflight[instance]
        self._wake()

    def _wake(self) -> None:
        """Grant waiters in arrival order, skipping instances whose head does not fit."""
        blocked: set[str] = set()
        self._budget_blocked = False
        for waiter in list(self._waiters):
            if waiter.future.done():  # cancelled; its acquire dequeues it
                blocked.add(waiter.instance)  # keep its place until then: FIFO per instance
                continue
            if waiter.instance in blocked:
                continue
            if not self._instance_fits(waiter.instance, waiter.capacity, waiter.tokens):
                blocked.add(waiter.instance)  # the head of a full instance holds back only its own
                continue
            if not self._budget_fits(waiter.tokens):
                # The budget spans instances: a waiter held only by it holds back everyone later.
                self._budget_blocked = True
                return
            self._dequeue(waiter)
            self._take(waiter.instance, waiter.tokens)
            waiter.future.set_result(None)
