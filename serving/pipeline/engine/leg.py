"""The guarded leg: every engine call, in every topology and both modes, goes through here.

``EngineGuard`` holds what each call needs around it: the instance's circuit breaker, token
admission, the load hold, the obfuscation boundary and response validation. The breaker hears
only the engine's own faults: a busy engine, a missing capability, a 4xx about the request,
admission refusals and cancellation leave it as it was (``_outcome``). A stream's verdict
is given here too: success once established, failure when a read fails (``GuardedEvents``).

``GenerateContext`` binds the guard to one attempt of one prompt, in the attempt's mode, for the
topology openers; ``open_leg`` is the attempt's last leg (union, or P/D's decode) in that mode.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from serving.pipeline import metric_names, metrics
from serving.pipeline.derender.coalesce import coalesces
from serving.pipeline.engine.client import EngineClient
from serving.pipeline.engine.native import NativeClient, NativeStream
from serving.pipeline.engine.requests import validate_generate_response
from serving.pipeline.errors import EngineBusy, EngineError, EngineLacksCapability
from serving.pipeline.exit_stack import ExitStack
from serving.pipeline.flow_control.admission import LeaseGroup, admission_turn
from serving.pipeline.obfuscation.boundary import EngineBoundary
from serving.pipeline.phases import NO_PHASES, Phases
from serving.pipeline.placement.scheduler import Scheduler
from serving.pipeline.protocol import ApiKind, EventBatches
from serving.pipeline.render.tokenization import TokenizedPrompt
from serving.pipeline.snapshot import FleetSnapshot, InstanceView
from serving.pipeline.step_bound import StepBound
from serving.pipeline.tracing import NO_TRACE

logger = logging.getLogger(__name__)


class BreakerOpen(EngineBusy):
    """The instance's breaker holds it off (open, or its half-open probe slot is taken)."""


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


@dataclass
class Reservation:
    """One instance's breaker slot, admission lease and load hold, taken before its call.

    The call ``take``s the holds over (and reports to the breaker); ``aclose`` gives back a
    reservation that was never used (the call before it failed), leaving the breaker as it was.
    """

    instance: InstanceView
    holds: AsyncExitStack
    release_breaker: Callable[[], None]
    _taken: bool = field(default=False, init=False)

    def take(self) -> AsyncExitStack:
        if self._taken:
            raise RuntimeError(f"the reservation on {self.instance.name} was used already")
        self._taken = True
        return self.holds

    async def aclose(self) -> None:
        if self._taken:
            return
        self._taken = True
        try:
            await self.holds.aclose()
        finally:
            self.release_breaker()


class EngineGuard:
    """Breaker, admission, load, boundary and validation around every engine call."""

    def __init__(self, scheduler: Scheduler, engines: EngineClient, boundary: EngineBoundary, native: NativeClient) -> None:
        self.scheduler = scheduler
        self.engines = engines
        self.boundary = boundary
        self.native_client = native

    async def _admit(self, instance: InstanceView) -> None:
        """Take a call slot in ``instance``'s breaker; raise ``BreakerOpen`` when it holds it off."""
        if not await self.scheduler.breakers.claim(instance):
            raise BreakerOpen(f"{instance.name} is held off by its circuit breaker", instance=instance.name)

    @asynccontextmanager
    async def _outcome(self, instance: InstanceView, *, record_failure: bool = True) -> AsyncIterator[None]:
        """Tell ``instance``'s breaker how the call in the block (whose slot was taken) ended."""
        breakers = self.scheduler.breakers
        try:
            yield
        except (EngineBusy, EngineLacksCapability):
            breakers.release(instance)
            raise
        except EngineError as exc:
            breakers.failure(instance, exc.message[:200])
            if record_failure:
                metrics.record_request(instance.name, None, None, ok=False)
            raise
        except BaseException:
            breakers.release(instance)
            raise
        breakers.success(instance)

    def stream_events(self, events: EventBatches, instance: InstanceView, timeout: float) -> GuardedEvents:
        """An established stream's events (``open_stream``'s) read through the guard (``GuardedEvents``)."""
        return GuardedEvents(self, events, instance, timeout)

    def _failed_mid_stream(self, instance: InstanceView, exc: EngineError) -> None:
        """An established stream failed mid-way: the engine's fault, its breaker hears it."""
        self.scheduler.breakers.failure(instance, exc.message[:200])
        metrics.record_request(instance.name, None, None, ok=False)

    async def _hold(
        self, instance: InstanceView, tokens: int, stack: AsyncExitStack, phases: Phases = NO_PHASES,
        group: LeaseGroup | None = None,
    ) -> None:
        """Admission lease and load hold on ``stack``, released when the stack closes; ``group``:
        the leases of the response's streams opened together (``attempts.open_together``)."""
        start = phases.now()
        async with admission_turn(group):  # a response's streams take their leases one at a time
            lease = await self.scheduler.admission.acquire(instance, tokens, group)
        phases.observe(metric_names.PHASE_QUEUE_WAIT, start)  # here, so in-process and Redis admission alike
        stack.callback(lease.release)
        stack.enter_context(self.scheduler.load.hold(instance))

    async def reserve(
        self, instance: InstanceView, tokens: int, phases: Phases = NO_PHASES, group: LeaseGroup | None = None
    ) -> Reservation:
        """Take ``instance``'s breaker slot, admission lease and load hold now, for a call later.

        P/D reserves the decode side before the prefill runs: a decode engine that is held off or
        full then refuses the attempt before any KV was prefilled (and pinned) for it. Raises what
        the breaker or admission raise, holding nothing.
        """
        await self._admit(instance)
        holds: AsyncExitStack = ExitStack()
        try:
            await self._hold(instance, tokens, holds, phases, group)
        except BaseException:
            try:
                await holds.aclose()
            finally:
                self.scheduler.breakers.release(instance)
            raise
        return Reservation(instance, holds, lambda: self.scheduler.breakers.release(instance))

    async def _holds(
        self, instance: InstanceView, tokens: int, reserved: Reservation | None, stack: AsyncExitStack,
        phases: Phases, group: LeaseGroup | None = None,
    ) -> None:
        """The call's holds on ``stack``: the reservation's (its breaker slot was taken) or new ones."""
        if reserved is None:
            await self._hold(instance, tokens, stack, phases, group)
        else:
            stack.push_async_callback(reserved.take().aclose)

    async def generate(
        self, instance: InstanceView, request: dict[str, Any], *, tokens: int, reserved: Reservation | None = None,
        phases: Phases = NO_PHASES, group: LeaseGroup | None = None, trace: Mapping[str, str] = NO_TRACE,
    ) -> dict[str, Any]:
        """One non-streaming generate; returns the validated, semantic GenerateResponse."""
        start = time.perf_counter()
        if reserved is None:
            await self._admit(instance)
        async with self._outcome(instance):
            async with AsyncExitStack() as holds:
                await self._holds(instance, tokens, reserved, holds, phases, group)
                sent = phases.now()
                raw = await self.engines.generate(instance, self.boundary.outbound(request, instance), trace=trace)
                phases.observe(metric_names.PHASE_FIRST_CHUNK, sent)  # the whole answer is its first chunk
            response = self.boundary.inbound(raw, instance)
            problem = validate_generate_response(response, n=int(request.get("sampling_params", {}).get("n") or 1))
            if problem is not None:
                raise EngineError(f"{instance.name} answered an unusable GenerateResponse: {problem}", instance=instance.name)
        metrics.record_request(instance.name, time.perf_counter() - start, None, ok=True)  # TTFT = whole answer
        return response

    async def open_stream(
        self, instance: InstanceView, request: dict[str, Any], *, tokens: int, stack: AsyncExitStack,
        reserved: Reservation | None = None, phases: Phases = NO_PHASES, whole_reads: bool = False,
        group: LeaseGroup | None = None, trace: Mapping[str, str] = NO_TRACE,
    ) -> EventBatches:
        """Open one streaming generate (established: HTTP 200); its holds and stream go on ``stack``.

        The events are raw (physical when obfuscated): ``inbound_event`` turns each semantic.
        """
        if reserved is None:
            await self._admit(instance)
        async with self._outcome(instance):
            await self._holds(instance, tokens, reserved, stack, phases, group)
            sent = phases.now()
            events = await stack.enter_async_context(
                self.engines.generate_stream(
                    instance, self.boundary.outbound(request, instance), whole_reads=whole_reads, trace=trace
                )
            )
        return metrics.TimedEvents(
            instance.name, events, on_first=lambda: phases.observe(metric_names.PHASE_FIRST_CHUNK, sent)
        )

    def inbound_event(self, event: dict[str, Any], instance: InstanceView) -> dict[str, Any]:
        return self.boundary.inbound_event(event, instance)

    async def native(
        self, instance: InstanceView, kind: ApiKind, body: dict[str, Any], request_id: str, *, tokens: int,
        stack: AsyncExitStack, max_output: int | None = None, reserved: Reservation | None = None,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> dict[str, Any] | NativeStream:
        """One call to an engine's own OpenAI API; a stream takes ``stack`` (its holds) over.

        ``tokens``: what admission holds; ``max_output``: the output bound per choice (the reply's
        deadline); ``reserved``: the instance's holds taken ahead (a native P/D run's decode side).
        """
        if reserved is None:
            await self._admit(instance)
        async with self._outcome(instance, record_failure=False):
            await self._holds(instance, tokens, reserved, stack, NO_PHASES)
            return await self.native_client.call(
                instance, kind, body, request_id, stack, max_output=max_output, trace=trace
            )

    async def abort(self, instance: InstanceView, request_ids: list[str]) -> None:
        await self.engines.abort(instance, request_ids)


class GuardedEvents:
    """An established stream's events through the guard: each read within ``timeout`` (the chunk
    timeout), each event made semantic by the boundary.

    The breaker's verdict on a stream is the guard's alone: success once it is established
    (``_outcome``), failure here when a read fails (an ``EngineError``: the engine's fault, a
    stall included). Not a generator: a stream whose client reads nothing keeps no frame of it
    suspended (``bench/slow_reader.py``).
    """

    __slots__ = ("_events", "_guard", "_instance", "_timeout", "_bound")

    def __init__(self, guard: EngineGuard, events: EventBatches, instance: InstanceView, timeout: float) -> None:
        self._guard = guard
        self._events = events
        self._instance = instance
        self._timeout = timeout
        # Each read's stall bound, on one timer for the stream (``StepBound``), not one per read.
        self._bound = StepBound(timeout)

    def __aiter__(self) -> GuardedEvents:
        return self

    async def __anext__(self) -> list[dict[str, Any]]:
        instance = self._instance
        try:
            try:
                async with self._bound:
                    raw = await anext(self._events)
            except TimeoutError as exc:
                raise EngineError(
                    f"{instance.name} sent nothing for {self._timeout:g}s mid-stream", instance=instance.name
                ) from exc
        except EngineError as exc:
            self._guard._failed_mid_stream(instance, exc)
            raise
        # In place: the reader empties the list it takes, and nothing here holds an event then.
        inbound = self._guard.boundary.inbound_event
        raw[:] = [inbound(event, instance) for event in raw]
        return raw

    async def aclose(self) -> None:
        """The stall bound's timer; the stream is its attempt's to close (``OpenStream.aclose``)."""
        self._bound.close()


@dataclass
class Opened:
    """What a topology's opener returns: the instance of the attempt's last leg, that leg's engine
    request id (what an abort names) and its output in the attempt's mode: the established
    ``events`` when streaming, the whole GenerateResponse (``response``) when not.

    Non-streaming keeps the engine's JSON answer rather than collecting stream events: only the
    JSON carries ``prompt_logprobs``, ``usage.prompt_tokens_details``, ``metrics`` and
    ``kv_transfer_params`` (vllm-protocol.md sections 3.4 and 3.5), and it is one parse, not one
    per token. Everything else the opener held is released before it returns.
    """

    instance: InstanceView
    request_id: str
    events: EventBatches | None = None
    response: dict[str, Any] | None = None


@dataclass
class GenerateContext:
    """What one attempt of one prompt carries through a topology opener.

    Openers (``topologies/``) only sequence legs; ``leg``, ``stream_leg`` and ``open_leg`` do
    the per-engine work every topology shares, through the guard.
    """

    guard: EngineGuard
    snapshot: FleetSnapshot
    request_id: str  # the client-facing request id (logs)
    prompt: TokenizedPrompt
    prompt_index: int
    attempt: int
    tokens: int  # prompt + resolved max output: what admission holds on the decoding instance
    stream: bool = False  # the attempt's mode: whether its last leg streams
    phases: Phases = NO_PHASES  # the attempt's recorder (its topology); each leg adds its own label
    leases: LeaseGroup | None = None  # the response's streams opened together (``open_together``)
    # The request's trace headers, on every leg (``RequestContext.trace``).
    trace: Mapping[str, str] = field(default_factory=lambda: NO_TRACE)

    @property
    def scheduler(self) -> Scheduler:
        return self.guard.scheduler

    @property
    def engines(self) -> EngineClient:
        return self.guard.engines

    async def leg(
        self, instance: InstanceView, request: dict[str, Any], *, phase: str, tokens: int | None = None,
        reserved: Reservation | None = None,
    ) -> dict[str, Any]:
        """One non-streaming generate on ``instance`` through the guard, logged once."""
        start = time.perf_counter()
        result = "ok"
        try:
            return await self.guard.generate(
                instance, request, tokens=self.tokens if tokens is None else tokens, reserved=reserved,
                phases=self.phases.on(leg=phase), group=self.leases, trace=self.trace,
            )
        except BaseException as exc:
            result = type(exc).__name__
            raise
        finally:
            log = logger.info if result == "ok" else logger.warning
            log(
                "generate request_id=%s prompt=%d instance=%s phase=%s attempt=%d engine_request_id=%s result=%s "
                "latency_ms=%.1f",
                self.request_id, self.prompt_index, instance.name, phase, self.attempt, request.get("request_id"),
                result, _ms(start),
            )

    async def stream_leg(
        self, instance: InstanceView, request: dict[str, Any], *, phase: str, tokens: int, stack: AsyncExitStack,
        reserved: Reservation | None = None,
    ) -> EventBatches:
        """Open one streaming generate on ``instance`` through the guard; return its events."""
        events = await self.guard.open_stream(
            instance, request, tokens=tokens, stack=stack, reserved=reserved, phases=self.phases.on(leg=phase),
            whole_reads=coalesces(self.snapshot.render),  # what its reader will merge (coalesce.py)
            group=self.leases, trace=self.trace,
        )
        logger.info(
            "generate request_id=%s prompt=%d instance=%s phase=%s attempt=%d engine_request_id=%s result=established "
            "stream=true",
            self.request_id, self.prompt_index, instance.name, phase, self.attempt, request.get("request_id"),
        )
        return events

    async def open_leg(
        self, instance: InstanceView, request: dict[str, Any], *, phase: str, stack: AsyncExitStack,
        tokens: int | None = None,
    ) -> Opened:
        """The attempt's last leg in its mode: a stream whose holds go on ``stack``, or one answer."""
        tokens = self.tokens if tokens is None else tokens
        if self.stream:
            events = await self.stream_leg(instance, request, phase=phase, tokens=tokens, stack=stack)
            return Opened(instance, request["request_id"], events=events)
        response = await self.leg(instance, request, phase=phase, tokens=tokens)
        return Opened(instance, request["request_id"], response=response)
