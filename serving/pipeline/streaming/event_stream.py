"""The SSE body of a streaming response: derender per chunk, relay, restart and fan-in.

``EventStream`` owns the request's established engine streams (``OpenStream``, opened
concurrently by ``open_together`` before the client saw a byte) until it is closed; the
request's ``Response`` (``response.py``) closes it with everything else the request holds. One
``StreamingRenderSession`` per prompt derenders with committed state across attempts. A single
prompt relays to another instance after a mid-stream engine failure (the plan in ``relay.py``),
every choice of it: with ``n > 1`` each unfinished choice continues in an engine stream of its
own from its own committed ids and budget, and their events are merged back into the one
session under the client's choice indexes. Several prompts cannot relay once a chunk was
visible (RFC: no per-prompt replay in this stage) and end with an error frame; before any chunk
was visible the whole request may start over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from serving.pipeline import metric_names
from serving.pipeline.derender.coalesce import event_reader
from serving.pipeline.derender.holdback import ChunkHoldback, derender_request
from serving.pipeline.derender.session import (
    AttemptSnapshot,
    ChoicePhase,
    ChunkDerender,
    StreamingRenderSession,
    StreamSettings,
)
from serving.pipeline.engine.leg import GuardedEvents
from serving.pipeline.engine.requests import GENERATE_PREFIX
from serving.pipeline.errors import EngineError, MotorError, error_body
from serving.pipeline.flow_control.admission import LeaseGroup
from serving.pipeline.phases import NO_PHASES, Phases
from serving.pipeline.protocol import EventBatches, TokenKind
from serving.pipeline.render.tokenization import TokenizedRequest
from serving.pipeline.resilience.attempts import Attempts, OpenStream, open_together
from serving.pipeline.sse import DONE, frame
from serving.pipeline.streaming.fanout import fan_in
from serving.pipeline.streaming.prompt_chunks import PromptChunks, PromptEvents
from serving.pipeline.streaming.relay import RetryRequestPlan
from serving.pipeline.tracing import NO_TRACE

logger = logging.getLogger(__name__)


_Item = TypeVar("_Item")


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


@dataclass(frozen=True, slots=True)
class PromptChunk:
    """What one prompt hands the fan-in (``_merged``): a framed chunk, or, with ``usage`` set, its
    usage-only chunk, left parsed because the fan-in sums the prompts' usage into one chunk."""

    framed: bytes = b""
    usage: dict[str, Any] | None = None


@dataclass
class EventStream:
    """The SSE body of a streaming response; owns the engine streams until it is closed.

    One ``StreamingRenderSession`` per prompt derenders with committed state across attempts; a
    single prompt relays every unfinished choice to another instance after a mid-stream engine
    failure (``_prompt_chunks``); several prompts end with an error frame once a chunk was visible.
    ``streams`` are every open engine stream, tagged with their prompt (and, for a relayed
    choice of an n > 1 request, their choice).
    """

    attempts: Attempts
    render: ChunkDerender  # the sidecar's client, or the coordinator's own (local_stream_detokenize)
    settings: StreamSettings
    kind: TokenKind
    public_id: str
    body: dict[str, Any]
    tokenized: TokenizedRequest
    streams: list[OpenStream]
    request_id: str = ""
    requires_tokenizer: bool = False
    n: int = 1
    phases: Phases = NO_PHASES  # the request's recorder (each session's first derender)
    # The request's trace headers, on every derender call.
    trace: Mapping[str, str] = field(default_factory=lambda: NO_TRACE)
    sessions: list[StreamingRenderSession] = field(default_factory=list)
    _closed: bool = field(default=False, init=False)
    _visible: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if not self.sessions:
            # Coalescing and stop strings (derender/coalesce.py, derender/holdback.py): derender gets
            # the body without ``stop`` (it refuses it); the engine stops and the hold-back filter
            # cuts, as vLLM's detokenizer does. One copy for every prompt's session (none changes it).
            body = derender_request(self.body)
            self.sessions = [
                StreamingRenderSession(
                    self.render, self.kind, body, p.token_ids,
                    request_id=self.request_id, public_id=self.public_id, prompt_index=i,
                    settings=self.settings,
                    reader=event_reader(self.attempts.snapshot.render),
                    holdback=ChunkHoldback(self.kind, self.body), phases=self.phases, trace=self.trace,
                )
                for i, p in enumerate(self.tokenized.prompts)
            ]

    @property
    def prompts(self) -> list[Sequence[int]]:
        return [p.token_ids for p in self.tokenized.prompts]

    @property
    def relays_allowed(self) -> bool:
        """The RFC relays a single prompt (each of its choices has its own ledger and state);
        several prompts only restart before visible output."""
        return len(self.tokenized.prompts) == 1

    async def frames(self) -> AsyncIterator[bytes]:
        start = time.perf_counter()
        outcome = "ok"
        # Fan-out (several prompts) cannot relay; before the client saw any chunk the whole
        # request may start over instead (single prompts relay from zero committed ids).
        restarts = 0 if self.relays_allowed else self.settings.max_relays
        try:
            while True:
                source = self._prompt_chunks(0, frame) if self.relays_allowed else self._merged()
                try:
                    # aclosing: when the client leaves mid-stream (GeneratorExit here), the source must be
                    # closed now, so _merged cancels its producers before the engine streams are closed.
                    async with aclosing(source) as chunks:
                        async for chunk in chunks:
                            self._visible = True
                            yield chunk
                    break
                except EngineError as exc:
                    if self._visible or restarts <= 0:
                        raise
                    restarts -= 1
                    await self._restart(exc)
        except MotorError as exc:
            # After the first frame the status is already 200: an error frame, then [DONE].
            outcome = type(exc).__name__
            for s in self.sessions:
                s.end(ChoicePhase.FAILED)
            yield frame(error_body(self.attempts.guard.boundary.client_error(exc))[1])
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except GeneratorExit:
            outcome = "closed"
            raise
        finally:
            if outcome in ("cancelled", "closed"):
                for s in self.sessions:
                    s.end(ChoicePhase.CANCELLED)
            await self.aclose()
            logger.info(
                "response request_id=%s kind=%s stream=true result=%s relays=%d latency_ms=%.1f",
                self.public_id, self.kind, outcome, sum(s.relays for s in self.sessions), _ms(start),
            )
        yield DONE

    async def _restart(self, exc: EngineError) -> None:
        """Start the whole request over (nothing was visible yet): new attempts, fresh sessions."""
        old = self.streams
        for s in old:
            await s.aclose(self.attempts.guard.engines)
        self.sessions = []
        self.__post_init__()
        logger.warning(
            "stream_restart request_id=%s prompts=%d failed_instance=%s error=%s",
            self.public_id, len(old), exc.instance, type(exc).__name__,
        )

        def opener(stream: OpenStream) -> Callable[[LeaseGroup], Coroutine[Any, Any, OpenStream]]:
            return lambda leases: self.attempts.open(
                self.tokenized, stream.prompt_index, self.requires_tokenizer, first_attempt=stream.attempt + 1,
                exclude=self.attempts.policy.excluded_after_restart(exc), leases=leases,
            )

        # As when first opened: all prompts at once; a failure closes what had opened and the old
        # streams (already closed) stay with the stream, so aclose has nothing left to release.
        self.streams = await open_together([opener(s) for s in old], self.attempts.guard.engines)

    def _events(self, stream: OpenStream) -> GuardedEvents:
        """The attempt's events (a list per read) through the guard (``GuardedEvents``: the chunk
        timeout, the boundary, the breaker)."""
        return self.attempts.guard.stream_events(stream.events, stream.instance, self.settings.chunk_timeout_s)

    def streams_of(self, index: int) -> list[OpenStream]:
        return [s for s in self.streams if s.prompt_index == index]

    def _prompt_chunks(self, index: int, emit: Callable[[dict[str, Any]], _Item]) -> PromptChunks[_Item]:
        """Derendered chunks of prompt ``index`` across its attempts (relaying where allowed), each
        as ``emit`` makes it: ``frame`` for the client, or a ``PromptChunk`` for the fan-in
        (``_fanned``). What waits for a slow client (here, in the merge queue) is a frame, which
        weighs a fraction of the parsed chunk.
        """
        return PromptChunks(self, index, emit)

    async def attempt_failed(self, index: int, streams: list[OpenStream], snapshot: AttemptSnapshot,
                              failed: list[tuple[OpenStream, BaseException]], exc: EngineError,
                              ) -> tuple[list[OpenStream], EventBatches | None]:
        """After prompt ``index``'s attempt on ``streams`` failed with ``exc`` (its chunks and events
        closed): relay its open choices, or raise ``exc``. Returns the streams that carry on (none:
        the prompt ends) and, when choices' whole budget was already committed, the events that
        end them (and the stream, with its usage, if nothing carries on)."""
        session = self.sessions[index]
        if not session.visible:
            session.restore(snapshot)
        # The breaker heard it already (``GuardedEvents``); the relay avoids the culprit.
        culprit = next((s for s, e in failed if e is exc), failed[0][0] if failed else streams[0])
        for s in streams:
            await s.aclose(self.attempts.guard.engines)
        # Choices still open (an engine that failed before its usage event or [DONE] may have
        # finished them all: then nothing is missing but the usage chunk, ours anyway).
        open_choices = [
            j for j in range(self.n)
            if (c := session.choices.get(j)) is None or c.phase is not ChoicePhase.DONE
        ]
        if open_choices and (not self.relays_allowed or session.relays >= self.settings.max_relays):
            raise exc
        replacements, spent = (
            await self._relay(session, streams, culprit, exc, open_choices) if open_choices else ([], [])
        )
        if replacements:  # (the closed ones stay otherwise: _merged indexes streams by prompt)
            self.streams = [s for s in self.streams if s.prompt_index != index] + replacements
        if spent or not replacements:
            # Every output token of these choices was already committed: end them as the engine
            # would have (and the stream, with its usage, if nothing continues).
            return replacements, _budget_spent_events(self.body, streams[0].request_id, spent, usage=not replacements)
        return replacements, None

    def prompt_events(
        self, streams: list[OpenStream], failed: list[tuple[OpenStream, BaseException]]
    ) -> PromptEvents:
        """The engine events of one prompt: its one stream's, or, once the choices of an n > 1
        request continue in streams of their own, all of theirs merged under the client's
        choice indexes, with one usage-only event of ours when every one ended (each engine
        would send its own). A stream that fails is recorded in ``failed`` with its error.

        One stream's events are the guard's (``GuardedEvents``) as they are, with no generator
        around them: a stream whose client reads nothing keeps every layer suspended
        (``bench/slow_reader.py``). Its failure needs no record: it is the culprit either way."""
        if len(streams) == 1 and streams[0].choice is None:
            return self._events(streams[0])
        return self._choice_events(streams, failed)

    async def _choice_events(
        self, streams: list[OpenStream], failed: list[tuple[OpenStream, BaseException]]
    ) -> AsyncGenerator[list[dict[str, Any]], None]:
        """The events of one prompt's choices, each continued in a stream of its own (``prompt_events``)."""

        def lane(stream: OpenStream) -> Callable[[], AsyncGenerator[list[dict[str, Any]], None]]:
            async def events() -> AsyncGenerator[list[dict[str, Any]], None]:
                try:
                    async with aclosing(self._events(stream)) as batches:
                        async for batch in batches:
                            kept = [_as_choice(e, stream.choice) for e in batch if not _usage_only_event(e)]
                            if kept:
                                yield kept
                except EngineError as exc:
                    failed.append((stream, exc))
                    raise
                stream.finished = True
            return events

        async with aclosing(fan_in([lane(s) for s in streams])) as batches:
            async for batch in batches:
                yield batch
        if (self.body.get("stream_options") or {}).get("include_usage"):
            yield [_usage_event(GENERATE_PREFIX + streams[0].request_id)]

    def _fanned(self, index: int) -> Callable[[dict[str, Any]], PromptChunk]:
        """Prompt ``index``'s chunks as the fan-in takes them: global choice indices, framed
        unless it is the usage-only chunk (``_merged`` sums those)."""

        def item(chunk: dict[str, Any]) -> PromptChunk:
            for c in chunk.get("choices") or []:
                c["index"] = index * self.n + c.get("index", 0)
            return PromptChunk(usage=chunk) if _usage_only(chunk) else PromptChunk(frame(chunk))

        return item

    async def _merged(self) -> AsyncGenerator[bytes, None]:
        """Fan-in of per-prompt streams (framed chunks): global choice index, one merged usage chunk."""
        usage: dict[str, int] = {}
        usage_template: dict[str, Any] | None = None

        def source(index: int) -> Callable[[], PromptChunks[PromptChunk]]:
            return lambda: self._prompt_chunks(index, self._fanned(index))

        def on_stop(failed: list[int], exc: BaseException) -> None:
            cancelled = [i for i in range(len(self.streams)) if i not in failed and not self.streams[i].finished]
            logger.warning(
                "stream_cancel request_id=%s failed_prompts=%s cancelled_prompts=%s reason=%s",
                self.public_id, ",".join(map(str, failed)) or "-", ",".join(map(str, cancelled)) or "-",
                "substream_failed" if failed else type(exc).__name__,
            )

        sources = [source(i) for i in range(len(self.streams))]
        # handed_on: a prompt's session commits a chunk once the client took it, not when it was queued.
        async with aclosing(fan_in(sources, on_stop=on_stop, handed_on=True)) as chunks:
            async for item in chunks:
                if item.usage is not None:  # a prompt's usage-only chunk: summed into one
                    usage_template = item.usage
                    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                        usage[key] = usage.get(key, 0) + int(item.usage["usage"].get(key) or 0)
                    continue
                yield item.framed
        if usage_template is not None:
            yield frame({**usage_template, "usage": {**usage_template["usage"], **usage}})

    async def _relay(
        self, session: StreamingRenderSession, failed_streams: list[OpenStream], failed: OpenStream,
        exc: EngineError, open_choices: list[int],
    ) -> tuple[list[OpenStream], list[int]]:
        """Continue a single prompt on other instances from what the client has.

        With n == 1, or before anything was visible, one engine request carries on (all n
        choices, from zero committed ids in the latter case). Otherwise each of ``open_choices``
        continues alone (n 1) from its own committed ids with its own remaining budget; they open
        together, all or none. Returns the new streams, and the open choices whose whole budget
        was already committed (nothing to generate: the caller ends them).
        """
        prompt = self.tokenized.prompts[failed.prompt_index]
        attempt = max(s.attempt for s in failed_streams) + 1
        session.relays += 1
        if self.n == 1 or not session.visible:
            choices: list[int | None] = [None]
        else:
            choices = list(open_choices)
        plans: list[RetryRequestPlan] = []
        spent: list[int] = []
        for choice in choices:
            committed = session.committed_ids if choice is None else session.committed_ids_of(choice)
            plan = RetryRequestPlan.build(prompt.generate_request, prompt.token_ids, committed,
                                          attempt=attempt, choice=choice)
            if plan.remaining_tokens < 1:
                spent.append(0 if choice is None else choice)
                logger.warning(
                    "relay request_id=%s prompt=%d choice=%s committed_tokens=%d remaining_tokens=0 old_instance=%s "
                    "new_instance=- error=%s", self.public_id, failed.prompt_index, "-" if choice is None else choice,
                    len(plan.committed_ids), failed.instance.name, type(exc).__name__,
                )
            else:
                plans.append(plan)
        if not plans:
            return [], spent
        exclude = self.attempts.policy.excluded_after_stream_failure(failed.instance)

        def opener(plan: RetryRequestPlan) -> Callable[[LeaseGroup], Coroutine[Any, Any, OpenStream]]:
            return lambda leases: self.attempts.open(
                self.tokenized, failed.prompt_index, self.requires_tokenizer, plan=plan, exclude=exclude, leases=leases,
            )

        replacements = await open_together([opener(p) for p in plans], self.attempts.guard.engines)
        # Labels from fixed sets only: the failed stream's topology, and whether it stalled.
        reason = "stall" if isinstance(exc.__cause__, TimeoutError) else "failure"
        self.attempts.counters.inc(metric_names.STREAM_RELAYS, model=self.tokenized.model, topology=failed.topology,
                                  reason=reason)
        for plan, replacement in zip(plans, replacements, strict=True):
            replacement.choice = plan.choice
            logger.warning(
                "relay request_id=%s prompt=%d choice=%s committed_tokens=%d remaining_tokens=%d old_instance=%s "
                "new_instance=%s old_engine_request_id=%s new_engine_request_id=%s relay=%d error=%s",
                self.public_id, failed.prompt_index, "-" if plan.choice is None else plan.choice,
                len(plan.committed_ids), plan.remaining_tokens, failed.instance.name, replacement.instance.name,
                failed.request_id, replacement.request_id, session.relays, type(exc).__name__,
            )
        return replacements, spent

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for s in self.streams:
            try:
                await s.aclose(self.attempts.guard.engines)
            except BaseException as exc:  # close the others first, then raise
                errors.append(exc)
        if errors:
            raise errors[0]


def _usage_only(chunk: dict[str, Any]) -> bool:
    return not chunk.get("choices") and bool(chunk.get("usage"))


def _usage_only_event(event: dict[str, Any]) -> bool:
    return "error" not in event and not event.get("choices") and event.get("usage") is not None


def _as_choice(event: dict[str, Any], choice: int | None) -> dict[str, Any]:
    """An event of a relayed choice's own stream (its engine calls it 0) under the client's index."""
    if choice is not None:
        for c in event.get("choices") or []:
            c["index"] = choice
    return event


def _usage_event(rid: str) -> dict[str, Any]:
    """A usage-only event for derender; the session puts its own numbers in (``_account``)."""
    return {"request_id": rid, "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            "output_mode": "tokens", "choices": []}


async def _budget_spent_events(
    body: dict[str, Any], engine_request_id: str, choices: list[int], *, usage: bool
) -> AsyncGenerator[list[dict[str, Any]], None]:
    """The end of choices whose whole output budget was committed before their engine failed: a
    finish chunk for each, then (``usage``: nothing else continues) the usage chunk if asked for."""
    rid = GENERATE_PREFIX + engine_request_id
    for index in choices:
        yield [{"request_id": rid, "usage": None, "output_mode": "tokens",
                "choices": [{"index": index, "finish_reason": "length", "stop_reason": None, "token_ids": [],
                             "logprobs": None}]}]
    if usage and (body.get("stream_options") or {}).get("include_usage"):
        yield [_usage_event(rid)]

