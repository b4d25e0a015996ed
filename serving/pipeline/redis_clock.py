"""A clock for the expiry times kept in Redis that a step of Redis's wall clock does not move.

Every shared-state script (admission leases, tokens-per-minute windows, shared breakers and
their trial claims) needs a "now" that all processes agree on, whatever their own clocks say.
Redis's ``TIME`` is that, but it is the server's wall clock: one forward step of it (NTP, a VM
restored, an operator's ``date``) expires every lease, open period and claim at once, and one
backward step holds them for as long as the step. Redis's own key expiry (``PEXPIRE``, ``SET
PX``) is on the same wall clock, so it is no alternative.

``clock_lua`` defines ``now_ms()`` for a script: a clock kept in a small hash in Redis that
follows the progress of ``TIME`` but moves at most ``max_step`` ms per script and never back.
A step of any size therefore advances it by at most ``max_step``, which each caller picks below
what anything live has left. Between two scripts further apart than ``max_step`` the clock lags
behind real time, which only delays an expiry. It starts at ``TIME`` on first use, so scores
written on ``TIME`` before this clock existed keep their meaning.
"""

from __future__ import annotations


def clock_lua(key: str, max_step: str) -> str:
    """Lua defining ``now_ms()`` on the clock in hash ``key``, moving at most ``max_step`` ms a call.

    ``key`` and ``max_step`` are Lua expressions of the script (``"KEYS[10]"``, ``"ARGV[2]"``).
    The hash keeps ``now`` (the clock) and ``wall`` (the ``TIME`` it last saw); it never expires.
    """
    return f"""
local function now_ms()
  local t = redis.call('TIME')
  local wall = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local c = redis.call('HMGET', {key}, 'now', 'wall')
  local now = tonumber(c[1] or wall)
  local step = wall - tonumber(c[2] or wall)
  if step > 0 then now = now + math.min(step, tonumber({max_step})) end
  redis.call('HSET', {key}, 'now', now, 'wall', wall)
  return now
end
"""
