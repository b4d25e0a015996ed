"""Circuit breakers shared by every coordinator process through Redis (``REDIS_URL`` set).

The same state machine as ``breaker.BreakerBoard``, with the truth in one Redis hash per instance
(``<prefix>:<instance id>``: state, consecutive failures, open time, ``open_until`` on Redis's
own clock, operator epoch), changed only by one Lua script, so a failure seen by any process
counts toward the one threshold, and a breaker one process opens keeps every process away.

The board's methods stay synchronous (placement asks ``allows`` for every candidate): each
process keeps the local board as a cache and decides from it at once, and every verdict
(``success``, ``failure``), operator adoption and a re-read of a cached entry older than
``refresh_s`` go to Redis in order through one short-lived worker task; the script's answer
replaces the cached entry. So another process's trip reaches this one within ``refresh_s`` (or
at its own next verdict on that instance).

A half-open trial is one fleet-wide: ``claim`` (the request path's async ``begin``) takes the
local trial slot and then ``SET <prefix>:<id>:trial NX PX`` in Redis, valued with this board's
own token; a process that finds the key taken gives its slot back and keeps away from the
instance for ``refresh_s``. The trial's verdict (or release) deletes the key after the verdict
itself reached Redis, and only if this board still holds it; a process that dies mid-trial
leaves a claim that expires after ``trial_claim_s``. The queue to the worker is bounded
(``max_pending``), but a claim's deletion is never what a full queue drops: lost, it would keep
every process away from the instance's half-open trial until the claim expired. While Redis is unreachable the claim
falls back to the local slot: one trial per process, as a per-process board.

Operator overrides still win: the snapshot's higher ``breaker_epoch`` is adopted locally as
before and written to Redis with that epoch; the script ignores verdicts sent under an older
epoch than the one it holds (made before the operator acted) and answers with the operator's
state, which the cache takes.

Write-back: only the process whose verdict flipped the shared state reports it to ``sink``, so
the database records each closed/open flip once (half-open is not written back in this mode).
While Redis is unreachable the board falls back to its local state machine and reports its own
flips, as a per-process board does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from redis.exceptions import RedisError

from serving.pipeline.resilience.breaker import Breaker, BreakerBoard, State, TransitionSink
from serving.pipeline.snapshot import InstanceView

logger = logging.getLogger(__name__)

# KEYS[1]: the instance's hash. ARGV: 1 op (read | failure | success | adopt), 2 the caller's
# epoch, 3 threshold, 4 base open ms, 5 max open ms, 6 the operator's state (adopt).
# Returns {state, failures, ms until open_until (may be negative), open ms, epoch, flipped}.
_BREAKER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op, epoch = ARGV[1], tonumber(ARGV[2])
local h = redis.call('HMGET', KEYS[1], 'state', 'failures', 'open_until', 'open_ms', 'epoch')
local state = h[1] or 'closed'
local failures = tonumber(h[2] or '0')
local open_until = tonumber(h[3] or '0')
local open_ms = tonumber(h[4] or '0')
local stored = tonumber(h[5] or '0')
local flipped = 0
local base, max = tonumber(ARGV[4]), tonumber(ARGV[5])
if op == 'adopt' and epoch > stored then
  stored, failures = epoch, 0
  if ARGV[6] == 'closed' then
    state, open_ms = 'closed', 0
  else
    state = 'open'
    if open_ms < base then open_ms = base end
    open_until = now + open_ms
  end
elseif epoch >= stored and op == 'failure' then
  stored = epoch
  failures = failures + 1
  local half_open = state == 'open' and now >= open_until
  if half_open or (state == 'closed' and failures >= tonumber(ARGV[3])) then
    if open_ms == 0 then open_ms = base else open_ms = math.min(open_ms * 2, max) end
    open_until = now + open_ms
    state, flipped = 'open', 1
  end
elseif epoch >= stored and op == 'success' then
  stored = epoch
  failures = 0
  if state ~= 'closed' then state, open_ms, flipped = 'closed', 0, 1 end
end
if op ~= 'read' then
  redis.call('HSET', KEYS[1], 'state', state, 'failures', failures, 'open_until', open_until,
             'open_ms', open_ms, 'epoch', stored)
end
return {state, failures, open_until - now, open_ms, stored, flipped}
"""


# KEYS[1]: a trial claim. ARGV[1]: the claimer's token. Deletes the claim only if it is still ours
# (it may have expired and been taken by another process meanwhile).
_UNCLAIM = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class _Op:
    kind: str  # read | failure | success | adopt | unclaim
    instance: InstanceView
    epoch: int
    reason: str = ""
    local_move: tuple[State, str] | None = None  # what the local machine did, reported if Redis is away


class SharedBreakerBoard(BreakerBoard):
    """``BreakerBoard`` whose state lives in Redis, cached per process for synchronous reads."""

    def __init__(
        self, redis: Any, *, prefix: str = "motor:breaker", refresh_s: float = 1.0, threshold: int = 3,
        base_open_s: float = 5.0, max_open_s: float = 120.0, clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time, sink: TransitionSink | None = None, max_pending: int = 10_000,
        trial_claim_s: float = 600.0,
    ) -> None:
        super().__init__(threshold=threshold, base_open_s=base_open_s, max_open_s=max_open_s, clock=clock, wall=wall, sink=sink)
        self.redis = redis
        self.prefix = prefix
        self.refresh_s = refresh_s  # how stale this process's view of another's verdicts may get
        self._script = redis.register_script(_BREAKER)
        self._unclaim = redis.register_script(_UNCLAIM)
        # Bounds a dead process's claim; a trial that outlives it may meet a second one.
        self.trial_claim_s = trial_claim_s
        self._token = f"{os.getpid()}:{uuid.uuid4().hex}"  # this board's claims, not another's
        self._claims: set[int] = set()  # instance ids whose fleet-wide trial this board holds
        self._elsewhere: dict[int, float] = {}  # instance id -> until when another process's trial runs
        self._ops: deque[_Op] = deque()  # bounded by ``max_pending``, see ``_enqueue``
        self.max_pending = max_pending
        self.dropped = 0  # ops a full queue dropped (re-reads first, then verdicts; never an unclaim)
        self._worker: asyncio.Task[None] | None = None
        self._read_at: dict[int, float] = {}
        self._moved: tuple[State, str] | None = None  # the flip the last local verdict made

    # -- the synchronous interface: local decisions, Redis behind them ---------------------------

    def _get(self, instance: InstanceView) -> Breaker:
        first_sight = instance.id not in self._breakers
        b = super()._get(instance)
        if first_sight and instance.breaker_epoch > 0 and instance.breaker_state == "closed":
            # The local board takes an operator's reset as its starting state without adopting it
            # (nothing to undo here); Redis may still hold the state from before the reset.
            self._enqueue(_Op("adopt", instance, b.epoch, reason="closed"))
        if self._clock() - self._read_at.get(instance.id, -1e18) >= self.refresh_s:
            self._read_at[instance.id] = self._clock()
            self._enqueue(_Op("read", instance, b.epoch))
        return b

    def _adopt(self, b: Breaker, instance: InstanceView) -> None:
        super()._adopt(b, instance)
        self._enqueue(_Op("adopt", instance, b.epoch, reason=instance.breaker_state))  # (the operator's state)

    def allows(self, instance: InstanceView) -> bool:
        if self._elsewhere.get(instance.id, -1e18) > self._clock():
            return False  # another process holds the half-open trial
        return super().allows(instance)

    async def claim(self, instance: InstanceView) -> bool:
        """``begin``, and a half-open trial claimed in Redis so the fleet sends one, not one per process."""
        if self._elsewhere.get(instance.id, -1e18) > self._clock() or not self.begin(instance):
            return False
        b = self._breakers[instance.id]
        if not b.trial:
            return True  # closed: no trial to share
        key = self._claim_key(instance)
        try:
            won = await self.redis.set(key, self._token, nx=True, px=max(int(self.trial_claim_s * 1000), 1))
        except (RedisError, OSError) as exc:
            logger.warning("breaker redis unavailable instance=%s op=claim, trial claimed locally: %r",
                           instance.name, exc)
            return True
        except BaseException:
            # Cancelled while asking: the slot goes back, and a claim that may have landed with it.
            b.trial = False
            self._enqueue(_Op("unclaim", instance, b.epoch))
            raise
        if won:
            self._claims.add(instance.id)
            return True
        b.trial = False
        self._elsewhere[instance.id] = self._clock() + self.refresh_s
        logger.info("breaker instance=%s half-open trial held by another process", instance.name)
        return False

    def _claim_key(self, instance: InstanceView) -> str:
        return f"{self.prefix}:{instance.id}:trial"

    def _end_claim(self, instance: InstanceView) -> None:
        """The trial ended: its claim goes, after the verdict queued before it reached Redis."""
        if instance.id in self._claims:
            self._claims.discard(instance.id)
            self._enqueue(_Op("unclaim", instance, self._breakers[instance.id].epoch))

    def release(self, instance: InstanceView) -> None:
        super().release(instance)
        self._end_claim(instance)

    def success(self, instance: InstanceView) -> None:
        b = self._get(instance)
        # Most requests succeed on a closed breaker with no failures counted (as last read): then
        # Redis has nothing to learn, and the request path costs it no call.
        news = b.state is not State.CLOSED or b.failures > 0
        self._moved = None
        super().success(instance)
        if news:
            self._enqueue(_Op("success", instance, b.epoch, "trial succeeded", self._moved))
        self._end_claim(instance)

    def failure(self, instance: InstanceView, reason: str) -> None:
        self._moved = None
        super().failure(instance, reason)
        self._enqueue(_Op("failure", instance, self._get(instance).epoch, reason, self._moved))
        self._end_claim(instance)

    def _move(self, instance: InstanceView, b: Breaker, new: State, reason: str) -> None:
        # The flip is reported once Redis says this process made it (or Redis is away): not here.
        old, b.state = b.state, new
        self._moved = (new, reason)
        logger.info("breaker instance=%s %s->%s (local) failures=%d reason=%s", instance.name, old.value, new.value,
                    b.failures, reason)

    # -- Redis ------------------------------------------------------------------------------------

    def _enqueue(self, op: _Op) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a synchronous caller): the local verdict stands, the next read syncs
        if len(self._ops) >= self.max_pending:
            self._drop_one()
        self._ops.append(op)
        # (A worker of another, closed loop never finishes: start one on this loop.)
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._worker = loop.create_task(self._drain())

    def _drop_one(self) -> None:
        """Make room in a full queue (Redis slower than the verdicts come): drop the oldest re-read,
        else the oldest verdict or adoption; never an ``unclaim``.

        A dropped re-read is made again after ``refresh_s``, a dropped verdict costs one count
        toward the shared threshold, but a dropped ``unclaim`` would hold the fleet's one half-open
        trial of that instance for ``trial_claim_s`` (600 s by default) with no trial running.
        Unclaims are at most one per claim this board held, so keeping them all keeps the queue
        bounded by ``max_pending`` plus the instances with a claim.
        """
        for kinds in (("read",), ("failure", "success", "adopt")):
            for i, queued in enumerate(self._ops):
                if queued.kind in kinds:
                    del self._ops[i]
                    self.dropped += 1
                    logger.warning("breaker redis queue full, dropped instance=%s op=%s dropped_total=%d",
                                   queued.instance.name, queued.kind, self.dropped)
                    return

    async def _drain(self) -> None:
        while self._ops:
            op = self._ops.popleft()
            if op.kind == "unclaim":
                try:
                    await self._unclaim(keys=[self._claim_key(op.instance)], args=[self._token])
                except (RedisError, OSError) as exc:  # it expires on its own
                    logger.warning("breaker redis unavailable instance=%s op=unclaim: %r", op.instance.name, exc)
                continue
            try:
                result = await self._script(
                    keys=[f"{self.prefix}:{op.instance.id}"],
                    args=[op.kind, op.epoch, self.threshold, int(self.base_open_s * 1000), int(self.max_open_s * 1000),
                          op.reason if op.kind == "adopt" else ""],
                )
            except (RedisError, OSError) as exc:
                logger.warning("breaker redis unavailable instance=%s op=%s: %r", op.instance.name, op.kind, exc)
                if op.local_move is not None:  # fall back to the per-process board: report our own flip
                    self._report(op.instance, self._breakers[op.instance.id], *op.local_move)
                continue
            self._apply(op, result)

    def _apply(self, op: _Op, result: list[Any]) -> None:
        raw_state, failures, remaining_ms, open_ms, epoch, flipped = result
        state = State(raw_state.decode() if isinstance(raw_state, bytes) else raw_state)
        b = self._breakers.get(op.instance.id)
        if b is None or int(epoch) < b.epoch:
            return  # this process adopted a newer operator action; its own adopt is on the way
        b.epoch = int(epoch)
        b.failures = int(failures)
        b.open_s = int(open_ms) / 1000
        b.open_until = self._clock() + int(remaining_ms) / 1000
        if not (state is State.OPEN and b.state is State.HALF_OPEN and int(remaining_ms) <= 0):
            b.state = state  # (a half-open trial of this process stays in flight)
        if state is State.CLOSED:
            b.trial = False
        self._read_at[op.instance.id] = self._clock()
        if int(flipped):
            self._report(op.instance, b, state, op.reason)

    def _report(self, instance: InstanceView, b: Breaker, new: State, reason: str) -> None:
        logger.warning("breaker instance=%s ->%s failures=%d open_s=%.1f reason=%s shared=true",
                       instance.name, new.value, b.failures, b.open_s, reason)
        if self.sink is None:
            return
        open_until = self._wall() + (b.open_until - self._clock()) if new is State.OPEN else None
        try:
            self.sink(instance.id, new.value, reason, b.failures, open_until, b.open_s, b.epoch)
        except Exception:  # the write-back must never break a request
            logger.exception("breaker sink failed instance=%s", instance.name)

    async def flush(self) -> None:
        """Wait until every queued verdict and re-read reached Redis (tests, shutdown)."""
        while self._worker is not None and not self._worker.done():
            await asyncio.shield(self._worker)

    aclose = flush
