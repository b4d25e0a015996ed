"""The SSE body of a streaming response: derender per chunk, relay, restart and fan-in.

``EventStream`` owns the request's established engine streams (``OpenStream``, opened by
``Attempts.open`` before the client saw a byte) until it is closed. One
``StreamingRenderSession`` per prompt derenders with committed state across attempts; a single
prompt with ``n == 1`` relays to another instance after a mid-stream engine failure (the plan in
``relay.py``), everything else ends with an error frame once a chunk was visible; before any
chunk was visible the whole request may start over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from serving.pipeline import metric_names
from serving.pipeline.derender.coalesce import event_reader
from serving.pipeline.derender.holdback import ChunkHoldback, derender_request
from serving.pipeline.derender.session import ChoicePhase, StreamingRenderSession, StreamSettings
from serving.pipeline.engine.requests import GENERATE_PREFIX
from serving.pipeline.errors import EngineError, MotorError, error_body
from serving.pipeline.flow_control.admission import reserve_together
from serving.pipeline.phases import NO_PHASES, Phases
from serving.pipeline.protocol import TokenKind
from serving.pipeline.render.client import RenderClient
from serving.pipeline.render.tokenization import TokenizedRequest
from serving.pipeline.resilience.attempts import Attempts, OpenStream
from serving.pipeline.sse import DONE, frame
from serving.pipeline.streaming.fanout import fan_in
from serving.pipeline.streaming.relay import RetryRequestPlan

logger = logging.getLogger(__name__)


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


@dataclass
class EventStream:
    """The SSE body of a streaming response; owns the engine streams until it is closed.

    One ``StreamingRenderSession`` per prompt derenders with committed state across attempts; a
    single prompt with ``n == 1`` relays to another instance after a mid-stream engine failure
    (``_prompt_chunks``), everything else ends with an error frame once a chunk was visible.
    """

    attempts: Attempts
    render: RenderClient
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
    sessions: list[StreamingRenderSession] = field(default_factory=list)
    # Counts the stream on its sidecar (``LiveStreams``) until ``aclose``: set by ``_serve``.
    release_render: Callable[[], None] | None = None
    _started: bool = field(default=False, init=False)
    _closed: bool = field(default=False, init=False)
    _visible: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if not self.sessions:
            self.sessions = [
                StreamingRenderSession(
                    # Coalescing and stop strings (derender/coalesce.py, derender/holdback.py): derender
                    # gets the body without ``stop`` (it refuses it); the engine stops and the
                    # hold-back filter cuts, as vLLM's detokenizer does.
                    self.render, self.kind, derender_request(self.body), p.token_ids,
                    request_id=self.request_id, public_id=self.public_id, prompt_index=i,
                    settings=self.settings,
                    reader=event_reader(self.attempts.snapshot.render),
                    chunk_filter=ChunkHoldback(self.kind, self.body).apply, phases=self.phases,
                )
                for i, p in enumerate(self.tokenized.prompts)
            ]

    @property
    def prompts(self) -> list[list[int]]:
        return [p.token_ids for p in self.tokenized.prompts]

    @property
    def relays_allowed(self) -> bool:
        """The RFC relays one logical stream only: a single prompt with a single choice."""
        return len(self.streams) == 1 and self.n == 1

    @property
    def started(self) -> bool:
        """Whether ``frames()`` ran; from then on its ``finally`` closes the engine streams."""
        return self._started

    async def frames(self) -> AsyncIterator[bytes]:
        self._started = True
        start = time.perf_counter()
        outcome = "ok"
        # Fan-out (several prompts, or n > 1) cannot relay; before the client saw any chunk the
        # whole request may start over instead (single prompts relay from zero committed ids).
        restarts = 0 if self.relays_allowed else self.settings.max_relays
        try:
            while True:
                source = self._prompt_chunks(0) if len(self.streams) == 1 else self._merged()
                try:
                    # aclosing: when the client leaves mid-stream (GeneratorExit here), the source must be
                    # closed now, so _merged cancels its producers before the engine streams are closed.
                    async with aclosing(source) as chunks:
                        async for chunk in chunks:
                            self._visible = True
                            yield chunk if isinstance(chunk, bytes) else frame(chunk)
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
        streams: list[OpenStream] = []
        try:
            with reserve_together():  # as when first opened: all prompts at once, never waiting on itself
                for s in old:
                    streams.append(await self.attempts.open(
                        self.tokenized, s.prompt_index, self.requires_tokenizer, first_attempt=s.attempt + 1,
                        exclude=self.attempts.policy.excluded_after_restart(exc),
                    ))
        finally:
            # Whatever opened is owned by the stream now, so aclose releases it on any exit.
            self.streams = streams + old[len(streams):]

    async def _events(self, stream: OpenStream) -> AsyncGenerator[list[dict[str, Any]], None]:
        """The attempt's events (a list per read) through the engine boundary, each read within
        the chunk timeout."""
        timeout = self.settings.chunk_timeout_s
        events = stream.events
        inbound, instance = self.attempts.guard.inbound_event, stream.instance
        while True:
            try:
                async with asyncio.timeout(timeout):
                    raw = await anext(events)
            except StopAsyncIteration:
                return
            except TimeoutError as exc:
                raise EngineError(
                    f"{stream.instance.name} sent nothing for {timeout:g}s mid-stream", instance=stream.instance.name
                ) from exc
            # In place: the reader empties the list it takes, and nothing here holds an event then.
            raw[:] = [inbound(event, instance) for event in raw]
            yield raw

    async def _prompt_chunks(
        self, index: int, *, fanned: bool = False
    ) -> AsyncGenerator[dict[str, Any] | bytes, None]:
        """Derendered chunks of prompt ``index`` across its attempts (relaying where allowed).

        ``fanned``: a source of the fan-in (``_merged``): choice indices made global, and every
        chunk but the usage-only one framed already, because the merge queue holds what it is
        given while a slow client waits, and a frame weighs a fraction of the parsed chunk.
        """
        session = self.sessions[index]
        while True:
            stream = self.streams[index]
            snapshot = session.begin_attempt(stream.attempt, stream.instance.name)
            try:
                async with aclosing(session.chunks(self._events(stream))) as chunks:
                    async for chunk in chunks:
                        yield self._fanned(chunk, index) if fanned else chunk
            except EngineError as exc:
                if not session.visible:
                    session.restore(snapshot)
                # A mid-stream engine failure is the engine's: its breaker hears it.
                self.attempts.guard.stream_failed(stream.instance, exc)
                await stream.aclose(self.attempts.guard.engines)
                # Every choice already finished (the engine failed before its usage event or
                # [DONE]): nothing is missing but the usage chunk, which is ours anyway.
                done = len(session.choices) == self.n and all(
                    c.phase is ChoicePhase.DONE for c in session.choices.values()
                )
                if not done and (
                    not self.relays_allowed or session.relays >= self.settings.max_relays
                ):
                    raise
                replacement = None if done else await self._relay(session, stream, exc)
                if replacement is None:
                    # Every output token was already committed: end as the engine would have.
                    tail_events = _budget_spent_events(self.body, stream.request_id, finish=not done)
                    async with aclosing(session.chunks(tail_events)) as tail:
                        async for chunk in tail:
                            yield self._fanned(chunk, index) if fanned else chunk
                    return
                self.streams[index] = replacement
                continue
            stream.finished = True
            return

    def _fanned(self, chunk: dict[str, Any], index: int) -> dict[str, Any] | bytes:
        """Prompt ``index``'s chunk as the fan-in takes it: global choice indices, and framed
        unless it is the usage-only chunk (``_merged`` sums those)."""
        for c in chunk.get("choices") or []:
            c["index"] = index * self.n + c.get("index", 0)
        return chunk if _usage_only(chunk) else frame(chunk)

    async def _merged(self) -> AsyncGenerator[dict[str, Any] | bytes, None]:
        """Fan-in of per-prompt streams (framed chunks): global choice index, one merged usage chunk."""
        usage: dict[str, int] = {}
        usage_template: dict[str, Any] | None = None

        def source(index: int) -> Callable[[], AsyncGenerator[dict[str, Any] | bytes, None]]:
            return lambda: self._prompt_chunks(index, fanned=True)

        def on_stop(failed: list[int], exc: BaseException) -> None:
            cancelled = [i for i in range(len(self.streams)) if i not in failed and not self.streams[i].finished]
            logger.warning(
                "stream_cancel request_id=%s failed_prompts=%s cancelled_prompts=%s reason=%s",
                self.public_id, ",".join(map(str, failed)) or "-", ",".join(map(str, cancelled)) or "-",
                "substream_failed" if failed else type(exc).__name__,
            )

        sources = [source(i) for i in range(len(self.streams))]
        async with aclosing(fan_in(sources, on_stop=on_stop)) as chunks:
            async for chunk in chunks:
                if isinstance(chunk, dict):  # the usage-only chunk: the one left parsed
                    usage_template = chunk
                    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                        usage[key] = usage.get(key, 0) + int(chunk["usage"].get(key) or 0)
                    continue
                yield chunk
        if usage_template is not None:
            yield {**usage_template, "usage": {**usage_template["usage"], **usage}}

    async def _relay(
        self, session: StreamingRenderSession, failed: OpenStream, exc: EngineError
    ) -> OpenStream | None:
        """Continue a single-prompt stream on another instance from its committed output ids.

        Returns None when the whole output budget was already committed (nothing to generate).
        """
        prompt = self.tokenized.prompts[failed.prompt_index]
        plan = RetryRequestPlan.build(prompt.generate_request, prompt.token_ids, session.committed_ids,
                                      attempt=failed.attempt + 1)
        session.relays += 1
        if plan.remaining_tokens < 1:
            logger.warning(
                "relay request_id=%s prompt=%d committed_tokens=%d remaining_tokens=0 old_instance=%s "
                "new_instance=- error=%s", self.public_id, failed.prompt_index, len(plan.committed_ids),
                failed.instance.name, type(exc).__name__,
            )
            return None
        replacement = await self.attempts.open(
            self.tokenized, failed.prompt_index, self.requires_tokenizer, plan=plan,
            exclude=self.attempts.policy.excluded_after_stream_failure(failed.instance),
        )
        # Labels from fixed sets only: the failed stream's topology, and whether it stalled.
        reason = "stall" if isinstance(exc.__cause__, TimeoutError) else "failure"
        self.attempts.counters.inc(metric_names.STREAM_RELAYS, topology=failed.topology, reason=reason)
        logger.warning(
            "relay request_id=%s prompt=%d committed_tokens=%d remaining_tokens=%d old_instance=%s new_instance=%s "
            "old_engine_request_id=%s new_engine_request_id=%s relay=%d error=%s",
            self.public_id, failed.prompt_index, len(plan.committed_ids), plan.remaining_tokens,
            failed.instance.name, replacement.instance.name, failed.request_id, replacement.request_id,
            session.relays, type(exc).__name__,
        )
        return replacement

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        try:
            for s in self.streams:
                try:
                    await s.aclose(self.attempts.guard.engines)
                except BaseException as exc:  # close the others first, then raise
                    errors.append(exc)
        finally:
            if self.release_render is not None:
                self.release_render()  # no derender call follows: the old sidecar may go
        if errors:
            raise errors[0]


def _usage_only(chunk: dict[str, Any]) -> bool:
    return not chunk.get("choices") and bool(chunk.get("usage"))


async def _budget_spent_events(
    body: dict[str, Any], engine_request_id: str, *, finish: bool
) -> AsyncGenerator[list[dict[str, Any]], None]:
    """The end of a stream whose whole output budget (or finish) was committed before its engine
    failed: the finish chunk if it is missing, the usage chunk if asked for (numbers are ours)."""
    rid = GENERATE_PREFIX + engine_request_id
    if finish:
        yield [{"request_id": rid, "usage": None, "output_mode": "tokens",
                "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [],
                             "logprobs": None}]}]
    if (body.get("stream_options") or {}).get("include_usage"):
        yield [{"request_id": rid, "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                "output_mode": "tokens", "choices": []}]
