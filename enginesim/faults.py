"""Injected failures for the next generate requests.

A fault is armed with a count; each generate request received takes one unit (before its
body is validated, so "the next n requests fail" holds whatever they contain).

Streaming semantics of each mode (non-streaming requests, in brackets):

- ``fail_before_first_token``: close the connection before sending anything.
- ``drop_after_tokens``: send ``tokens`` token ids, then close the connection
  (chunked body left incomplete) [close without a response].
- ``http_status``: answer ``status`` with a vLLM-shaped error body.
- ``stall_after_tokens``: send ``tokens`` token ids, then nothing until the client goes
  away [no response until the client goes away].
- ``error_event_after_tokens``: send ``tokens`` token ids, then an in-band
  ``{"error": {..., "code": 500}}`` event and ``[DONE]`` [a 500 JSON error].

"After k tokens" fires once k ids were sent, or at the end of the output (before the
usage event and ``[DONE]``) if the sequence finished with fewer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FaultMode(enum.Enum):
    FAIL_BEFORE_FIRST_TOKEN = "fail_before_first_token"
    DROP_AFTER_TOKENS = "drop_after_tokens"
    HTTP_STATUS = "http_status"
    STALL_AFTER_TOKENS = "stall_after_tokens"
    ERROR_EVENT_AFTER_TOKENS = "error_event_after_tokens"


@dataclass(frozen=True, slots=True)
class Fault:
    mode: FaultMode
    tokens: int = 0
    status: int = 500


class FaultQueue:
    """The armed fault and how many more requests it applies to."""

    def __init__(self) -> None:
        self._fault: Fault | None = None
        self._remaining = 0

    def arm(self, fault: Fault, count: int) -> None:
        # Arming replaces whatever was armed: tests state the whole plan in one call.
        self._fault = fault if count > 0 else None
        self._remaining = count

    def clear(self) -> None:
        self._fault = None
        self._remaining = 0

    def take(self) -> Fault | None:
        """The fault for the request being handled, consuming one unit."""
        if self._fault is None or self._remaining <= 0:
            return None
        fault = self._fault
        self._remaining -= 1
        if self._remaining == 0:
            self._fault = None
        return fault

    @property
    def remaining(self) -> int:
        return self._remaining
