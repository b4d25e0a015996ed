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
local trial slot and then the claim ``<prefix>:<id>:trial`` in Redis, valued with a token of
this claim's own; a process that finds it taken gives its slot back and keeps away from the
instance for ``refresh_s``. The trial's verdict (or release) deletes the claim after the verdict
itself reached Redis, and only if it is still this claim; a process that dies mid-trial leaves a
claim that lapses after ``trial_claim_s``. A deletion is never lost while this process lives:
a full queue to the worker (``max_pending``) never drops one, and one that meets Redis away is
sent again when Redis answers (at the next call that reaches it, or by a retry with backoff),
until the claim would have lapsed anyway. Lost, it would keep every process away from the
instance's half-open trial until then (600 s by default). While Redis is unreachable the claim
falls back to the local slot: one trial per process, as a per-process board.

Open periods and claims are timed on the clock of ``redis_clock`` (``<prefix>:clock``), not on
Redis's ``TIME`` or its key expiry: both are the server's wall clock, and a step of it forward
ended every open period and claim at once, a step back held them for as long as the step. The
clock moves at most ``clock_step_ms`` per script (twice the re-read interval, at least 1 s), so
a step shortens an open period or a claim by no more than that; after a fleet-wide lull with no
breaker call at all it lags, which can hold an open breaker up to its remaining open time longer.

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

from serving.pipeline.redis_clock import clock_lua
from serving.pipeline.resilience.breaker import Breaker, BreakerBoard, State, TransitionSink
from serving.pipeline.snapshot import InstanceView

logger = logging.getLogger(__name__)

# KEYS[1]: the instance's hash, 2: the breakers' clock. ARGV: 1 op (read | failure | success |
# adopt), 2 the caller's epoch, 3 threshold, 4 base open ms, 5 max open ms, 6 the operator's state
# (adopt), 7 the clock's largest step ms. Returns {state, failures, ms until open_until (may be
# negative), open ms, epoch, flipped}. open_until is on the clock of ``redis_clock``, not TIME.
_BREAKER = clock_lua("KEYS[2]", "ARGV[7]") + """
local now = now_ms()
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


# KEYS[1]: a trial claim (a hash: the claimer's token, until when on the clock), 2: the breakers'
# clock. ARGV: 1 the claimer's token, 2 the claim's lifetime ms, 3 the clock's largest step ms.
# Returns 1 if the claim is now the caller's. Not ``SET NX PX``: Redis's key expiry is on its wall
# clock, and a step of it would end a live trial's claim (forward) or keep a dead process's for
# as long as the step (back).
_CLAIM = clock_lua("KEYS[2]", "ARGV[3]") + """
local now = now_ms()
-- A claim of the previous version (a string, SET NX PX) holds until Redis expires it.
if redis.call('TYPE', KEYS[1]).ok == 'string' then return 0 end
local c = redis.call('HMGET', KEYS[1], 'token', 'until')
if c[1] and c[1] ~= ARGV[1] and tonumber(c[2]) > now then return 0 end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'until', now + tonumber(ARGV[2]))
return 1
"""

# KEYS[1]: a trial claim. ARGV[1]: the claimer's token. Deletes the claim only if it is still ours
# (it may have expired and been taken by another process meanwhile).
_UNCLAIM = """
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then return 0 end
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class _Op:
    kind: str  # read | failure | success | adopt | unclaim
    instance: InstanceView
    epoch: int
    reason: str = ""
    local_move: tuple[State, str] | None = None  # what the local machine did, reported if Redis is away
    token: str = ""  # unclaim: the token of the claim to delete
    give_up_at: float | None = None  # unclaim: when its claim has lapsed (None: trial_claim_s from now)


@dataclass(frozen=True, slots=True)
class _Unreleased:
    """A trial claim whose deletion met Redis away: sent again until ``give_up_at`` (it has lapsed)."""

    instance: InstanceView
    token: str
    give_up_at: float  # on the board's clock


class SharedBreakerBoard(BreakerBoard):
    """``BreakerBoard`` whose state lives in Redis, cached per process for synchronous reads."""

    def __init__(
        self, redis: Any, *, prefix: str = "motor:breaker", refresh_s: float = 1.0, threshold: int = 3,
        base_open_s: float = 5.0, max_open_s: float = 120.0, clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time, sink: TransitionSink | None = None, max_pending: int = 10_000,
        trial_claim_s: float = 600.0, release_retry_s: float = 0.5,
    ) -> None:
        super().__init__(threshold=threshold, base_open_s=base_open_s, max_open_s=max_open_s, clock=clock, wall=wall, sink=sink)
        self.redis = redis
        self.prefix = prefix
        self.refresh_s = refresh_s  # how stale this process's view of another's verdicts may get
        self._script = redis.register_script(_BREAKER)
        self._claim_script = redis.register_script(_CLAIM)
        self._unclaim = redis.register_script(_UNCLAIM)
        # Bounds a dead process's claim; a trial that outlives it may meet a second one.
        self.trial_claim_s = trial_claim_s
        # The clock in Redis moves at most this much per script: a re-read comes every refresh_s
        # while an instance has traffic, so twice that never holds the clock back, and a step of
        # Redis's wall clock takes no more than this off an open period or a claim.
        self.clock_step_ms = max(int(2 * refresh_s * 1000), 1000)
        self._token = f"{os.getpid()}:{uuid.uuid4().hex}"  # this board's claims, not another's
        self._claim_seq = 0  # each claim's own token: a late deletion of one never deletes the next
        self._claims: dict[int, str] = {}  # instance id -> the token of the fleet-wide trial this board holds
        # Deletions of claims that met Redis away, by instance id; sent again when Redis answers,
        # first after release_retry_s, then with the delay doubling up to 32 times that.
        self._unreleased: dict[int, _Unreleased] = {}
        self.release_retry_s = release_retry_s
        self._retrier: asyncio.Task[None] | None = None
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
        self._claim_seq += 1
        token = f"{self._token}:{self._claim_seq}"
        try:
            stale = self._unreleased.pop(instance.id, None)
            if stale is not None:  # this board's last claim of it, left by Redis away: it goes first
                await self._send_unclaim(stale.instance, stale.token, stale.give_up_at)
            won = await self._claim_script(
                keys=[key, self._clock_key()],
                args=[token, max(int(self.trial_claim_s * 1000), 1), self.clock_step_ms],
            )
        except (RedisError, OSError) as exc:
            logger.warning("breaker redis unavailable instance=%s op=claim, trial claimed locally: %r",
                           instance.name, exc)
            return True
        except BaseException:
            # Cancelled while asking: the slot goes back, and a claim that may have landed with it.
            b.trial = False
            self._enqueue(_Op("unclaim", instance, b.epoch, token=token))
            raise
        if won:
            self._claims[instance.id] = token
            return True
        b.trial = False
        self._elsewhere[instance.id] = self._clock() + self.refresh_s
        logger.info("breaker instance=%s half-open trial held by another process", instance.name)
        return False

    def _claim_key(self, instance: InstanceView) -> str:
        return f"{self.prefix}:{instance.id}:trial"

    def _clock_key(self) -> str:
        return f"{self.prefix}:clock"

    def _end_claim(self, instance: InstanceView) -> None:
        """The trial ended: its claim goes, after the verdict queued before it reached Redis."""
        token = self._claims.pop(instance.id, None)
        if token is not None:
            self._enqueue(_Op("unclaim", instance, self._breakers[instance.id].epoch, token=token))

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
                give_up_at = self._clock() + self.trial_claim_s if op.give_up_at is None else op.give_up_at
                await self._send_unclaim(op.instance, op.token, give_up_at)
                continue
            try:
                result = await self._script(
                    keys=[f"{self.prefix}:{op.instance.id}", self._clock_key()],
                    args=[op.kind, op.epoch, self.threshold, int(self.base_open_s * 1000), int(self.max_open_s * 1000),
                          op.reason if op.kind == "adopt" else "", self.clock_step_ms],
                )
            except (RedisError, OSError) as exc:
                logger.warning("breaker redis unavailable instance=%s op=%s: %r", op.instance.name, op.kind, exc)
                if op.local_move is not None:  # fall back to the per-process board: report our own flip
                    self._report(op.instance, self._breakers[op.instance.id], *op.local_move)
                continue
            self._apply(op, result)
            self._requeue_unreleased()  # Redis answers again: the claims it could not delete go now

    async def _send_unclaim(self, instance: InstanceView, token: str, give_up_at: float) -> None:
        """Delete this board's claim ``token``; if Redis is away, keep it to send again (``_retry``)."""
        try:
            await self._unclaim(keys=[self._claim_key(instance)], args=[token])
        except (RedisError, OSError) as exc:
            again = self._clock() < give_up_at  # (past it, the claim has lapsed in Redis by itself)
            if again:
                self._unreleased[instance.id] = _Unreleased(instance, token, give_up_at)
                self._start_retrier()
            logger.warning("breaker redis unavailable instance=%s op=unclaim sent_again=%s: %r",
                           instance.name, again, exc)
        except BaseException:
            self._unreleased[instance.id] = _Unreleased(instance, token, give_up_at)
            raise

    def _requeue_unreleased(self) -> None:
        """Queue every claim deletion that met Redis away (dropping those whose claim has lapsed)."""
        now = self._clock()
        for instance_id, left in list(self._unreleased.items()):
            del self._unreleased[instance_id]
            if now < left.give_up_at:
                self._ops.append(_Op("unclaim", left.instance, 0, token=left.token, give_up_at=left.give_up_at))

    def _start_retrier(self) -> None:
        loop = asyncio.get_running_loop()
        if self._retrier is None or self._retrier.done() or self._retrier.get_loop() is not loop:
            self._retrier = loop.create_task(self._retry())

    async def _retry(self) -> None:
        """Send the claim deletions Redis missed again, with backoff, while any is left: a process
        with no traffic makes no other call that would carry them."""
        delay = self.release_retry_s
        while self._unreleased:
            await asyncio.sleep(delay)
            if not self._unreleased:
                return
            now = self._clock()
            for instance_id, left in list(self._unreleased.items()):
                if self._unreleased.get(instance_id) is not left:
                    continue  # (sent meanwhile by the worker or a new claim)
                del self._unreleased[instance_id]
                if now < left.give_up_at:
                    await self._send_unclaim(left.instance, left.token, left.give_up_at)
            delay = min(delay * 2, 32 * self.release_retry_s)

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

    async def aclose(self) -> None:
        """``flush``, then stop sending claim deletions again (those left lapse in Redis)."""
        await self.flush()
        retrier, self._retrier = self._retrier, None
        if retrier is not None:
            retrier.cancel()
            await asyncio.gather(retrier, return_exceptions=True)
