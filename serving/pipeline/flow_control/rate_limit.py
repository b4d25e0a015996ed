"""Tokens-per-minute limits per client key, enforced once a request's token count is known.

The count a request is charged is prompt tokens + resolved max output tokens (times ``n``),
known only after render; so the edge puts the caller's key and limit in the request's context
(``request_context.RequestContext``) and the pipeline charges it (``KeyCharge.charge``,
through ``Response.charge``) on whichever path first knows the count: after render or local tokenization on the token-only path, before the first engine call
on the native path (the admission estimate there). A request is charged once, even when it moves
from one path to the other. Charging the reserved output rather than what was generated errs on
the safe side: a limit is a promise about engine capacity, which is reserved up front. A
non-positive amount is refused (``RequestError``), never charged. A request that is answered
nothing (an error status, or a client that left before its answer began) is refunded
(``KeyCharge.refund``, from the response's exit stack): the key pays for answers, not for the fleet's failures.

``TokenRateLimiter`` is a sliding log of the last 60 s per key, in-process: with several
coordinator processes each would enforce the limit on its own share of the traffic.
``RedisTokenRateLimiter`` (chosen by ``serving.runtime`` when ``REDIS_URL`` is set) keeps one
window per key in Redis, trimmed, checked and charged in one Lua call on a clock kept in Redis
(``redis_clock``: it follows Redis's ``TIME`` but a step of that wall clock does not move it), so
the limit holds across every process; Redis unreachable is 503 with ``Retry-After``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from redis.exceptions import RedisError

from serving.pipeline.errors import AdmissionUnavailable, RateLimited
from serving.pipeline.flow_control.admission import check_tokens
from serving.pipeline.redis_clock import clock_lua

logger = logging.getLogger(__name__)

WINDOW_S = 60.0


class TokenRateLimited(RateLimited):
    """429 with ``Retry-After``: the key's tokens in the last minute would exceed its limit."""


@dataclass(frozen=True, slots=True)
class KeyLimit:
    key_id: str  # sha256 hex of the key: the window's identity, never the key itself
    name: str
    tokens_per_minute: int

    def for_model(self, model: str) -> KeyLimit:
        """The key's window for ``model``: a key's tokens per minute hold per served model, as
        OpenAI's limits do, so one model's traffic never uses up another's. The model name comes
        from the control plane (the request was resolved against the snapshot), never raw input."""
        return KeyLimit(f"{self.key_id}:{model}", self.name, self.tokens_per_minute)


class TokenRateLimiter:
    """A sliding 60-second window of charged tokens per key."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._log: dict[str, deque[tuple[float, int, str]]] = {}
        self._used: dict[str, int] = {}
        # Charges happen on event loops, but a process may run more than one (one per thread).
        self._lock = threading.Lock()

    def used(self, key_id: str) -> int:
        with self._lock:
            self._expire(key_id, self.clock())
            return self._used.get(key_id, 0)

    def charge(self, limit: KeyLimit, tokens: int, charge_id: str = "") -> None:
        """Record ``tokens`` against ``limit``'s key, or raise ``TokenRateLimited`` and record nothing.

        Raises ``RequestError`` for a non-positive amount. ``charge_id`` names the charge for ``refund``.
        """
        tokens = check_tokens(tokens)
        with self._lock:
            now = self.clock()
            self._expire(limit.key_id, now)
            used = self._used.get(limit.key_id, 0)
            cap = limit.tokens_per_minute
            if tokens > cap:
                raise too_large(limit, tokens, self.window_s)
            if used + tokens > cap:
                raise over_limit(limit, tokens, used, self._retry_after(limit.key_id, now, used + tokens - cap))
            log = self._log.setdefault(limit.key_id, deque())
            log.append((now, tokens, charge_id))
            self._used[limit.key_id] = used + tokens

    async def acharge(self, limit: KeyLimit, tokens: int, charge_id: str = "") -> None:
        """``charge``, awaitable (the shared limiter's interface)."""
        self.charge(limit, tokens, charge_id)

    def refund(self, limit: KeyLimit, charge_id: str) -> None:
        """Take the charge ``charge_id`` out of the key's window (gone already: nothing to do)."""
        with self._lock:
            log = self._log.get(limit.key_id)
            if not log:
                return
            for entry in log:
                if entry[2] == charge_id:
                    log.remove(entry)
                    self._used[limit.key_id] -= entry[1]
                    if not log:
                        del self._log[limit.key_id], self._used[limit.key_id]
                    return

    async def arefund(self, limit: KeyLimit, charge_id: str) -> None:
        self.refund(limit, charge_id)

    async def aused(self, key_id: str) -> int:
        return self.used(key_id)

    def _expire(self, key_id: str, now: float) -> None:
        log = self._log.get(key_id)
        if not log:
            return
        used = self._used[key_id]
        while log and log[0][0] <= now - self.window_s:
            used -= log.popleft()[1]
        if log:
            self._used[key_id] = used
        else:  # an idle key costs nothing
            del self._log[key_id], self._used[key_id]

    def _retry_after(self, key_id: str, now: float, excess: int) -> int:
        """Seconds until at least ``excess`` charged tokens have left the window."""
        freed = 0
        for at, tokens, _ in self._log.get(key_id, ()):
            freed += tokens
            if freed >= excess:
                return max(1, math.ceil(at + self.window_s - now))
        return max(1, math.ceil(self.window_s))


def too_large(limit: KeyLimit, tokens: int, window_s: float) -> TokenRateLimited:
    # Waiting cannot help; OpenAI answers this case with 429 too.
    return TokenRateLimited(
        f"Request too large for key {limit.name!r}: {tokens} tokens (prompt + max output) "
        f"exceed its limit of {limit.tokens_per_minute} tokens per minute. Reduce the prompt or max_tokens.",
        retry_after_s=math.ceil(window_s),
    )


def over_limit(limit: KeyLimit, tokens: int, used: int, retry_after_s: int) -> TokenRateLimited:
    return TokenRateLimited(
        f"Rate limit reached for key {limit.name!r}: {limit.tokens_per_minute} tokens per minute, {used} used, "
        f"this request needs {tokens}. Retry after the time in Retry-After.",
        retry_after_s=retry_after_s,
    )


# KEYS: 1 the key's window (sorted set: charge id -> time ms), 2 charge id -> tokens, 3 the sum,
# 4 the windows' clock. ARGV: 1 window ms. Drops what left the window; sets {now ms, used}.
#
# "now" is the clock of ``redis_clock``, not Redis's TIME: read directly, a step of TIME an hour
# back kept every charge of the last minute in the window for an hour (every limited key answered
# 429 with a Retry-After of an hour). The clock moves at most one window per script: never
# further, so a step forward frees no more than one idle minute would (the window empties), and
# not less, so the clock never lags behind a window that real time has emptied: a client that
# waits its Retry-After is let in however quiet the fleet is.
_TRIM = clock_lua("KEYS[4]", "ARGV[1]") + """
local now = now_ms()
local window = tonumber(ARGV[1])
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - window)) do
  used = used - tonumber(redis.call('HGET', KEYS[2], id) or '0')
  redis.call('HDEL', KEYS[2], id)
  redis.call('ZREM', KEYS[1], id)
end
if used > 0 then redis.call('SET', KEYS[3], used, 'KEEPTTL') else redis.call('DEL', KEYS[3]); used = 0 end
"""

# ARGV: 1 window ms, 2 charge id, 3 tokens, 4 the limit. Returns {0, used} charged,
# {1, used} larger than the limit, {2, used, ms until enough has left the window}.
_CHARGE = _TRIM + """
local tokens = tonumber(ARGV[3])
if not tokens or tokens < 1 or tokens ~= math.floor(tokens) then
  return redis.error_reply('tokens must be a positive integer')
end
local cap = tonumber(ARGV[4])
if tokens > cap then return {1, used} end
if used + tokens > cap then
  local excess, freed = used + tokens - cap, 0
  local log = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  for i = 1, #log, 2 do
    freed = freed + tonumber(redis.call('HGET', KEYS[2], log[i]) or '0')
    if freed >= excess then return {2, used, tonumber(log[i + 1]) + window - now} end
  end
  return {2, used, window}
end
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], tokens)
redis.call('INCRBY', KEYS[3], tokens)
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], window + 1000) end  -- an idle key costs nothing
return {0, used + tokens}
"""

_USED = _TRIM + "\nreturn used\n"

# KEYS as _TRIM's (without the clock), ARGV: 1 charge id. Takes a charge out of the window.
_REFUND = """
local tokens = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if tokens == 0 then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
local used = tonumber(redis.call('GET', KEYS[3]) or '0') - tokens
if used > 0 then redis.call('SET', KEYS[3], used, 'KEEPTTL') else redis.call('DEL', KEYS[3]) end
return tokens
"""


class RedisTokenRateLimiter(TokenRateLimiter):
    """One sliding window per key shared by every coordinator process, on the windows' clock in Redis."""

    def __init__(self, redis: Any, *, prefix: str = "motor:tpm", window_s: float = WINDOW_S, retry_after_s: int = 1) -> None:
        super().__init__(window_s)
        self.redis = redis
        self.prefix = prefix
        self.retry_after_s = retry_after_s  # the hint when Redis is unreachable
        self._charge = redis.register_script(_CHARGE)
        self._used_script = redis.register_script(_USED)
        self._refund = redis.register_script(_REFUND)

    def _keys(self, key_id: str) -> list[str]:
        p = self.prefix
        return [f"{p}:{key_id}:log", f"{p}:{key_id}:tokens", f"{p}:{key_id}:used", f"{p}:clock"]

    def charge(self, limit: KeyLimit, tokens: int, charge_id: str = "") -> None:
        raise TypeError("the shared limiter is asynchronous: use acharge")

    async def acharge(self, limit: KeyLimit, tokens: int, charge_id: str = "") -> None:
        """Charge ``tokens`` in the shared window; raises ``TokenRateLimited``, ``RequestError``,
        or ``AdmissionUnavailable`` when Redis cannot be reached."""
        tokens = check_tokens(tokens)
        window_ms = int(self.window_s * 1000)
        try:
            result = await self._charge(
                keys=self._keys(limit.key_id),
                args=[window_ms, charge_id or uuid.uuid4().hex, tokens, limit.tokens_per_minute],
            )
        except (RedisError, OSError) as exc:
            logger.warning("tokens-per-minute redis unavailable key=%s: %r", limit.name, exc)
            raise AdmissionUnavailable(
                "the tokens-per-minute limit cannot be checked right now (shared state unreachable)",
                retry_after_s=self.retry_after_s,
            ) from None
        verdict, used = int(result[0]), int(result[1])
        if verdict == 1:
            raise too_large(limit, tokens, self.window_s)
        if verdict == 2:
            raise over_limit(limit, tokens, used, max(1, math.ceil(int(result[2]) / 1000)))

    def refund(self, limit: KeyLimit, charge_id: str) -> None:
        raise TypeError("the shared limiter is asynchronous: use arefund")

    async def arefund(self, limit: KeyLimit, charge_id: str) -> None:
        await self._refund(keys=self._keys(limit.key_id)[:3], args=[charge_id])

    def used(self, key_id: str) -> int:
        raise TypeError("the shared limiter is asynchronous: use aused")

    async def aused(self, key_id: str) -> int:
        return int(await self._used_script(keys=self._keys(key_id), args=[int(self.window_s * 1000)]))


@dataclass(eq=False)
class KeyCharge:
    """One request's charge against its key's window: made once, whichever path first knows the
    count (``charge``), taken back when the request was answered nothing (``refund``)."""

    limit: KeyLimit | None  # None: the key has no limit, nothing is charged
    charged: bool = False  # once per request, whichever path charges first
    charge_id: str = ""  # the charge, for ``refund``
    limiter: TokenRateLimiter | None = None  # the limiter that holds it

    async def charge(self, tokens: int, limiter: TokenRateLimiter | None = None) -> bool:
        """Charge ``tokens`` once per request if the key has a limit; True when this call charged.

        Raises ``TokenRateLimited`` when over it, ``RequestError`` for a non-positive amount (even
        for a key without a limit: the count is wrong, whoever asks), ``AdmissionUnavailable`` when
        the shared window cannot be reached.
        """
        tokens = check_tokens(tokens)
        if self.limit is None or self.charged:
            return False
        charge_id = uuid.uuid4().hex
        limiter = limiter or LIMITER
        await limiter.acharge(self.limit, tokens, charge_id)
        self.charged, self.charge_id, self.limiter = True, charge_id, limiter
        return True

    async def refund(self) -> None:
        """Take back this request's charge: it was answered nothing (an error, or a client that left
        before its answer began). Once; a refund that cannot reach the shared window is logged, never
        raised over the request's own outcome."""
        if self.limit is None or not self.charge_id or self.limiter is None:
            return
        charge_id, self.charge_id = self.charge_id, ""
        try:
            await self.limiter.arefund(self.limit, charge_id)
        except (RedisError, OSError) as exc:
            logger.warning("tokens-per-minute refund failed key=%s: %r", self.limit.name, exc)


# The process's limiter (``serving.runtime.build`` installs the shared one with ``REDIS_URL``).
LIMITER: TokenRateLimiter = TokenRateLimiter()


def install(limiter: TokenRateLimiter) -> None:
    """Make ``limiter`` the process's limiter (the composition root calls this once)."""
    global LIMITER
    LIMITER = limiter
