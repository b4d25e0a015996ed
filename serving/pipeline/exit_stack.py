"""``ExitStack``: contextlib's ``AsyncExitStack`` with its callbacks in a list, each as one small object.

contextlib keeps an exit stack's callbacks in a ``deque``, which weighs about 0.6 KiB empty: a
stream keeps a stack per request and one per engine attempt for as long as it lasts, three a
two-prompt stream, so about 2 KiB of the 64 KiB a stream whose client reads nothing may hold
(issue 31). The stack only ever appends and pops its last callback, which a list does as well.

contextlib also wraps each ``callback`` and ``push_async_callback`` in a closure of its own that
carries a ``__wrapped__`` attribute (a function, its attribute dict and cells: about 0.4 KiB a
callback, a lease's release, a refund, a stream's close); here each is one slotted object that
calls it and, as contextlib's, ignores the exception it is told of and suppresses nothing.
Everything else is contextlib's own.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")


class _Call:
    """A ``callback`` as an exit callback: calls it, whatever the exception."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., object]) -> None:
        self.fn = fn

    def __call__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.fn()


class _AsyncCall:
    """A ``push_async_callback`` as an exit callback: awaits it, whatever the exception."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Awaitable[object]]) -> None:
        self.fn = fn

    async def __call__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.fn()


class ExitStack(AsyncExitStack):
    """An ``AsyncExitStack`` whose callbacks are a list (``pop_all`` hands them over as they are),
    each plain callback one slotted object."""

    def __init__(self) -> None:
        self._exit_callbacks: Any = []

    def callback(self, callback: Callable[_P, _T], /, *args: _P.args, **kwds: _P.kwargs) -> Callable[_P, _T]:
        """As contextlib's: ``callback(*args, **kwds)`` when the stack closes; returns ``callback``."""
        self._exit_callbacks.append((True, _Call(functools.partial(callback, *args, **kwds) if args or kwds else callback)))
        return callback

    def push_async_callback(
        self, callback: Callable[_P, Awaitable[_T]], /, *args: _P.args, **kwds: _P.kwargs
    ) -> Callable[_P, Awaitable[_T]]:
        """As contextlib's: ``await callback(*args, **kwds)`` when the stack closes; returns ``callback``."""
        fn = functools.partial(callback, *args, **kwds) if args or kwds else callback
        self._exit_callbacks.append((False, _AsyncCall(fn)))
        return callback
