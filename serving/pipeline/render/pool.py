"""A model's render capacity as a pool of sidecars, picked per call by fewest outstanding calls.

Render keeps no session and the coordinator carries ``stream_state``, so every call (a render,
a whole derender, one streaming chunk) may go to any member that can serve it: the pool picks,
for each call, the member with the fewest calls outstanding in this process among those whose
version serves the call (the RFC's floors: 0.23 render of token ids, 0.24 derender, 0.27
streaming derender) and that are neither marked down in this process (``RenderHealth``: a
refused connection, or timeouts in a row) nor failing their probes.

What a member's failure costs:
- render: the next member is tried; only when none answered does the request fall back to the
  local tokenizer (``TokenizationService``), with the last member's reason.
- derender: a member that cannot be reached or answers 5xx is a fault of that member, and the
  same call (same chunk, same previous state: derender is a pure function of both, and nothing
  was committed) goes to the next one, all inside the call's one bound (``timeout_s``: the pool's
  own for a whole derender, the session's per-chunk bound for a streamed chunk). A stream
  therefore outlives the sidecar it started on without waiting for its restart. A timeout, a
  request error or a missing capability ends the call as a single sidecar's would.

``PoolState`` holds what the process knows of each member (outstanding calls and render-down
memory, by base URL) and outlives snapshots: a member kept across a config change keeps its
counts, and a new member starts fresh.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, AsyncContextManager, Awaitable, Callable, Iterator, Sequence, TypeVar

import httpx

from serving.pipeline.derender.payload import StreamState, packed_state
from serving.pipeline.errors import DerenderError, RenderUnavailable
from serving.pipeline.http11 import Http11Client
from serving.pipeline.protocol import ApiKind, TokenKind
from serving.pipeline.render.client import DerenderRetryable, RenderClient
from serving.pipeline.render.tokenization import RenderHealth
from serving.pipeline.render.window import Windows
from serving.pipeline.snapshot import RenderMember, RenderView
from serving.pipeline.tracing import NO_TRACE

T = TypeVar("T")

# What a call needs of a member (RenderMember's capability flags by name).
TOKEN_IN, DERENDER, STREAMING_DERENDER = "token_in", "derender", "streaming_derender"


@dataclass
class PoolState:
    """Per-process, per-member memory: outstanding calls and the render-down cooldown."""

    cooldown_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    outstanding: dict[str, int] = field(default_factory=dict)
    health: dict[str, RenderHealth] = field(default_factory=dict)
    # Streaming derender calls in flight per pool (render/window.py): the rest wait here, not in a sidecar.
    windows: Windows = field(default_factory=Windows)

    def health_of(self, base_url: str) -> RenderHealth:
        key = base_url.rstrip("/")
        found = self.health.get(key)
        if found is None:
            found = self.health[key] = RenderHealth(self.cooldown_s, self.clock)
        return found


class PoolHealth(RenderHealth):
    """The pool seen as one sidecar by the tokenizer and the native path: down only when every
    member that could render is down. Members are marked by the pool itself, call by call."""

    def __init__(self, pool: RenderPool) -> None:
        super().__init__(pool.state.cooldown_s, pool.state.clock)
        self._pool = pool

    def skip(self) -> bool:
        members = [m for m in self._pool.members if m.token_in]
        return not members or all(self._pool.state.health_of(m.base_url).skip() for m in members)

    def mark(self, exc: RenderUnavailable | None) -> None:
        """Nothing to do: each member was marked when its call ended."""


def pool_members(view: RenderView) -> tuple[RenderMember, ...]:
    """The view's members; a view built without any (tests, older code) is one member at ``base_url``."""
    if view.members:
        return view.members
    return (RenderMember(view.base_url.rstrip("/"), token_in=view.token_in, derender=view.derender,
                         streaming_derender=view.streaming_derender),)


def _serves(member: RenderMember, need: str, kind: str | None) -> bool:
    routes = member.render_routes if need == TOKEN_IN else member.derender_routes
    return kind is None or routes is None or kind in routes


class RenderPool(RenderClient):
    """A ``RenderClient`` whose every call goes to one member of the view's pool (see the module doc).

    Calls one member through one ``RenderClient`` per member, so whatever a member call carries
    (headers, bounds) is the single-sidecar client's.
    """

    def __init__(self, client: Http11Client, view: RenderView, state: PoolState | None = None) -> None:
        self.members = pool_members(view)
        super().__init__(client, self.members[0].base_url, view.timeout_s)
        self.state = state or PoolState()
        self._clients = {m.base_url: RenderClient(client, m.base_url, view.timeout_s) for m in self.members}
        self.health_view = PoolHealth(self)
        self._sidecars = self.base_urls  # the window's key, taken once: one call per streamed chunk
        # The members able to serve each (need, kind), in pool order: the members never change, so
        # this is worked out once per pair, not on every call (a streamed chunk is one).
        self._able: dict[tuple[str, str | None], tuple[RenderMember, ...]] = {}

    @property
    def base_urls(self) -> tuple[str, ...]:
        return tuple(m.base_url for m in self.members)

    def candidates(self, need: str, kind: str | None = None) -> list[RenderMember]:
        """Members that can serve a call needing ``need`` (for API ``kind``, when its route is
        known), best first: those up before those down (marked in this process, or failing their
        probes), each group by fewest outstanding calls (ties: pool order)."""
        able = self._able_for(need, kind)
        if len(able) == 1:
            return list(able)  # nothing to rank

        def rank(item: tuple[int, RenderMember]) -> tuple[bool, int, int]:
            i, m = item
            down = not m.healthy or self.state.health_of(m.base_url).skip()
            return down, self.state.outstanding.get(m.base_url, 0), i

        return [m for _, m in sorted(enumerate(able), key=rank)]

    def _able_for(self, need: str, kind: str | None) -> tuple[RenderMember, ...]:
        able = self._able.get((need, kind))
        if able is None:
            able = self._able[need, kind] = tuple(m for m in self.members if getattr(m, need) and _serves(m, need, kind))
        return able

    def pick(self, need: str, kind: str | None = None) -> RenderMember | None:
        found = self.candidates(need, kind)
        return found[0] if found else None

    def chunk_slot(self) -> AsyncContextManager[None]:
        """A turn in the pool's window of streaming derender calls (render/window.py)."""
        return self.state.windows.of(self._sidecars).slot()

    async def _on(self, member: RenderMember, call: Callable[[RenderClient], Awaitable[T]]) -> T:
        outstanding, url = self.state.outstanding, member.base_url
        # dict's own get and item methods: a Counter's missing key and its deletion are Python code.
        outstanding[url] = outstanding.get(url, 0) + 1
        try:
            return await call(self._clients[url])
        except DerenderRetryable as exc:  # a derender call's; a render call raises RenderUnavailable
            if isinstance(exc.__cause__, httpx.TransportError):  # not a 5xx: nothing listens
                self.state.health_of(url).mark(RenderUnavailable(str(exc), reason="unreachable"))
            raise
        finally:
            left = outstanding.get(url, 0) - 1
            if left > 0:
                outstanding[url] = left
            else:
                outstanding.pop(url, None)

    def _tries(self, need: str, kind: str | None) -> Iterator[RenderMember]:
        """Each able member once, re-ranked before each try (the load moved while one failed)."""
        tried: set[str] = set()
        while True:
            left = [m for m in self.candidates(need, kind) if m.base_url not in tried]
            if not left:
                return
            tried.add(left[0].base_url)
            yield left[0]

    async def _render(self, kind: str, call: Callable[[RenderClient], Awaitable[T]]) -> T:
        last: RenderUnavailable | None = None
        for member in self._tries(TOKEN_IN, kind):
            health = self.state.health_of(member.base_url)
            if health.skip() and last is not None:
                break  # the rest are down too (ranked last): the local tokenizer is next
            try:
                out = await self._on(member, call)
            except RenderUnavailable as exc:
                health.mark(exc)
                last = exc
                continue
            health.mark(None)
            return out
        raise last or RenderUnavailable("no render sidecar of the pool can render token ids", reason="capability")

    async def _derender(self, need: str, kind: str, call: Callable[[RenderClient], Awaitable[T]]) -> T:
        try:
            async with asyncio.timeout(self.timeout_s):  # one bound for the call, failovers included
                return await self._failover(need, kind, call)
        except TimeoutError as exc:
            raise DerenderError(f"derender took over {self.timeout_s:g}s", status=504) from exc

    async def _failover(self, need: str, kind: str, call: Callable[[RenderClient], Awaitable[T]]) -> T:
        """``call`` on each able member in turn until one answers (unbounded: the caller bounds it)."""
        able = self._able_for(need, kind)
        if len(able) == 1:  # one sidecar (the usual pool): nothing to rank, no one to fail over to
            return await self._on(able[0], call)
        last: DerenderError | None = None
        for member in self._tries(need, kind):
            try:
                return await self._on(member, call)
            except DerenderRetryable as exc:
                last = exc
        if last is not None:
            raise last
        raise DerenderError("the response stage is unavailable: no render sidecar of the pool can derender this")

    # -- the RenderClient calls, each on one member -------------------------------------------------

    async def render_chat(
        self, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> dict[str, Any]:
        return await self._render("chat", lambda c: c.render_chat(body, request_id, trace))

    async def render_messages(
        self, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> dict[str, Any]:
        return await self._render("messages", lambda c: c.render_messages(body, request_id, trace))

    async def render_completions(
        self, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> list[dict[str, Any]]:
        return await self._render("completions", lambda c: c.render_completions(body, request_id, trace))

    async def prompt_lengths(
        self, kind: ApiKind, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> list[int]:
        return await self._render(kind, lambda c: c.prompt_lengths(kind, body, request_id, trace))

    async def derender_chat(
        self, generate_response: dict[str, Any], *, prompt_token_ids: Sequence[int], chat_request: dict[str, Any],
        model: str | None,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> dict[str, Any]:
        return await self._derender(DERENDER, "chat", lambda c: c.derender_chat(
            generate_response, prompt_token_ids=prompt_token_ids, chat_request=chat_request, model=model, trace=trace))

    async def derender_completions(
        self, generate_responses: list[dict[str, Any]], *, prompt_token_ids: Sequence[Sequence[int]],
        completion_request: dict[str, Any], model: str | None,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> dict[str, Any]:
        return await self._derender(DERENDER, "completions", lambda c: c.derender_completions(
            generate_responses, prompt_token_ids=prompt_token_ids, completion_request=completion_request, model=model,
            trace=trace))

    async def derender_chunk(
        self, kind: TokenKind, generate_chunk: dict[str, Any], *, stream_state: StreamState,
        prompt_tokens: int, prompt_token_ids: Sequence[int] | None, request: dict[str, Any] | None, model: str | None,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        def call(c: RenderClient) -> Awaitable[tuple[dict[str, Any], dict[str, Any] | None]]:
            return c.derender_chunk(kind, generate_chunk, stream_state=stream_state, prompt_tokens=prompt_tokens,
                                    prompt_token_ids=prompt_token_ids, request=request, model=model, trace=trace)

        # Within the session's bound of the chunk (derender/session.py: the same ``timeout_ms``,
        # started first, so it always ends first): no second deadline of its own per chunk.
        able = self._able_for(STREAMING_DERENDER, kind)
        if len(able) == 1:  # as ``_failover`` would, one coroutine fewer on every chunk
            return await self._on(able[0], call)
        return await self._failover(STREAMING_DERENDER, kind, call)

    # As each member's client keeps it: any member takes the state back (render keeps no session).
    kept = staticmethod(packed_state)

    async def health(self) -> bool:
        """True when any member answers its health route."""
        answers = await asyncio.gather(*(c.health() for c in self._clients.values()))
        return any(answers)
