"""Admission by tokens: a request holds ``prompt + resolved max output`` tokens on its instance.

Two limits: each instance's ``token_capacity`` and a coordinator-wide budget. A request that does
not fit waits in a bounded FIFO queue up to a deadline: a full queue is ``QueueFull`` (429 with
``Retry-After``), a passed deadline ``AdmissionTimeout`` (503). A request larger than an
instance's whole capacity is admitted when that instance is otherwise idle, so it cannot starve.

Every ``Lease`` is released exactly once, whatever the exit path: ``release()`` is idempotent
and leases are used as context managers, so success, error, cancellation and retry all return
the tokens (tests assert ``inflight_tokens() == {}`` after each).

``TokenAdmission`` is in-process. ``RedisTokenAdmission`` shares one budget among coordinator
processes: each lease is a member of a sorted set scored by its expiry, renewed while held, so a
crashed process's tokens come back when its leases expire.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from serving.pipeline.errors import AdmissionTimeout, QueueFull
from serving.pipeline.snapshot import InstanceView

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    global_budget: int | None = None  # tokens in flight across all instances; None = unlimited
    queue_size: int = 256  # waiters beyond this are refused at once (429)
    wait_s: float = 30.0  # how long a request may wait for room before 503
    retry_after_s: int = 1  # the hint sent with 429


@dataclass(eq=False)
class Lease:
    """Tokens held on one instance; ``release()`` may be called any number of times."""

    admission: TokenAdmission
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


class TokenAdmission:
    """In-process token admission (one coordinator process)."""

    def __init__(self, settings: AdmissionSettings | None = None) -> None:
        self.settings = settings or AdmissionSettings()
        self._inflight: Counter[str] = Counter()
        self._total = 0
        self._waiters: deque[tuple[asyncio.Future[None], str, int, int]] = deque()

    def inflight_tokens(self) -> dict[str, int]:
        """Tokens held per instance name (instances holding none are absent)."""
        return {k: v for k, v in self._inflight.items() if v}

    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, instance: str, capacity: int, tokens: int) -> bool:
        held = self._inflight[instance]
        budget = self.settings.global_budget
        if budget is not None and self._total + tokens > budget and self._total > 0:
            return False
        return held + tokens <= capacity or held == 0

    def has_room(self, instance: InstanceView, tokens: int) -> bool:
        return not self._waiters and self._fits(instance.name, instance.token_capacity, tokens)

    def _take(self, instance: str, tokens: int) -> None:
        self._inflight[instance] += tokens
        self._total += tokens

    async def acquire(self, instance: InstanceView, tokens: int) -> Lease:
        """Hold ``tokens`` on ``instance``, waiting FIFO for room; raise QueueFull / AdmissionTimeout."""
        name, capacity = instance.name, instance.token_capacity
        if not self._waiters and self._fits(name, capacity, tokens):
            self._take(name, tokens)
            return Lease(self, name, tokens)
        if len(self._waiters) >= self.settings.queue_size:
            raise QueueFull(
                f"too many requests are waiting for engine capacity ({len(self._waiters)} queued)",
                retry_after_s=self.settings.retry_after_s,
            )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (future, name, capacity, tokens)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(self.settings.wait_s):
                await future
        except BaseException as exc:
            # Cancelled after being granted but before resuming: the tokens were taken for us.
            if future.done() and not future.cancelled():
                self._release_tokens(name, tokens)
            if isinstance(exc, TimeoutError):
                raise AdmissionTimeout(
                    f"no engine capacity for {tokens} tokens within {self.settings.wait_s:g}s"
                ) from None
            raise
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
                self._wake()
        return Lease(self, name, tokens)

    def _release(self, lease: Lease) -> None:
        self._release_tokens(lease.instance, lease.tokens)

    def _release_tokens(self, instance: str, tokens: int) -> None:
        self._inflight[instance] -= tokens
        self._total -= tokens
        if self._inflight[instance] <= 0:
            del self._inflight[instance]
        self._wake()

    def _wake(self) -> None:
        # FIFO: grant from the head while it fits; a head that does not fit blocks the rest, so a
        # large request is not overtaken forever by small ones.
        while self._waiters:
            future, name, capacity, tokens = self._waiters[0]
            if future.done():
                self._waiters.popleft()
                continue
            if not self._fits(name, capacity, tokens):
                return
            self._waiters.popleft()
            self._take(name, tokens)
            future.set_result(None)


# -- Redis -----------------------------------------------------------------------------------------

# KEYS[1] = the instance's lease set, KEYS[2] = the global lease set. Members are
# "<lease id>:<tokens>", scores their expiry (ms). Expired leases are dropped first, so a
# crashed holder's tokens come back after at most one TTL.
_ACQUIRE = """
local now = tonumber(ARGV[1])
local expiry = tonumber(ARGV[2])
local member = ARGV[3]
local tokens = tonumber(ARGV[4])
local capacity = tonumber(ARGV[5])
local budget = tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local function held(key)
  local total = 0
  for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    total = total + tonumber(string.match(m, ':(%d+)$'))
  end
  return total
end
local here = held(KEYS[1])
local all = held(KEYS[2])
if budget >= 0 and all + tokens > budget and all > 0 then return 0 end
if here + tokens > capacity and here > 0 then return 0 end
redis.call('ZADD', KEYS[1], expiry, member)
redis.call('ZADD', KEYS[2], expiry, member)
return 1
"""

_RENEW = """
redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], 'XX', ARGV[1], ARGV[2])
return 1
"""


class RedisTokenAdmission(TokenAdmission):
    """Token admission shared by every coordinator process through Redis leases that expire."""

    def __init__(
        self, redis: Any, settings: AdmissionSettings | None = None, *, prefix: str = "motor:admission",
        lease_ttl_s: float = 15.0, poll_s: float = 0.02,
    ) -> None:
        super().__init__(settings)
        self.redis = redis
        self.prefix = prefix
        self.lease_ttl_s = lease_ttl_s  # how long a crashed holder keeps its tokens
        self.poll_s = poll_s  # waiters poll: Redis has no cross-process wake-up here
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._renewers: dict[str, asyncio.Task[None]] = {}

    def _keys(self, instance: str) -> list[str]:
        return [f"{self.prefix}:instance:{instance}", f"{self.prefix}:global"]

    async def _try(self, instance: InstanceView, tokens: int, member: str) -> bool:
        now_ms = int(time.time() * 1000)
        budget = -1 if self.settings.global_budget is None else self.settings.global_budget
        ok = await self._acquire(
            keys=self._keys(instance.name),
            args=[now_ms, now_ms + int(self.lease_ttl_s * 1000), member, tokens, instance.token_capacity, budget],
        )
        return bool(ok)

    def has_room(self, instance: InstanceView, tokens: int) -> bool:
        return True  # only Redis knows; acquire() waits if it must

    async def acquire(self, instance: InstanceView, tokens: int) -> Lease:
        lease = Lease(self, instance.name, tokens)
        member = f"{lease.lease_id}:{tokens}"
        if len(self._waiters) >= self.settings.queue_size:
            raise QueueFull("too many requests are waiting for engine capacity", retry_after_s=self.settings.retry_after_s)
        marker: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (marker, instance.name, instance.token_capacity, tokens)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(self.settings.wait_s):
                while not await self._try(instance, tokens, member):
                    await asyncio.sleep(self.poll_s)
        except TimeoutError:
            raise AdmissionTimeout(f"no engine capacity for {tokens} tokens within {self.settings.wait_s:g}s") from None
        except BaseException:
            # Cancelled while the script may have run: remove the member unconditionally.
            await asyncio.shield(self._remove(instance.name, member))
            raise
        finally:
            self._waiters.remove(entry)
            marker.cancel()
        self._inflight[instance.name] += tokens
        self._total += tokens
        self._renewers[lease.lease_id] = asyncio.get_running_loop().create_task(self._keep(instance.name, member))
        return lease

    async def _keep(self, instance: str, member: str) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            expiry = int((time.time() + self.lease_ttl_s) * 1000)
            try:
                await self._renew(keys=self._keys(instance), args=[expiry, member])
            except Exception as exc:  # Redis away: the lease may lapse; the request goes on
                logger.warning("admission lease renewal failed instance=%s: %r", instance, exc)

    async def _remove(self, instance: str, member: str) -> None:
        keys = self._keys(instance)
        await self.redis.zrem(keys[0], member)
        await self.redis.zrem(keys[1], member)

    def _release(self, lease: Lease) -> None:
        renewer = self._renewers.pop(lease.lease_id, None)
        if renewer is not None:
            renewer.cancel()
        self._inflight[lease.instance] -= lease.tokens
        self._total -= lease.tokens
        if self._inflight[lease.instance] <= 0:
            del self._inflight[lease.instance]
        # Release is synchronous (it runs in finally blocks, even during cancellation); the
        # removal is a fire-and-forget task, and the lease expires on its own if it never runs.
        task = asyncio.get_running_loop().create_task(self._remove(lease.instance, f"{lease.lease_id}:{lease.tokens}"))
        _pending.add(task)
        task.add_done_callback(_pending.discard)

    async def aclose(self) -> None:
        """Wait for pending removals (tests, shutdown)."""
        while _pending:
            await asyncio.gather(*list(_pending), return_exceptions=True)


_pending: set[asyncio.Task[None]] = set()
