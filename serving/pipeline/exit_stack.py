"""``ExitStack``: contextlib's ``AsyncExitStack`` with its callbacks in a list.

contextlib keeps an exit stack's callbacks in a ``deque``, which weighs about 0.6 KiB empty: a
stream keeps a stack per request and one per engine attempt for as long as it lasts, three a
two-prompt stream, so about 2 KiB of the 64 KiB a stream whose client reads nothing may hold
(issue 31). The stack only ever appends and pops its last callback, which a list does as well;
everything else is contextlib's own.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any


class ExitStack(AsyncExitStack):
    """An ``AsyncExitStack`` whose callbacks are a list (``pop_all`` hands them over as they are)."""

    def __init__(self) -> None:
        self._exit_callbacks: Any = []
