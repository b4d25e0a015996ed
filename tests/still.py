"""Waiting until something a test watches has stopped changing: a held-back stream, a blocked server.

A watchdog for a state to be reached (the bound is generous), never a timing assertion. Used by
``tests/motorsite/test_uvicorn_protocol.py``, ``tests/serving/test_silent_client.py`` and
``tests/serving/test_held_stream_objects.py``.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_still(
    read: Callable[[], T], *, polls: int, poll_s: float, wait_s: float, never: str,
    settled: Callable[[T], bool] = lambda _: True,
) -> T:
    """Poll ``read`` every ``poll_s`` until it gave the same value, one ``settled`` says is far
    enough, ``polls`` times running; returns that value. Fails with ``never`` after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    last: T | None = None
    still = 0
    while True:
        assert time.monotonic() < deadline, never
        time.sleep(poll_s)
        value = read()
        still = still + 1 if value == last and settled(value) else 0
        if still >= polls:
            return value
        last = value
