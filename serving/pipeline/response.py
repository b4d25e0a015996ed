"""One request's answer and everything it holds, from the moment the pipeline takes it.

``respond`` gives a request one ``AsyncExitStack`` before its first step runs; every step that
takes something puts its release there as it takes it: the key's charge (refunded unless the
request was answered), the render pool's count (``render/sidecar_holds.py``), the engine streams (closed
and aborted unless finished), the stream body itself. Whatever way the request ends, the stack
lets go of everything, in the reverse order:

- an error at any step: ``respond`` closes the stack and raises (nothing was answered: refund);
- a JSON answer: ``respond`` closes the stack (the charge is kept) and returns the dict;
- a stream: ``respond`` returns the ``Response``, which owns the stack from then on. The edge
  sends it inside ``async with response``; ``frames()`` closes the stack when the last frame went
  out or the client left mid-stream, and ``__aexit__`` closes it if ``frames()`` never ran (the
  client left before the first byte: refunded, as nothing was answered).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, aclosing
from types import TracebackType
from typing import Any, Protocol

from serving.pipeline.exit_stack import ExitStack
from serving.pipeline.flow_control.rate_limit import TokenRateLimiter
from serving.pipeline.request_context import RequestContext


class StreamBody(Protocol):
    """A stream's SSE body: its frames once, and ``aclose`` (idempotent) for what it holds."""

    def frames(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class Response:
    """A request's exit stack, and once the answer is a stream, that stream."""

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx
        self.stack: AsyncExitStack = ExitStack()
        self.body: StreamBody | None = None
        # The charge is kept once this is set: a JSON answer was made, or a stream's frames() ran.
        self.answered = False

    async def charge(self, tokens: int, limiter: TokenRateLimiter | None = None) -> None:
        """Charge the key's window once per request; refunded from the stack unless answered."""
        if await self.ctx.charge.charge(tokens, limiter):
            self.stack.push_async_callback(self._refund_unanswered)

    def hold(self, release: Callable[[], None]) -> Callable[[], None]:
        """Let go of something with ``release`` when the request ends (or earlier, by calling the
        returned ``release`` itself: it must be idempotent)."""
        self.stack.callback(release)
        return release

    async def _refund_unanswered(self) -> None:
        if not self.answered:
            await self.ctx.charge.refund()  # the key pays for answers only

    async def frames(self) -> AsyncGenerator[bytes, None]:
        """The stream's frames; everything the request holds is let go when they end, however."""
        assert self.body is not None, "a JSON answer has no frames"
        self.answered = True
        try:
            async with aclosing(self.body.frames()) as frames:  # type: ignore[type-var]
                async for framed in frames:
                    yield framed
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        await self.stack.aclose()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


async def respond(
    ctx: RequestContext, serve: Callable[[Response], Awaitable[dict[str, Any] | StreamBody]]
) -> dict[str, Any] | Response:
    """Run ``serve`` with a fresh ``Response``: a dict once its stack is closed, or the stream's
    ``Response``, which owns the stack from then on. On any failure the stack is closed first."""
    response = Response(ctx)
    try:
        result = await serve(response)
    except BaseException:
        await response.aclose()
        raise
    if isinstance(result, dict):
        response.answered = True
        await response.aclose()
        return result
    response.body = result
    response.stack.push_async_callback(result.aclose)
    return response
