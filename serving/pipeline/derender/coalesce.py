"""Fewer derender calls under load: merge engine events that arrived while a derender was in flight.

The RFC derenders every engine event with its own HTTP call. When the sidecar is slower than the
engine (many streams, a parser replaying the whole output per call) events pile up behind the
derender of the previous one. They pile up in the engine connection's buffer, which hands all of
them over at the next read (``Connection.read_piece``, one list of events per read: ``EventBatches``),
so ``coalesced`` needs no task of its own to watch the stream: per pull it merges, per choice,
what that read brought into a single generate event (``merge_events``), and the next derender
covers several engine events in one call. What a stream holds while its client reads nothing is
then what the connection holds (a streamed body is read only while its reader waits, a trickle
otherwise: ``http11_wire.TRICKLE_SIZE``), not a second buffer of parsed events.

What is never merged, because derender or the client would see the difference:

- events of different choice indices (derender takes one choice per call, one state per index);
- the usage-only final event (``choices: []``): derendered alone it is the client's usage chunk
  with ``choices: []``; folded into a token event it would become usage on a content chunk;
- in-band error events (``{"error": ...}``), which never go to derender at all.

Order is kept: an event never overtakes one that arrived before it for the same choice, and
nothing overtakes an error or usage event (both end the stream). One merged event covers at most
``max_pending`` engine events; what a read brought beyond that waits for the next pull.

``stream_interval`` (``RenderConfig.stream_interval``, vLLM's ``--stream-interval``) also holds a
choice's events back until that many have queued, so each derender call covers that many even
when the sidecar keeps up: fewer calls and less sidecar CPU per stream at low load, for coarser
chunks. A choice's first event is never held (time to first token does not move), nor anything
once its choice finished, the stream ended, an error or usage event waits, or the buffer is full.

``stream_interval_ms`` (``RenderConfig.stream_interval_ms``) bounds the cadence by time as well:
after a choice's first event, its next run is taken no sooner than that many milliseconds after
the previous one was, so a choice costs at most one derender call per interval however fast its
engine decodes (a token count alone lets calls per second grow with the engine's speed). Both
bounds hold together: a held run goes once it has ``stream_interval`` events *and* its interval
has passed, so each bounds the calls per second on its own. The same flushes apply (finish, end,
error or usage, a full buffer). A run held only by time is taken when the interval ends even if
the engine sends nothing more meanwhile: the next read then runs in a task of its own, raced
against the clock (``Clock.wait``), and the read goes on across the yield. Held events are not
derendered, so not committed: a relay resumes from what the client has, as without an interval.
Runs of different choices may pass each other (each choice has its own clock); runs of one
choice never do.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Callable

from serving.pipeline.protocol import EventBatches
from serving.pipeline.snapshot import RenderView

# The most engine events one derender call covers.
MAX_PENDING = 64
# A run of one choice's events is folded into one merged event every FOLD_EVERY events, so a
# run held for ``stream_interval`` is a token list, not that many parsed events (about 1 KiB
# each). Merging is associative, so folding early changes nothing.
FOLD_EVERY = 4


class Clock:
    """Time for ``stream_interval_ms``: the event loop's clock, and a wait that a read ends early.

    Tests pass a fake one (its own ``now`` and a ``wait`` that ends when they advance it).
    """

    def now(self) -> float:
        """Seconds on a monotonic clock."""
        return asyncio.get_running_loop().time()

    async def wait(self, read: asyncio.Future[Any], delay: float) -> None:
        """Return once ``read`` is done or ``delay`` seconds have passed; never cancels ``read``."""
        await asyncio.wait((read,), timeout=max(0.0, delay))


CLOCK = Clock()


def event_choice_index(event: dict[str, Any]) -> int | None:
    """The choice index of a token event, or None for error and usage-only events."""
    if "error" in event:
        return None
    choices = event.get("choices") or []
    if len(choices) != 1:
        return None
    index = choices[0].get("index", 0)
    return index if isinstance(index, int) else 0


def _concat_lists(values: list[Any]) -> Any:
    """Concatenation of the non-null lists, or None when every value was null."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    out: list[Any] = []
    for v in present:
        out.extend(v)
    return out


def merge_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge consecutive token events of one choice into one, as if the engine had sent them as one.

    Token ids, ``logprobs.content`` and ``sampling_mask`` are concatenated; finish and stop reason,
    usage (cumulative with continuous usage) and every other field come from the last event;
    ``prompt_token_ids`` (only on the first event, with ``return_token_ids``) is kept. Raises
    ValueError for an empty list or events of different choices (a caller bug).
    """
    if not events:
        raise ValueError("nothing to merge")
    if len(events) == 1:
        return events[0]
    indices = {event_choice_index(e) for e in events}
    if len(indices) != 1 or None in indices:
        raise ValueError(f"only token events of one choice merge, got indices {indices}")
    choices = [e["choices"][0] for e in events]
    last = events[-1]
    choice = dict(choices[-1])
    choice["token_ids"] = _concat_lists([c.get("token_ids") for c in choices]) or []
    contents = [c["logprobs"].get("content") if isinstance(c.get("logprobs"), dict) else None for c in choices]
    merged_content = _concat_lists(contents)
    if merged_content is not None:
        choice["logprobs"] = {**(choices[-1].get("logprobs") or {}), "content": merged_content}
    if any(c.get("sampling_mask") is not None for c in choices):
        choice["sampling_mask"] = _concat_lists([c.get("sampling_mask") for c in choices])
    merged = {**last, "choices": [choice]}
    first_prompt = next((e["prompt_token_ids"] for e in events if e.get("prompt_token_ids") is not None), None)
    if first_prompt is not None:
        merged["prompt_token_ids"] = first_prompt
    return merged


class _Pending:
    """What was read and not yet taken: groups of events, each one choice's run or a lone
    pass-through event."""

    def __init__(self, max_pending: int, interval: int = 1, interval_s: float = 0.0) -> None:
        self.max_pending = max_pending
        self.interval = max(1, min(interval, max_pending))
        self.interval_s = max(0.0, interval_s)
        # choice -> when its last run was taken (clock seconds); a choice is absent until its
        # first event was taken, which is never held back
        self.last_taken: dict[int, float] = {}
        # [choice index or None, events (folded), raw events in them]; a list, not a deque: a
        # few groups at most, and an empty deque weighs 0.7 KiB per open stream
        self.groups: list[list[Any]] = []
        self.count = 0  # raw events held
        self.high_water = 0
        self.done = False

    def add(self, event: dict[str, Any]) -> None:
        index = event_choice_index(event)
        if index is not None:
            # Join the latest group of this choice unless a pass-through event came after it: an
            # event may move past other choices' events, never past its own or an error/usage.
            for gi in range(len(self.groups) - 1, -1, -1):
                group = self.groups[gi]
                g_index, g_events = group[0], group[1]
                if g_index is None:
                    break
                if g_index == index:
                    if g_events[-1]["choices"][0].get("finish_reason") is None and group[2] < self.max_pending:
                        g_events.append(event)
                        if len(g_events) >= FOLD_EVERY:
                            group[1] = [merge_events(g_events)]
                        group[2] += 1
                        self._counted()
                        return
                    break
        self.groups.append([index, [event], 1])
        self._counted()

    def extend(self, batch: list[dict[str, Any]]) -> None:
        """Take every event of ``batch`` (one read), emptying it: the layers below, which still
        name the list, hold nothing of it while the consumer derenders (``EventBatches``)."""
        for event in batch:
            self.add(event)
        batch.clear()

    def _counted(self) -> None:
        self.count += 1
        self.high_water = max(self.high_water, self.count)

    def _flushing(self) -> bool:
        """Whether everything held goes now, in order: the end, an error or usage event waits
        (nothing may pass it, and it ends the stream), or the buffer is full."""
        return self.done or self.count >= self.max_pending or any(g[0] is None for g in self.groups)

    def _due(self, group: list[Any]) -> float | None:
        """When ``group`` may be taken: 0.0 at once, a clock time, or None (it waits for events)."""
        index, events, raw = group
        last = self.last_taken.get(index)
        if last is None or events[-1]["choices"][0].get("finish_reason") is not None:
            return 0.0  # a choice's first event, or its last: never held back
        if raw < self.interval:
            return None
        return last + self.interval_s if self.interval_s else 0.0

    def next_ready(self, now: float) -> int | None:
        """The position of the group the consumer may take now, or None (``stream_interval``,
        ``stream_interval_ms``): the first one due whose choice has no earlier group."""
        if not self.groups:
            return None
        if self._flushing():
            return 0
        seen: set[int] = set()
        for gi, group in enumerate(self.groups):
            if group[0] not in seen:
                due = self._due(group)
                if due is not None and due <= now:
                    return gi
            seen.add(group[0])
        return None

    def deadline(self) -> float | None:
        """The earliest clock time a held group becomes due by time alone (None: none does)."""
        dues = [d for g in self.groups if (d := self._due(g))]
        return min(dues) if dues else None

    def take(self, gi: int, now: float) -> list[dict[str, Any]]:
        index, events, raw = self.groups.pop(gi)
        self.count -= raw
        if index is not None:
            self.last_taken[index] = now
        taken: list[dict[str, Any]] = events
        return taken


def coalesced(
    batches: EventBatches,
    *,
    max_pending: int | None = None,
    stats: dict[str, int] | None = None,
    stream_interval: int = 1,
    stream_interval_ms: int = 0,
    clock: Clock = CLOCK,
) -> Coalesced:
    """The events of ``batches`` with each read's token events merged per choice (``Coalesced``).

    With ``stream_interval`` 1 a consumer that keeps up (one event a read) sees the events
    unchanged, one by one; with N it sees each choice's first event alone, then runs of N; with
    ``stream_interval_ms`` M, each choice's runs at least M ms apart (the module docstring says
    what is never held back). An exception of ``batches`` is raised after the events read before
    it were yielded; ``batches`` stays the caller's to close (a read still running in a task when
    this reader is closed is cancelled and awaited first). ``stats``, when given, receives
    ``events_in``, ``events_out`` and ``high_water`` (most events held) once it ends or is closed.
    """
    pending = _Pending(max(1, MAX_PENDING if max_pending is None else max_pending), stream_interval,
                       stream_interval_ms / 1000)
    return Coalesced(batches, pending, stats, clock)


class Coalesced:
    """``coalesced``'s reader: a plain async iterator, not an async generator, so a stream whose
    client reads nothing keeps no suspended frame of it (nor asyncio's weak-set entry for one)
    per prompt (issue 31). It ends (and its ``stats`` are written) once it has ended, raised or
    been closed (``aclose``)."""

    __slots__ = ("_batches", "_pending", "_stats", "_clock", "_events_in", "_events_out", "_error", "_read",
                 "_closed")

    def __init__(self, batches: EventBatches, pending: _Pending, stats: dict[str, int] | None, clock: Clock) -> None:
        self._batches = batches
        self._pending = pending
        self._stats = stats
        self._clock = clock
        self._events_in = self._events_out = 0
        self._error: Exception | None = None
        # A read that goes on while a run is held by time (see the module docstring); None otherwise.
        self._read: asyncio.Future[list[dict[str, Any]]] | None = None
        self._closed = False

    def __aiter__(self) -> Coalesced:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._closed:
            raise StopAsyncIteration
        try:
            return await self._take()
        except BaseException:  # the end, a failure, or the consumer's cancellation: ended
            await self.aclose()
            raise

    async def _take(self) -> dict[str, Any]:
        pending, clock, batches = self._pending, self._clock, self._batches
        gi = pending.next_ready(clock.now())
        while gi is None and not pending.done:
            deadline = pending.deadline() if pending.interval_s else None
            try:
                read = self._read
                if read is None and deadline is None:
                    batch = await anext(batches)  # the common case: no task, as without an interval
                else:
                    if read is None:
                        read = self._read = asyncio.ensure_future(_next(batches))
                    if deadline is None:
                        await asyncio.wait((read,))
                    else:
                        await clock.wait(read, deadline - clock.now())
                    if not read.done():
                        gi = pending.next_ready(clock.now())  # the interval ended: a run is due
                        continue
                    self._read = None
                    batch = read.result()
            except StopAsyncIteration:
                pending.done = True
            except Exception as exc:
                self._error, pending.done = exc, True
            else:
                self._events_in += len(batch)
                pending.extend(batch)
            gi = pending.next_ready(clock.now())
        if gi is None:
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration
        self._events_out += 1
        return merge_events(pending.take(gi, clock.now()))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        read, self._read = self._read, None
        try:
            if read is not None:
                # The consumer left (or failed) while a read ran: stop it before the caller closes
                # ``batches`` under it. asyncio.wait raises only our own cancellation, which goes on.
                read.cancel()
                await asyncio.wait((read,))
                if not read.cancelled():
                    read.exception()  # retrieved: it died with the stream the consumer left
        finally:
            if self._stats is not None:
                self._stats.update(events_in=self._events_in, events_out=self._events_out,
                                   high_water=self._pending.high_water)


async def _next(batches: EventBatches) -> list[dict[str, Any]]:
    return await anext(batches)


def each_event(batches: EventBatches) -> EachEvent:
    """The events of ``batches`` one by one: the reader with coalescing off (``EachEvent``)."""
    return EachEvent(batches)


class EachEvent:
    """``each_event``'s reader: a plain async iterator, for the reason ``Coalesced`` is one."""

    __slots__ = ("_batches", "_batch", "_closed")

    def __init__(self, batches: EventBatches) -> None:
        self._batches = batches
        self._batch: list[dict[str, Any]] = []
        self._closed = False

    def __aiter__(self) -> EachEvent:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while not self._batch:
            if self._closed:
                raise StopAsyncIteration
            self._batch = await anext(self._batches)
        return self._batch.pop(0)  # taken out: held by the consumer alone

    async def aclose(self) -> None:
        self._closed = True
        self._batch = []


def coalesces(render: RenderView) -> bool:
    """Whether the render config's streams are read by ``coalesced``: ``derender_coalesce``, or a
    ``stream_interval`` above 1 or a ``stream_interval_ms``, which need the same reader. Its engine
    streams are then read whole (``Connection.read_piece``): one read brings all that is there to merge."""
    return render.derender_coalesce or render.stream_interval > 1 or render.stream_interval_ms > 0


def event_reader(render: RenderView) -> Callable[[EventBatches], Coalesced | EachEvent]:
    """The streaming session's engine-event reader for the render config."""
    if not coalesces(render):
        return each_event
    if render.stream_interval > 1 or render.stream_interval_ms > 0:
        return functools.partial(coalesced, stream_interval=render.stream_interval,
                                 stream_interval_ms=render.stream_interval_ms)
    return coalesced
