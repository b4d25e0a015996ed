"""Token admission shared by every coordinator process through Redis leases that expire.

The same rules as ``admission.TokenAdmission`` (capacity, global budget, a FIFO queue per
instance, a bounded local queue, a deadline, ``LeaseGroup``), with the state in Redis:

- ``<prefix>:leases`` is a sorted set of lease ids scored by their expiry on the leases' clock
  ``<prefix>:clock``, kept by the scripts themselves so processes with skewed clocks agree on it.
  It follows the progress of Redis's ``TIME`` but moves at most a small step per script and
  never back: ``TIME`` is the server's wall clock, and read directly, one forward step of it
  would expire every lease at once (Redis's own key expiry is on the same wall clock, so
  ``PEXPIRE`` would not help). ``:lease_tokens`` and ``:lease_instance`` hold each lease's count
  and instance, ``:held`` the tokens per instance and ``:total`` the sum. Every script first
  drops expired leases, so a crashed process's tokens come back about one TTL after its last
  renewal (later while no script runs at all). Counts are never parsed out of member names, and
  the scripts refuse a non-positive count themselves.
- ``<prefix>:queue:<instance>`` is that instance's FIFO of waiting lease ids (scored by an
  arrival counter) and ``:queue_expiry:<instance>`` their heartbeat deadline: only the head
  may take tokens, a waiter that times out or is cancelled removes itself, and one whose process
  died drops out after three missed heartbeats.

The global budget is checked in the same script, with the in-process rule: an instance's head
that fits its instance but not the budget joins ``<prefix>:budget_queue`` (by its arrival, with
the same heartbeat), and while that queue is not empty only its head may take budget, on any
instance (a release then wakes every instance's head, not only its own).

Wake-ups come through Redis pub/sub: a release, a granted head with others behind it, a waiter
that leaves or an expiry publishes the instance's name on ``<prefix>:wake``; one subscriber per
process (running only while it has waiters) retries the first local waiter of that instance.
Pub/sub rather than blocking lists (one connection parked per waiter) or keyspace notifications
(a server setting operators must enable, and expiry events fire late, when Redis gets round to
the key). Its messages can be lost across a reconnect and an expired lease publishes nothing
until a script notices it, so the subscriber also re-checks once per ``recheck_s`` (one script
per instance with local waiters, which is also the waiters' heartbeat): a safety net, not the
wake-up path.

Redis unreachable (connection refused, timed out) is ``AdmissionUnavailable``: 503 with
``Retry-After``. There is deliberately no fallback to local admission: each process would then
admit up to every instance's full capacity, overloading the engines exactly when the shared
account is gone.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from serving.pipeline.errors import AdmissionUnavailable
from serving.pipeline.flow_control.admission import (
    AdmissionSettings,
    Lease,
    LeaseGroup,
    TokenAdmission,
    check_tokens,
    must_not_wait,
    queue_full,
    timed_out,
)
from serving.pipeline.redis_clock import clock_lua
from serving.pipeline.snapshot import InstanceView

logger = logging.getLogger(__name__)

# KEYS: 1 leases, 2 lease_tokens, 3 lease_instance, 4 held, 5 total, 6 queue, 7 queue_expiry,
# 8 budget_queue, 9 budget_expiry, 10 clock. ARGV[1] is the wake channel and ARGV[2] the clock's
# largest step (ms) in every script: now_ms() is the leases' clock (``redis_clock``), which a step
# of Redis's wall clock advances by less than any live lease or waiter has left.
_COMMON = clock_lua("KEYS[10]", "ARGV[2]") + """
-- Arrival order of waiters: a counter, not a timestamp a backward step could reorder.
local function arrival()
  return redis.call('HINCRBY', KEYS[10], 'arrivals', 1)
end
local function drop(lease)
  local tokens = tonumber(redis.call('HGET', KEYS[2], lease) or '0')
  local inst = redis.call('HGET', KEYS[3], lease)
  redis.call('ZREM', KEYS[1], lease)
  redis.call('HDEL', KEYS[2], lease)
  redis.call('HDEL', KEYS[3], lease)
  if inst and tokens > 0 then
    if redis.call('HINCRBY', KEYS[4], inst, -tokens) <= 0 then redis.call('HDEL', KEYS[4], inst) end
    if redis.call('DECRBY', KEYS[5], tokens) <= 0 then redis.call('DEL', KEYS[5]) end
  end
end
local function prune(now)
  local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
  for _, lease in ipairs(expired) do drop(lease) end
  if #expired > 0 then redis.call('PUBLISH', ARGV[1], '*') end
end
local function prune_queue(now, instance)
  local gone = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now)
  for _, w in ipairs(gone) do
    redis.call('ZREM', KEYS[6], w)
    redis.call('ZREM', KEYS[7], w)
  end
  if #gone > 0 then redis.call('PUBLISH', ARGV[1], instance) end
  gone = redis.call('ZRANGEBYSCORE', KEYS[9], '-inf', now)
  for _, w in ipairs(gone) do
    redis.call('ZREM', KEYS[8], w)
    redis.call('ZREM', KEYS[9], w)
  end
  if #gone > 0 then redis.call('PUBLISH', ARGV[1], '*') end
end
local function wake(instance)
  -- The budget spans instances: while anyone waits for it, every instance's head may be next.
  if redis.call('ZCARD', KEYS[8]) > 0 then instance = '*' end
  redis.call('PUBLISH', ARGV[1], instance)
end
"""

# ARGV: 3 lease id, 4 tokens, 5 capacity, 6 budget (-1: none), 7 lease ttl ms, 8 waiter ttl ms,
# 9 enqueue ('1': wait in the queue if not granted), 10 instance. Returns 1 if granted, else 0.
_ACQUIRE = _COMMON + """
local id, instance = ARGV[3], ARGV[10]
local tokens = tonumber(ARGV[4])
if not tokens or tokens < 1 or tokens ~= math.floor(tokens) then
  return redis.error_reply('tokens must be a positive integer')
end
local now = now_ms()
prune(now)
prune_queue(now, instance)
local head = redis.call('ZRANGE', KEYS[6], 0, 0)[1]
local queued = redis.call('ZSCORE', KEYS[6], id)
if head == nil or head == id then
  local here = tonumber(redis.call('HGET', KEYS[4], instance) or '0')
  local all = tonumber(redis.call('GET', KEYS[5]) or '0')
  local budget = tonumber(ARGV[6])
  local fits_here = here + tokens <= tonumber(ARGV[5]) or here == 0
  local bhead = redis.call('ZRANGE', KEYS[8], 0, 0)[1]
  local fits_budget = budget < 0 or ((all + tokens <= budget or all == 0) and (bhead == nil or bhead == id))
  if fits_here and not fits_budget and budget >= 0 and ARGV[9] == '1' then
    -- An instance's head held only by the budget holds back every later request, on any instance.
    if not redis.call('ZSCORE', KEYS[8], id) then
      redis.call('ZADD', KEYS[8], queued or arrival(), id)
    end
    redis.call('ZADD', KEYS[9], now + tonumber(ARGV[8]), id)
  end
  if fits_here and fits_budget then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[7]), id)
    redis.call('HSET', KEYS[2], id, tokens)
    redis.call('HSET', KEYS[3], id, instance)
    redis.call('HINCRBY', KEYS[4], instance, tokens)
    redis.call('INCRBY', KEYS[5], tokens)
    redis.call('ZREM', KEYS[8], id)
    redis.call('ZREM', KEYS[9], id)
    if queued then
      redis.call('ZREM', KEYS[6], id)
      redis.call('ZREM', KEYS[7], id)
      if redis.call('ZCARD', KEYS[6]) > 0 or redis.call('ZCARD', KEYS[8]) > 0 then wake(instance) end
    end
    return 1
  end
end
if ARGV[9] == '1' then
  if not queued then redis.call('ZADD', KEYS[6], arrival(), id) end
  redis.call('ZADD', KEYS[7], now + tonumber(ARGV[8]), id)
end
return 0
"""

# A lease released or a waiter gone (timed out, cancelled, or granted as it was cancelled).
# ARGV: 3 lease id, 4 instance. Returns 1 if it held or queued anything.
_FORGET = _COMMON + """
local id, instance = ARGV[3], ARGV[4]
prune(now_ms())
local changed = redis.call('ZREM', KEYS[6], id) + redis.call('ZREM', KEYS[8], id)
redis.call('ZREM', KEYS[7], id)
redis.call('ZREM', KEYS[9], id)
if redis.call('ZSCORE', KEYS[1], id) then
  drop(id)
  changed = 1
end
if changed > 0 then wake(instance) end
return changed
"""

# ARGV: 3 lease id, 4 ttl ms. Returns 0 when the lease had already expired.
_RENEW = _COMMON + """
local now = now_ms()
prune(now)
if not redis.call('ZSCORE', KEYS[1], ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[4]), ARGV[3])
return 1
"""

# ARGV: 3 instance, 4 waiter ttl ms, 5... this process's waiting lease ids for that instance.
_HEARTBEAT = _COMMON + """
local now = now_ms()
prune(now)
prune_queue(now, ARGV[3])
for i = 5, #ARGV do
  redis.call('ZADD', KEYS[7], 'XX', now + tonumber(ARGV[4]), ARGV[i])
  redis.call('ZADD', KEYS[9], 'XX', now + tonumber(ARGV[4]), ARGV[i])
end
return 1
"""


@dataclass(eq=False)
class _LocalWaiter:
    lease_id: str
    event: asyncio.Event = field(default_factory=asyncio.Event)  # set: try again now


class RedisTokenAdmission(TokenAdmission):
    """Token admission shared by every coordinator process through Redis leases that expire."""

    def __init__(
        self, redis: Any, settings: AdmissionSettings | None = None, *, prefix: str = "motor:admission",
        lease_ttl_s: float = 15.0, recheck_s: float = 1.0,
    ) -> None:
        super().__init__(settings)
        self.redis = redis
        self.prefix = prefix
        self.channel = f"{prefix}:wake"
        self.lease_ttl_s = lease_ttl_s  # how long a crashed holder keeps its tokens
        self.recheck_s = recheck_s  # safety-net re-check and waiters' heartbeat (not the wake-up path)
        # The leases' clock moves at most this much per script (see _COMMON): less than a live
        # lease (renewed every third of its TTL) or waiter (heartbeat every recheck_s, three
        # missed to expire) has left, whatever step Redis's own clock takes.
        self.clock_step_ms = max(int(min(lease_ttl_s / 3, recheck_s) * 1000), 1)
        self._acquire = redis.register_script(_ACQUIRE)
        self._forget_script = redis.register_script(_FORGET)
        self._renew = redis.register_script(_RENEW)
        self._heartbeat = redis.register_script(_HEARTBEAT)
        self._local: dict[str, list[_LocalWaiter]] = {}  # this process's waiters per instance, FIFO
        self._renewers: dict[str, asyncio.Task[None]] = {}
        self._removals: set[asyncio.Task[Any]] = set()
        self._listener: asyncio.Task[None] | None = None
        self._subscribed: asyncio.Event | None = None  # set once the current subscriber listens

    def _keys(self, instance: str) -> list[str]:
        p = self.prefix
        return [
            f"{p}:leases", f"{p}:lease_tokens", f"{p}:lease_instance", f"{p}:held", f"{p}:total",
            f"{p}:queue:{instance}", f"{p}:queue_expiry:{instance}", f"{p}:budget_queue", f"{p}:budget_expiry",
            f"{p}:clock",
        ]

    def waiting(self) -> int:
        return sum(len(w) for w in self._local.values())

    def has_room(self, instance: InstanceView, tokens: int) -> bool:
        # Only Redis knows the whole picture; this process's own leases and waiters are a lower bound.
        name = instance.name
        return not self._local.get(name) and self._instance_fits(name, instance.token_capacity, tokens) \
            and self._budget_fits(tokens)

    async def _try(self, instance: InstanceView, lease: Lease, *, enqueue: bool) -> bool:
        budget = -1 if self.settings.global_budget is None else self.settings.global_budget
        waiter_ttl_ms = int(max(3 * self.recheck_s, 1.0) * 1000)
        ok = await self._acquire(
            keys=self._keys(instance.name),
            args=[
                self.channel, self.clock_step_ms, lease.lease_id, lease.tokens, instance.token_capacity, budget,
                int(self.lease_ttl_s * 1000), waiter_ttl_ms, "1" if enqueue else "0", instance.name,
            ],
        )
        return bool(ok)

    async def acquire(self, instance: InstanceView, tokens: int, group: LeaseGroup | None = None) -> Lease:
        """Hold ``tokens`` on ``instance``, waiting in its shared FIFO queue for room.

        Raises what ``TokenAdmission.acquire`` raises, and ``AdmissionUnavailable`` (503 with
        ``Retry-After``) when Redis cannot be reached.
        """
        lease = Lease(self, instance.name, check_tokens(tokens))
        together = group
        waiter: _LocalWaiter | None = None
        try:
            if not await self._try(instance, lease, enqueue=False):
                if together is not None and together.holding():
                    raise must_not_wait(self.settings, tokens)
                if self.waiting() >= self.settings.queue_size:
                    raise queue_full(self.settings, self.waiting())
                waiter = _LocalWaiter(lease.lease_id)
                self._local.setdefault(instance.name, []).append(waiter)
                async with asyncio.timeout(self.settings.wait_s):
                    while True:
                        await self._ensure_listener()  # (again, if a Redis error stopped it)
                        waiter.event.clear()  # before the try: a wake-up during it is not lost
                        if await self._try(instance, lease, enqueue=True):
                            break
                        await waiter.event.wait()
        except TimeoutError:
            await self._forget_now(instance.name, lease.lease_id)
            raise timed_out(self.settings, tokens) from None
        except (RedisError, OSError) as exc:
            logger.warning("admission redis unavailable instance=%s: %r", instance.name, exc)
            await self._forget_now(instance.name, lease.lease_id)
            raise AdmissionUnavailable(
                "engine capacity cannot be checked right now (shared admission state unreachable)",
                retry_after_s=self.settings.retry_after_s,
            ) from None
        except BaseException:
            # Cancelled while a script may have run: remove the member and queue entry whatever happened.
            await self._forget_now(instance.name, lease.lease_id)
            raise
        finally:
            if waiter is not None:
                self._leave(instance.name, waiter)
        self._take(instance.name, lease.tokens)
        self._renewers[lease.lease_id] = asyncio.get_running_loop().create_task(self._keep(instance.name, lease.lease_id))
        return self._granted(lease, together)

    def _leave(self, instance: str, waiter: _LocalWaiter) -> None:
        local = self._local.get(instance, [])
        first = bool(local) and local[0] is waiter
        if waiter in local:
            local.remove(waiter)
        if not local:
            self._local.pop(instance, None)
        elif first:
            local[0].event.set()  # room may be left for the next one here

    def _wake_local(self, instance: str) -> None:
        for name, local in self._local.items():
            if local and (instance == "*" or name == instance):
                local[0].event.set()  # only a queue's head can be granted; it wakes the next

    async def _ensure_listener(self) -> None:
        listener = self._listener
        if listener is None or listener.done() or self._subscribed is None \
                or listener.get_loop() is not asyncio.get_running_loop():
            self._subscribed = asyncio.Event()
            self._listener = asyncio.get_running_loop().create_task(self._listen(self._subscribed))
        await self._subscribed.wait()  # a release published before we listen would be missed

    async def _listen(self, subscribed: asyncio.Event) -> None:
        """Wake local waiters on the channel's messages; re-check and heartbeat every ``recheck_s``."""
        loop = asyncio.get_running_loop()
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(self.channel)
            subscribed.set()
            last = loop.time()
            while self._local:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=self.recheck_s)
                if message is not None:
                    data = message["data"]
                    self._wake_local(data.decode() if isinstance(data, bytes) else str(data))
                if loop.time() - last >= self.recheck_s:
                    last = loop.time()
                    await self._beat()
                    self._wake_local("*")
        except (RedisError, OSError) as exc:
            # Waiters find out themselves: their next script fails and they answer 503, or it
            # works and one of them starts a new subscriber; not before a pause, so a subscriber
            # that keeps failing costs one attempt per re-check, not a busy loop.
            logger.warning("admission wake-up subscriber failed: %r", exc)
            await asyncio.sleep(self.recheck_s)
            subscribed.set()
            self._wake_local("*")
        finally:
            if self._listener is asyncio.current_task():
                self._listener = self._subscribed = None  # a new waiter starts a new subscriber from here on
            await asyncio.shield(pubsub.aclose())

    async def _beat(self) -> None:
        waiter_ttl_ms = int(max(3 * self.recheck_s, 1.0) * 1000)
        for instance, local in list(self._local.items()):
            ids = [w.lease_id for w in local]
            await self._heartbeat(
                keys=self._keys(instance), args=[self.channel, self.clock_step_ms, instance, waiter_ttl_ms, *ids]
            )

    async def _keep(self, instance: str, lease_id: str) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            try:
                kept = await self._renew(
                    keys=self._keys(instance), args=[self.channel, self.clock_step_ms, lease_id, int(self.lease_ttl_s * 1000)]
                )
            except (RedisError, OSError) as exc:  # Redis away: the lease may lapse; the request goes on
                logger.warning("admission lease renewal failed instance=%s: %r", instance, exc)
                continue
            if not kept:
                logger.warning("admission lease expired while held instance=%s lease=%s", instance, lease_id)
                return

    async def _forget(self, instance: str, lease_id: str) -> None:
        try:
            await self._forget_script(keys=self._keys(instance), args=[self.channel, self.clock_step_ms, lease_id, instance])
        except (RedisError, OSError) as exc:  # it expires on its own (lease TTL, waiter heartbeat)
            logger.warning("admission forget failed instance=%s: %r", instance, exc)

    def _spawn_forget(self, instance: str, lease_id: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self._forget(instance, lease_id))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)
        return task

    async def _forget_now(self, instance: str, lease_id: str) -> None:
        # Shielded: a second cancellation must not leave the member behind; the task finishes alone.
        await asyncio.shield(self._spawn_forget(instance, lease_id))

    def _release(self, lease: Lease) -> None:
        renewer = self._renewers.pop(lease.lease_id, None)
        if renewer is not None:
            renewer.cancel()
        self._inflight[lease.instance] -= lease.tokens
        self._total -= lease.tokens
        if self._inflight[lease.instance] <= 0:
            del self._inflight[lease.instance]
        # Release is synchronous (it runs in finally blocks, even during cancellation); the
        # removal is a task, and the lease expires on its own if it never runs.
        self._spawn_forget(lease.instance, lease.lease_id)

    async def aclose(self) -> None:
        """Wait for pending removals and stop the subscriber (tests, shutdown)."""
        while self._removals:
            await asyncio.gather(*list(self._removals), return_exceptions=True)
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
        for renewer in self._renewers.values():
            renewer.cancel()
        await asyncio.gather(*self._renewers.values(), return_exceptions=True)
