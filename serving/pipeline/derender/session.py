"""Streaming derender of one prompt: committed ``stream_state`` per choice, attempts, relay ledger.

A ``StreamingRenderSession`` lives for the whole streaming request of one prompt, across engine
attempts. For each engine event it derenders with the *committed* state of the event's choice;
the chunk goes to the client, and only when the consumer asks for the next one (the chunk was
handed on) does the session commit the next state and record the event's token ids as output.
A failed derender commits nothing. The committed output ids (semantic ids: the boundary has
deobfuscated the events already) are the relay ledger from which a retry plan continues.

Every attempt starts from a snapshot; an attempt that fails before the client saw any chunk of
it restores the snapshot, after visible output the committed state is kept, so the next attempt
derenders on from it (no second role delta, no duplicate, no gap).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from array import array
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, AsyncContextManager, Protocol

from serving.pipeline import metric_names
from serving.pipeline.derender.coalesce import each_event
from serving.pipeline.derender.payload import (
    StreamState,
    proves_plain_path,
    reads_request,
    request_unread,
    slim_request,
)
from serving.pipeline.errors import DerenderError
from serving.pipeline.phases import NO_PHASES, Phases
from serving.pipeline.protocol import EventBatches, TokenKind
from serving.pipeline.render.client import RETRY_DELAY_MAX_S, RETRY_DELAY_MIN_S, DerenderRetryable
from serving.pipeline.step_bound import StepBound
from serving.pipeline.tracing import NO_TRACE

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """The streaming knobs (``settings.MOTOR_STREAM_*``)."""

    # An engine that sends no event for this long has stalled: the attempt fails (relay / error).
    chunk_timeout_s: float = 60.0
    # Relays per request after a mid-stream engine failure (single prompt, all its choices).
    max_relays: int = 2
    # Derender retries of the same chunk with the same previous state, on connection errors and
    # 5xx only (MOTOR_DERENDER_CHUNK_RETRIES). 0, the RFC's "no automatic retry in this stage":
    # the first failure ends the stream. All tries of a chunk share the chunk's one bound, the
    # render config's timeout_ms, and the state is committed only after one succeeded.
    derender_retries: int = 0


class ChoicePhase(enum.Enum):
    PENDING = "pending"  # nothing derendered yet
    STREAMING = "streaming"  # chunks committed, no finish reason yet
    DONE = "done"  # finish reason committed
    FAILED = "failed"  # the request ended with an error while this choice was open
    CANCELLED = "cancelled"  # the client left, or a sibling's failure ended the request


# The next wider array of ids: unsigned 16 bits, then signed 32 and 64 (a negative id or one past
# 2**63 is no token: ``OverflowError`` from the last).
_WIDER = {"H": "i", "i": "q"}


@dataclass(slots=True)
class ChoiceRecord:
    """Committed state of one choice: only what the client has been handed."""

    index: int
    phase: ChoicePhase = ChoicePhase.PENDING
    stream_state: StreamState = None  # as the derenderer keeps it (``ChunkDerender.kept``)
    # Committed semantic output ids, kept for a relay's replay: 2 bytes an id while every id fits
    # (a vocabulary under 65,536), else 4, instead of a list's pointer plus an int object (40
    # bytes), which was most of a long stream's own state. An id that does not fit widens the
    # array (``commit``: "H", then "i", then "q") rather than fail.
    output_ids: array[int] = field(default_factory=lambda: array("H"))
    visible: bool = False  # a chunk of this choice was handed to the client
    finish_reason: str | None = None
    # Derendered but not handed on yet (held back for stop strings): the next derender goes on
    # from the last of them (``tip_state``); a failed attempt drops them (``drop_uncommitted``).
    held: int = 0
    held_tokens: int = 0
    tip_state: StreamState = None


@dataclass(frozen=True, slots=True)
class AttemptSnapshot:
    """The committed state when an attempt started: restored if it fails before visible output."""

    attempt: int
    instance: str
    choices: tuple[tuple[int, ChoicePhase, StreamState, int, bool, str | None], ...]


@dataclass(frozen=True, slots=True)
class PendingChunk:
    """A derendered chunk, not yet committed."""

    chunk: dict[str, Any]
    index: int | None  # the choice, or None for a usage-only event
    next_state: StreamState
    token_ids: tuple[int, ...]
    finish_reason: str | None


# The reader turns the engine's reads into the events to derender: one by one, or merged where
# several arrived behind an in-flight derender (derender/coalesce.py); hold-back
# (derender/holdback.py ``ChunkHoldback``) sees each derendered chunk before the client does and
# says which may go now. The defaults serve sessions built without either (unit tests).
EventReader = Callable[[EventBatches], AsyncIterator[dict[str, Any]]]


class Holdback(Protocol):
    """Says which derendered chunks may go to the client now (``ChunkHoldback`` for stop strings)."""

    def release(self, pending: PendingChunk) -> list[PendingChunk]: ...

    def discard(self) -> None: ...


class ChunkDerender(Protocol):
    """Derenders one event with a choice's state: the sidecar's client (``RenderClient``), or the
    coordinator's own plain-path derender (derender/local_stream.py, ``local_stream_detokenize``)."""

    timeout_s: float

    def chunk_slot(self) -> AsyncContextManager[None]:
        """Held around each chunk's derender, outside its deadline (render/window.py). A session
        asks once and enters what it got around every chunk: it must be reusable."""
        ...

    async def derender_chunk(
        self, kind: TokenKind, generate_chunk: dict[str, Any], *, stream_state: StreamState,
        prompt_tokens: int, prompt_token_ids: Sequence[int] | None, request: dict[str, Any] | None, model: str | None,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]: ...

    def kept(self, state: dict[str, Any] | None) -> StreamState:
        """``state`` (a call's answer) as the session keeps it until it hands it to the next call:
        the sidecar's client packs it as JSON (``derender/payload.py``), the coordinator's own
        derender keeps its dict."""


class _NoHoldback:
    """Every chunk goes at once (no stop strings, or a session built for a unit test)."""

    def release(self, pending: PendingChunk) -> list[PendingChunk]:
        return [pending]

    def discard(self) -> None:
        pass


class StreamingRenderSession:
    """Derender of one prompt's engine events across attempts; commits only what was handed on."""

    # Slotted: a session lives as long as its stream, and its attribute dict weighed 1 KiB a prompt.
    __slots__ = ("render", "kind", "body", "prompt_ids", "request_id", "public_id", "prompt_index", "settings",
                 "reader", "holdback", "phases", "trace", "choices", "attempt", "instance", "relays",
                 "derender_calls", "_slim", "_unread", "_slot", "_bound")

    def __init__(
        self,
        render: ChunkDerender,
        kind: TokenKind,
        body: dict[str, Any],
        prompt_ids: Sequence[int],
        *,
        request_id: str,
        public_id: str,
        prompt_index: int = 0,
        settings: StreamSettings = StreamSettings(),
        reader: EventReader = each_event,
        holdback: Holdback | None = None,
        phases: Phases = NO_PHASES,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> None:
        self.render = render
        self.kind = kind
        self.body = body
        self.prompt_ids = prompt_ids  # the ORIGINAL prompt, for every attempt (never the replay)
        self.request_id = request_id
        self.public_id = public_id
        self.prompt_index = prompt_index
        self.settings = settings
        self.reader = reader
        self.holdback = holdback or _NoHoldback()
        self.phases = phases  # the request's: its first derender call is a phase of its TTFT
        self.trace = trace  # the request's trace headers, on every derender call
        self.choices: dict[int, ChoiceRecord] = {}
        self.attempt = 0
        self.instance = ""
        self.relays = 0
        self.derender_calls = 0
        # Set once the sidecar has shown it runs the plain path (derender/payload.py): later
        # calls carry the slim request and no prompt ids, or no request where none is read.
        self._slim: dict[str, Any] | None = None
        self._unread = request_unread(kind, body)
        self._slot: AsyncContextManager[None] | None = None  # ``render.chunk_slot()``, taken at the first chunk
        # Each chunk's bound (``render.timeout_s``), on one timer for the stream (``StepBound``).
        self._bound: StepBound | None = None

    # -- state -----------------------------------------------------------------------------------

    def choice(self, index: int) -> ChoiceRecord:
        record = self.choices.get(index)
        if record is None:
            record = self.choices[index] = ChoiceRecord(index)
        return record

    @property
    def visible(self) -> bool:
        return any(c.visible for c in self.choices.values())

    @property
    def committed_ids(self) -> list[int]:
        """The relay ledger of a single-choice stream (choice 0)."""
        return self.committed_ids_of(0)

    def committed_ids_of(self, index: int) -> list[int]:
        """The relay ledger of choice ``index``: the semantic output ids its client has."""
        return list(self.choice(index).output_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.choices.values())

    def drop_uncommitted(self) -> None:
        """Forget what was derendered but never handed on: the next derender starts from the
        committed state again (an attempt failed, or the stream ended)."""
        self.holdback.discard()
        for c in self.choices.values():
            c.held, c.held_tokens, c.tip_state = 0, 0, None

    def usage(self, extra_tokens: int = 0) -> dict[str, int]:
        """The coordinator's own account: original prompt, every committed output token."""
        completion = self.completion_tokens + extra_tokens
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": completion,
                "total_tokens": len(self.prompt_ids) + completion}

    def begin_attempt(self, attempt: int, instance: str) -> AttemptSnapshot:
        self.attempt = attempt
        self.instance = instance
        return AttemptSnapshot(attempt, instance, tuple(
            (c.index, c.phase, c.stream_state, len(c.output_ids), c.visible, c.finish_reason)
            for c in self.choices.values()
        ))

    def restore(self, snapshot: AttemptSnapshot) -> None:
        """Back to the state ``snapshot`` took (the attempt failed before visible output)."""
        self.drop_uncommitted()
        kept = {i for i, *_ in snapshot.choices}
        self.choices = {i: c for i, c in self.choices.items() if i in kept}
        for index, phase, state, count, visible, finish in snapshot.choices:
            record = self.choices[index]
            record.phase, record.stream_state, record.visible, record.finish_reason = phase, state, visible, finish
            del record.output_ids[count:]

    def end(self, phase: ChoicePhase) -> None:
        """Mark every open choice ``phase`` (FAILED / CANCELLED) when the request ends early."""
        for c in self.choices.values():
            if c.phase in (ChoicePhase.PENDING, ChoicePhase.STREAMING):
                c.phase = phase

    def commit(self, pending: PendingChunk) -> None:
        """The chunk was handed on: its state and tokens are now the client's."""
        if pending.index is None:
            return
        record = self.choice(pending.index)
        record.stream_state = pending.next_state
        ids = record.output_ids
        count = len(ids)
        while True:
            try:
                ids.extend(pending.token_ids)
                break
            except OverflowError:  # an id the array cannot hold (extend kept the ones before it)
                del ids[count:]
                wider = _WIDER.get(ids.typecode)
                if wider is None:
                    raise
                record.output_ids = ids = array(wider, ids)
        if record.held:
            record.held -= 1
            record.held_tokens -= len(pending.token_ids)
        record.visible = True
        if pending.finish_reason is not None:
            record.finish_reason = pending.finish_reason
            record.phase = ChoicePhase.DONE
        else:
            record.phase = ChoicePhase.STREAMING

    # -- derender --------------------------------------------------------------------------------

    async def derender(self, event: dict[str, Any]) -> PendingChunk:
        """Derender ``event`` with the committed state of its choice; commits nothing."""
        choices = event.get("choices") or []
        index = int(choices[0].get("index", 0)) if choices else None
        token_ids = tuple(choices[0].get("token_ids") or ()) if choices else ()
        finish = choices[0].get("finish_reason") if choices else None
        record = self.choice(index) if index is not None else None
        # The state after the last chunk derendered: a held-back chunk's, else the committed one.
        state = None if record is None else (record.tip_state if record.held else record.stream_state)
        slim = self._slim if state is not None else None  # a choice's first call seeds from the prompt
        request: dict[str, Any] | None = slim if slim is not None else self.body
        if slim is not None and self._unread and not reads_request(event):
            request = None
        prompt_ids = None if slim is not None else self.prompt_ids
        tries = 1 + max(0, self.settings.derender_retries)
        # One bound per chunk (the RFC's timeout_ms "per derender chunk"): every try and pause of
        # this chunk's derender, whatever the retry setting.
        budget = self.render.timeout_s
        first, start = self.derender_calls == 0, self.phases.now()
        try:
            # The turn first, then the deadline: a call waiting for the pool's window (its events
            # coalescing meanwhile) is not yet a derender call, and its wait is not the sidecar's.
            slot = self._slot
            if slot is None:  # the session's one loop and pool: looked up once per stream, not per chunk
                slot = self._slot = self.render.chunk_slot()
            bound = self._bound
            if bound is None:
                bound = self._bound = StepBound(budget)
            async with slot, bound:
                delay = RETRY_DELAY_MIN_S
                for attempt in range(tries):
                    self.derender_calls += 1
                    try:
                        chunk, next_state = await self.render.derender_chunk(
                            self.kind, event, stream_state=state, prompt_tokens=len(self.prompt_ids),
                            prompt_token_ids=prompt_ids, request=request, model=self.body.get("model"),
                            trace=self.trace,
                        )
                        break
                    except DerenderRetryable as exc:
                        # Same chunk, same previous state: derender is a pure function of both,
                        # and nothing was committed, so a retry cannot duplicate or skip output.
                        if attempt + 1 >= tries:
                            raise
                        self._log_failure(index, exc, retrying=True)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_DELAY_MAX_S)
        except TimeoutError as exc:
            err = DerenderError(f"derender of a chunk took over {budget:g}s", status=504)
            self._log_failure(index, err)
            raise err from exc
        except BaseException as exc:
            if not isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                self._log_failure(index, exc)
            raise
        if first:
            self.phases.observe(metric_names.PHASE_FIRST_DERENDER, start)
        if self._slim is None and proves_plain_path(token_ids, next_state):
            self._slim = slim_request(self.kind, self.body)
        chunk["id"] = self.public_id
        self._account(chunk, len(token_ids))
        self._own_prompt_ids(chunk, index)
        return PendingChunk(chunk, index, self.render.kept(next_state), token_ids, finish)

    def _own_prompt_ids(self, chunk: dict[str, Any], index: int | None) -> None:
        """``prompt_token_ids`` (``return_token_ids``) are the original prompt's, and only until the
        client saw output of the chunk's choice: a relayed attempt's engine was sent the replay
        (prompt + committed output) and would hand that back as the prompt, a second time."""
        record = self.choices.get(index) if index is not None else None
        visible = record is not None and record.visible
        for holder in (chunk, *(chunk.get("choices") or ())):
            if isinstance(holder, dict) and holder.get("prompt_token_ids") is not None:
                holder["prompt_token_ids"] = None if visible else list(self.prompt_ids)

    def _account(self, chunk: dict[str, Any], new_tokens: int) -> None:
        """Usage numbers are ours, never an engine's (a relayed attempt saw a longer prompt)."""
        usage = chunk.get("usage")
        if not isinstance(usage, dict):
            return
        # continuous_usage_stats: a choice chunk counts itself and the held-back chunks before
        # it (sent before it); the final usage chunk counts all.
        held = sum(c.held_tokens for c in self.choices.values())
        usage.update(self.usage(held + new_tokens if chunk.get("choices") else held))

    def _log_failure(self, index: int | None, exc: BaseException, *, retrying: bool = False) -> None:
        logger.warning(
            "stream_derender request_id=%s prompt=%d choice=%s attempt=%d error=%s retrying=%s",
            self.request_id, self.prompt_index, "-" if index is None else index, self.attempt,
            type(exc).__name__, str(retrying).lower(),
        )

    def release_bound(self) -> None:
        """Let go of the chunks' bound's timer (an attempt ended); the next chunk arms it again."""
        if self._bound is not None:
            self._bound.close()

    def chunks(self, events: EventBatches) -> AttemptChunks:
        """Derendered chunks of one attempt's events; each is committed once the consumer asks for
        the next one (``AttemptChunks``).

        ``events`` are already through the engine boundary (semantic ids) and error checks.
        """
        return AttemptChunks(self, events)


class AttemptChunks:
    """``StreamingRenderSession.chunks``: a plain async iterator, not an async generator, so a
    stream whose client reads nothing keeps no suspended frame of it (nor asyncio's weak-set
    entry for one) per prompt (issue 31, ``bench/slow_reader.py``).

    A chunk is the client's (committed) when the consumer comes back for the next one; one that
    the consumer never came back for (it closed this, or an error ended the attempt) is not. It
    ends once it has ended, raised or been closed: whatever is held then was never handed on.
    """

    __slots__ = ("_session", "_events", "_reader", "_released", "_ready", "_closed")

    def __init__(self, session: StreamingRenderSession, events: EventBatches) -> None:
        self._session = session
        self._events: EventBatches | None = events
        # The (coalescing) reader wraps the engine events at the first chunk asked, and only here.
        self._reader: AsyncIterator[dict[str, Any]] | None = None
        self._released: list[PendingChunk] = []  # let go by the hold-back, not yet handed on
        self._ready: PendingChunk | None = None  # handed on, committed when the consumer comes back
        self._closed = False

    def __aiter__(self) -> AttemptChunks:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._closed:
            raise StopAsyncIteration
        session = self._session
        try:
            ready = self._ready
            if ready is not None:
                # The consumer came back: it handed the chunk on. Only now is it the client's.
                self._ready = None
                session.commit(ready)
            released = self._released
            reader = self._reader
            if reader is None:
                assert self._events is not None
                reader = self._reader = session.reader(self._events)
                self._events = None
            while not released:
                event = await reader.__anext__()
                pending = await session.derender(event)
                del event  # derendered: not held while the client is slow to take the chunk
                if pending.index is not None:
                    record = session.choice(pending.index)
                    record.held += 1
                    record.held_tokens += len(pending.token_ids)
                    record.tip_state = pending.next_state
                # The hold-back sees every chunk here, before the client does, and says which may go.
                released.extend(session.holdback.release(pending))
                del pending
        except BaseException:  # the end, a failure, or the consumer's cancellation: ended
            await self.aclose()
            raise
        # Handed on with no reference left here (``_ready`` keeps what the commit reads): a slow
        # client's stream holds the chunk's frame, not its parsed JSON as well (issue 31: 1.2
        # KiB a prompt, bench/slow_reader.py).
        ready = released.pop(0)
        chunk = ready.chunk
        self._ready = PendingChunk({}, ready.index, ready.next_state, ready.token_ids, ready.finish_reason)
        return chunk

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ready = None
        self._released = []
        reader, self._reader, self._events = self._reader, None, None
        if reader is None:
            return  # never started: nothing derendered, nothing to let go
        # Whatever is still held was never handed on (a failed attempt, the client left).
        self._session.drop_uncommitted()
        self._session.release_bound()
        # The reader may be suspended in the events: finish it now, not after the caller closed
        # the engine stream under it.
        await reader.aclose()  # type: ignore[attr-defined]
