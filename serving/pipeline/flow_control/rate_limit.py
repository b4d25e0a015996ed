"""Tokens-per-minute limits per client key, enforced once a request's token count is known.

The count a request is charged is prompt tokens + resolved max output tokens (times ``n``),
known only after render; so the view binds the caller's key and limit to the request's context
(``bind``) and the pipeline charges after render (``charge``), without either passing the key
through the pipeline's signatures. Charging the reserved output rather than what was generated
errs on the safe side: a limit is a promise about engine capacity, which is reserved up front.

The window is a sliding log of the last 60 s per key, in-process: with several coordinator
processes each enforces the limit on its own share of the traffic (a key's effective limit is
up to limit × processes). A Redis-shared window (a sorted set per key, trimmed and summed in one
Lua call) would make it global; not done yet.
"""

from __future__ import annotations

import contextvars
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from serving.pipeline.errors import RateLimited

WINDOW_S = 60.0


class TokenRateLimited(RateLimited):
    """429 with ``Retry-After``: the key's tokens in the last minute would exceed its limit."""


@dataclass(frozen=True, slots=True)
class KeyLimit:
    key_id: str  # sha256 hex of the key: the window's identity, never the key itself
    name: str
    tokens_per_minute: int


class TokenRateLimiter:
    """A sliding 60-second window of charged tokens per key."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._log: dict[str, deque[tuple[float, int]]] = {}
        self._used: dict[str, int] = {}
        # Charges happen on event loops, but a process may run more than one (one per thread).
        self._lock = threading.Lock()

    def used(self, key_id: str) -> int:
        with self._lock:
            self._expire(key_id, self.clock())
            return self._used.get(key_id, 0)

    def charge(self, limit: KeyLimit, tokens: int) -> None:
        """Record ``tokens`` against ``limit``'s key, or raise ``TokenRateLimited`` and record nothing."""
        with self._lock:
            now = self.clock()
            self._expire(limit.key_id, now)
            used = self._used.get(limit.key_id, 0)
            cap = limit.tokens_per_minute
            if tokens > cap:
                # Waiting cannot help; OpenAI answers this case with 429 too.
                raise TokenRateLimited(
                    f"Request too large for key {limit.name!r}: {tokens} tokens (prompt + max output) "
                    f"exceed its limit of {cap} tokens per minute. Reduce the prompt or max_tokens.",
                    retry_after_s=math.ceil(self.window_s),
                )
            if used + tokens > cap:
                raise TokenRateLimited(
                    f"Rate limit reached for key {limit.name!r}: {cap} tokens per minute, {used} used, "
                    f"this request needs {tokens}. Retry after the time in Retry-After.",
                    retry_after_s=self._retry_after(limit.key_id, now, used + tokens - cap),
                )
            log = self._log.setdefault(limit.key_id, deque())
            log.append((now, tokens))
            self._used[limit.key_id] = used + tokens

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
        for at, tokens in self._log.get(key_id, ()):
            freed += tokens
            if freed >= excess:
                return max(1, math.ceil(at + self.window_s - now))
        return max(1, math.ceil(self.window_s))


# The process's limiter, and the key of the request being served (set by the view).
LIMITER = TokenRateLimiter()
_current: contextvars.ContextVar[KeyLimit | None] = contextvars.ContextVar("motor_key_limit", default=None)


def bind(limit: KeyLimit | None) -> None:
    """Attach the caller's key limit to this request's context (None: unlimited)."""
    _current.set(limit)


def charge(tokens: int, limiter: TokenRateLimiter | None = None) -> None:
    """Charge the bound key, if it has a limit; raises ``TokenRateLimited`` when over it."""
    limit = _current.get()
    if limit is not None:
        (limiter or LIMITER).charge(limit, tokens)
