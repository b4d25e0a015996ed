"""One prompt's chunks across its engine attempts, for ``EventStream`` (``streaming/event_stream.py``).

``PromptChunks`` is what was the stream's per-prompt async generator, as a plain async iterator:
a stream whose client reads nothing keeps every layer of its response suspended for as long as
it is held back, and an async generator weighs its frame and asyncio's weak-set entry for it
(issue 31, ``bench/slow_reader.py``). What it does between chunks (relays) is its owner's
(``PromptAttempts``); what it holds is the current attempt: its streams, snapshot, events and chunks.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from serving.pipeline.derender.session import AttemptChunks, AttemptSnapshot, StreamingRenderSession
from serving.pipeline.engine.leg import GuardedEvents
from serving.pipeline.errors import EngineError
from serving.pipeline.protocol import EventBatches
from serving.pipeline.resilience.attempts import OpenStream

_Item = TypeVar("_Item")

# A prompt's events: its one stream's through the guard, or its choices' merged (n > 1, relayed).
PromptEvents = GuardedEvents | AsyncGenerator[list[dict[str, Any]], None]


class PromptAttempts(Protocol):
    """What ``PromptChunks`` asks its owner (``EventStream``)."""

    @property
    def sessions(self) -> Sequence[StreamingRenderSession]: ...

    def streams_of(self, index: int) -> list[OpenStream]:
        """Prompt ``index``'s engine streams as they are now (relays replace them)."""
        ...

    def prompt_events(self, streams: list[OpenStream], failed: list[tuple[OpenStream, BaseException]]) -> PromptEvents:
        """The events of ``streams``; a stream that fails is recorded in ``failed`` with its error."""
        ...

    async def attempt_failed(
        self, index: int, streams: list[OpenStream], snapshot: AttemptSnapshot,
        failed: list[tuple[OpenStream, BaseException]], exc: EngineError,
    ) -> tuple[list[OpenStream], EventBatches | None]:
        """Relay after a failed attempt, or raise ``exc``: the streams that carry on, and the
        events that end choices whose budget was spent (if any)."""
        ...


class PromptChunks(Generic[_Item]):
    """``EventStream._prompt_chunks``: one prompt's chunks across its attempts, a plain async
    iterator, not an async generator, so a stream whose client reads nothing keeps no suspended
    frame of it (nor asyncio's weak-set entry for one) per prompt (issue 31).

    An attempt's chunks come from its session (``AttemptChunks``, which commits a chunk when it
    is asked for the next one); when the attempt fails with an ``EngineError`` it relays
    (``PromptAttempts.attempt_failed``) and goes on with the new attempt, after the chunks that end
    choices whose budget was spent. It ends once it has ended, raised or been closed: the
    current attempt's chunks are closed, then its events.
    """

    __slots__ = ("_owner", "_index", "_emit", "_streams", "_snapshot", "_failed", "_events", "_chunks", "_tail",
                 "_more", "_closed")

    def __init__(self, owner: PromptAttempts, index: int, emit: Callable[[dict[str, Any]], _Item]) -> None:
        self._owner = owner
        self._index = index
        self._emit = emit
        self._streams: list[OpenStream] = []
        self._snapshot: AttemptSnapshot | None = None
        self._failed: list[tuple[OpenStream, BaseException]] = []
        self._events: PromptEvents | None = None
        self._chunks: AttemptChunks | None = None  # the current attempt's, or the tail's (``_tail``)
        self._tail = False  # ``_chunks`` end choices whose budget was spent (no engine under them)
        self._more = False  # with ``_tail``: an attempt carries on once they ended
        self._closed = False

    def __aiter__(self) -> PromptChunks[_Item]:
        return self

    async def __anext__(self) -> _Item:
        if self._closed:
            raise StopAsyncIteration
        try:
            while True:
                chunks = self._chunks
                if chunks is None:
                    chunks = self._begin()
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    await self._end_attempt()
                    if self._tail:
                        self._tail = False
                        if self._more:
                            continue
                        raise
                    for s in self._streams:
                        s.finished = True
                    raise
                except EngineError as exc:
                    if self._tail:
                        raise
                    await self._end_attempt()
                    assert self._snapshot is not None
                    streams, tail = await self._owner.attempt_failed(
                        self._index, self._streams, self._snapshot, self._failed, exc
                    )
                    if tail is not None:
                        self._chunks = self._owner.sessions[self._index].chunks(tail)
                        self._tail, self._more = True, bool(streams)
                    elif not streams:
                        raise
                    continue
                item = self._emit(chunk)
                del chunk  # not referenced while the client is slow to take its frame
                return item
        except BaseException:  # the end, a failure, or the consumer's cancellation: ended
            await self.aclose()
            raise

    def _begin(self) -> AttemptChunks:
        """The next attempt's chunks, on the prompt's streams as they are now."""
        owner, index = self._owner, self._index
        session = owner.sessions[index]
        streams = self._streams = owner.streams_of(index)
        self._snapshot = session.begin_attempt(max(s.attempt for s in streams), streams[0].instance.name)
        failed: list[tuple[OpenStream, BaseException]] = []
        self._failed = failed
        events = self._events = owner.prompt_events(streams, failed)
        chunks = self._chunks = session.chunks(events)
        return chunks

    async def _end_attempt(self) -> None:
        """Close the attempt's chunks (ended already, unless the consumer left), then its events."""
        chunks, self._chunks = self._chunks, None
        events, self._events = self._events, None
        try:
            if chunks is not None:
                await chunks.aclose()
        finally:
            if events is not None:
                await events.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._end_attempt()
