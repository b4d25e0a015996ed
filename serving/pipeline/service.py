"""Render -> place -> generate -> derender for one OpenAI request, streaming or not.

``ServingPipeline`` is built per request from the fleet snapshot and the process-wide objects
(clients, scheduler with its breakers and token admission, counters); it holds no state of its
own between requests. The phases, each logged once per outcome with the request id:

1. routing: ``native_reason`` sends what token-only cannot serve exactly to an engine's own
   OpenAI API (``router/native.py``), or refuses it with obfuscation on;
2. tokenization (``render/tokenization.py``): render, or the local tokenizer when render is
   unusable; the local fallback hands requests it cannot build exactly to the native path;
3. poison check: ids outside the vocabulary or a prompt without room in the context are 400
   before any engine sees them;
4. placement (``Scheduler.place``) and, per topology, a runner (``TOPOLOGY_RUNNERS``); every
   engine call goes through ``GenerateContext.leg``: breaker, token admission, load, the
   obfuscation boundary, validation; a bounded retry budget moves failed attempts elsewhere;
5. derender: render's, or the local tokenizer's for locally tokenized requests.

Streaming responses are returned as an ``EventStream`` (or a relayed ``NativeStream``) whose
engine streams are already established (HTTP 200 from every engine), so a failure before that
still gets a proper status instead of a broken 200.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Collection
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass, field, replace
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable

from serving.pipeline import metrics
from serving.pipeline.errors import (
    EngineBusy,
    EngineError,
    EngineLacksCapability,
    ModelNotFound,
    MotorError,
    NoCapacity,
    RenderUnavailable,
    RequestError,
    error_body,
)
from serving.pipeline.render.client import RenderClient
from serving.pipeline.render.coalesce import event_reader
from serving.pipeline.render.holdback import ChunkHoldback, derender_request
from serving.pipeline.render.live import LiveStreams
from serving.pipeline.render.local_tokenizer import model_vocab_size
from serving.pipeline.render.streaming import ChoicePhase, StreamingRenderSession, StreamSettings
from serving.pipeline.render.tokenization import (
    LocalDerenderer,
    NeedsNative,
    RenderHealth,
    TokenizationService,
    TokenizedPrompt,
    TokenizedRequest,
)
from serving.pipeline.router import rate_limit
from serving.pipeline.router.engine_client import EngineClient
from serving.pipeline.router.native import (
    NATIVE_HINTS,
    NativeClient,
    NativeStream,
    engine_tokenizer_feature,
    native_instances,
    native_reason,
)
from serving.pipeline.router.rescheduler import RetryRequestPlan
from serving.pipeline.router.scheduler import Placement, Scheduler
from serving.pipeline.router.token_only import (
    attempt_request_id,
    resolved_max_tokens,
    sorted_choices,
    validate_generate_response,
    with_max_tokens,
)
from serving.pipeline.snapshot import FleetSnapshot, InstanceView, ModelView
from serving.pipeline.sse import DONE, frame

logger = logging.getLogger(__name__)

GENERATE_PREFIX = "generate-tokens-"
# Bounded queue between per-prompt producers and the client: a slow reader makes producers wait.
MERGE_QUEUE_SIZE = 64


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


@dataclass
class OpenStream:
    """One established engine stream (one attempt of one prompt): its engine, id and holds.

    ``stack`` holds the attempt's admission lease, load hold and HTTP stream, so a failed attempt
    releases them at once while the request relays on to a new one.
    """

    prompt_index: int
    instance: InstanceView
    request_id: str
    events: AsyncIterator[dict[str, Any]]
    stack: AsyncExitStack = field(default_factory=AsyncExitStack)
    attempt: int = 0
    finished: bool = False
    _closed: bool = field(default=False, init=False)

    async def aclose(self, engines: EngineClient) -> None:
        """Close the stream and free its holds; abort the engine request unless it finished."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.stack.aclose()
        finally:
            if not self.finished:
                # The client left or the attempt failed: free the engine's slot now.
                await engines.abort(self.instance, [self.request_id])


@dataclass
class EventStream:
    """The SSE body of a streaming response; owns the engine streams until it is closed.

    One ``StreamingRenderSession`` per prompt derenders with committed state across attempts; a
    single prompt with ``n == 1`` relays to another instance after a mid-stream engine failure
    (``_prompt_chunks``), everything else ends with an error frame once a chunk was visible.
    """

    pipeline: ServingPipeline
    kind: str  # "chat" | "completions"
    public_id: str
    body: dict[str, Any]
    tokenized: TokenizedRequest
    streams: list[OpenStream]
    request_id: str = ""
    requires_tokenizer: bool = False
    n: int = 1
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
                    # Coalescing and stop strings (render/coalesce.py, render/holdback.py): derender
                    # gets the body without ``stop`` (it refuses it); the engine stops and the
                    # hold-back filter cuts, as vLLM's detokenizer does.
                    self.pipeline.render, self.kind, derender_request(self.body), p.token_ids,
                    request_id=self.request_id, public_id=self.public_id, prompt_index=i,
                    settings=self.pipeline.stream_settings,
                    reader=event_reader(self.pipeline.snapshot.render.derender_coalesce),
                    chunk_filter=ChunkHoldback(self.kind, self.body).apply,
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
        restarts = 0 if self.relays_allowed else self.pipeline.stream_settings.max_relays
        try:
            while True:
                source = self._prompt_chunks(0) if len(self.streams) == 1 else self._merged()
                try:
                    # aclosing: when the client leaves mid-stream (GeneratorExit here), the source must be
                    # closed now, so _merged cancels its producers before the engine streams are closed.
                    async with aclosing(source) as chunks:
                        async for chunk in chunks:
                            self._visible = True
                            yield frame(chunk)
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
            yield frame(error_body(exc)[1])
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
            await s.aclose(self.pipeline.engines)
        self.sessions = []
        self.__post_init__()
        logger.warning(
            "stream_restart request_id=%s prompts=%d failed_instance=%s error=%s",
            self.public_id, len(old), exc.instance, type(exc).__name__,
        )
        streams: list[OpenStream] = []
        try:
            for s in old:
                streams.append(await self.pipeline._open_one(
                    self.tokenized, s.prompt_index, self.requires_tokenizer, first_attempt=s.attempt + 1,
                    exclude={exc.instance},
                ))
        finally:
            # Whatever opened is owned by the stream now, so aclose releases it on any exit.
            self.streams = streams + old[len(streams):]

    async def _events(self, stream: OpenStream) -> AsyncGenerator[dict[str, Any], None]:
        """The attempt's events through the engine boundary, each within the chunk timeout."""
        timeout = self.pipeline.stream_settings.chunk_timeout_s
        events = stream.events
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
            yield self.pipeline.boundary.inbound_event(raw, stream.instance)

    async def _prompt_chunks(self, index: int, *, remap: bool = False) -> AsyncGenerator[dict[str, Any], None]:
        """Derendered chunks of prompt ``index`` across its attempts (relaying where allowed)."""
        session = self.sessions[index]
        while True:
            stream = self.streams[index]
            snapshot = session.begin_attempt(stream.attempt, stream.instance.name)
            try:
                async with aclosing(session.chunks(self._events(stream))) as chunks:
                    async for chunk in chunks:
                        if remap:
                            for c in chunk.get("choices") or []:
                                c["index"] = index * self.n + c.get("index", 0)
                        yield chunk
            except EngineError as exc:
                if not session.visible:
                    session.restore(snapshot)
                # A mid-stream engine failure is the engine's: its breaker hears it.
                self.pipeline.scheduler.breakers.failure(stream.instance, exc.message[:200])
                metrics.record_request(stream.instance.name, None, None, ok=False)
                await stream.aclose(self.pipeline.engines)
                # Every choice already finished (the engine failed before its usage event or
                # [DONE]): nothing is missing but the usage chunk, which is ours anyway.
                done = len(session.choices) == self.n and all(
                    c.phase is ChoicePhase.DONE for c in session.choices.values()
                )
                if not done and (
                    not self.relays_allowed or session.relays >= self.pipeline.stream_settings.max_relays
                ):
                    raise
                replacement = None if done else await self.pipeline._relay(self, session, stream, exc)
                if replacement is None:
                    # Every output token was already committed: end as the engine would have.
                    tail_events = _budget_spent_events(self.body, stream.request_id, finish=not done)
                    async with aclosing(session.chunks(tail_events)) as tail:
                        async for chunk in tail:
                            yield chunk
                    return
                self.streams[index] = replacement
                continue
            stream.finished = True
            return

    async def _merged(self) -> AsyncGenerator[dict[str, Any], None]:
        """Fan-in of per-prompt streams: global choice index, one merged usage chunk."""
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(MERGE_QUEUE_SIZE)
        usage: dict[str, int] = {}
        usage_template: dict[str, Any] | None = None
        failed: list[int] = []

        async def produce(index: int) -> None:
            try:
                async with aclosing(self._prompt_chunks(index, remap=True)) as chunks:
                    async for chunk in chunks:
                        await queue.put(chunk)
            except MotorError:
                failed.append(index)
                raise

        async def run_all() -> None:
            try:
                async with asyncio.TaskGroup() as tg:
                    for i in range(len(self.streams)):
                        tg.create_task(produce(i))
            except asyncio.CancelledError:
                # The consumer is gone and cancelled us: nobody reads a sentinel, and putting one
                # into a full queue would block this task (and the client's cleanup) forever.
                raise
            except BaseException:
                await queue.put(None)
                raise
            await queue.put(None)

        runner = asyncio.create_task(run_all())
        try:
            while (chunk := await queue.get()) is not None:
                if not chunk.get("choices") and chunk.get("usage"):
                    usage_template = chunk
                    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                        usage[key] = usage.get(key, 0) + int(chunk["usage"].get(key) or 0)
                    continue
                yield chunk
            await runner  # re-raises a producer's failure
        except BaseException as exc:
            runner.cancel()
            # Wait for the producers to stop without taking on their outcome. asyncio.wait raises
            # only our own cancellation, which must propagate (``except BaseException: pass``
            # around ``await runner`` swallowed it).
            await asyncio.wait([runner])
            if not runner.cancelled():
                runner.exception()  # retrieved: re-raised below as exc, or superseded by it
            cancelled = [i for i in range(len(self.streams)) if i not in failed and not self.streams[i].finished]
            logger.warning(
                "stream_cancel request_id=%s failed_prompts=%s cancelled_prompts=%s reason=%s",
                self.public_id, ",".join(map(str, failed)) or "-", ",".join(map(str, cancelled)) or "-",
                "substream_failed" if failed else type(exc).__name__,
            )
            if isinstance(exc, BaseExceptionGroup):
                raise _first_motor_error(exc) from exc
            raise
        if usage_template is not None:
            yield {**usage_template, "usage": {**usage_template["usage"], **usage}}

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        try:
            for s in self.streams:
                try:
                    await s.aclose(self.pipeline.engines)
                except BaseException as exc:  # close the others first, then raise
                    errors.append(exc)
        finally:
            if self.release_render is not None:
                self.release_render()  # no derender call follows: the old sidecar may go
        if errors:
            raise errors[0]


async def _budget_spent_events(
    body: dict[str, Any], engine_request_id: str, *, finish: bool
) -> AsyncGenerator[dict[str, Any], None]:
    """The end of a stream whose whole output budget (or finish) was committed before its engine
    failed: the finish chunk if it is missing, the usage chunk if asked for (numbers are ours)."""
    rid = GENERATE_PREFIX + engine_request_id
    if finish:
        yield {"request_id": rid, "usage": None, "output_mode": "tokens",
               "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [],
                            "logprobs": None}]}
    if (body.get("stream_options") or {}).get("include_usage"):
        yield {"request_id": rid, "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
               "output_mode": "tokens", "choices": []}


def _first_motor_error(group: BaseExceptionGroup) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_motor_error(exc)
        return exc
    return group


def _hint(reason: str) -> str:
    hint = NATIVE_HINTS.get(reason)
    return f": {hint}." if hint else ""


def _requested_tokens(prompt: TokenizedPrompt) -> int:
    """Prompt + resolved max output (per choice), before any engine's context budget clamps it."""
    n = int(prompt.sampling_params.get("n") or 1)
    return len(prompt.token_ids) + resolved_max_tokens(dict(prompt.generate_request)) * n


class RouterCounters:
    """Counters of routing decisions and phase outcomes, rendered by ``/metrics``.

    Keys are ``(name, labels)`` with labels a sorted tuple of ``(label, value)`` pairs, e.g.
    ``("motor_route_decisions_total", (("path", "native"), ("reason", "echo")))``.
    """

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()

    def inc(self, name: str, **labels: str) -> None:
        self._counts[(name, tuple(sorted(labels.items())))] += 1

    def get(self, name: str, **labels: str) -> int:
        return self._counts[(name, tuple(sorted(labels.items())))]

    def snapshot(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], int]:
        return dict(self._counts)

    def clear(self) -> None:
        self._counts.clear()


class EngineBoundary:
    """The one place engine requests leave and engine responses arrive: where obfuscation applies.

    Without a mapping it is a no-op. With one (``RenderView.obfuscation`` on), every request is
    passed through ``obfuscate_request`` right before it is sent and every response or event
    through ``deobfuscate_response`` / ``deobfuscate_event`` right after it arrives, so the rest
    of the pipeline only ever sees semantic ids.
    """

    def __init__(self, mapping: Any = None) -> None:
        self.mapping = mapping

    def outbound(self, request: dict[str, Any], instance: InstanceView) -> dict[str, Any]:
        if self.mapping is None:
            return request
        from serving.pipeline import obfuscation

        return obfuscation.obfuscate_request(request, self.mapping)

    def inbound(self, response: dict[str, Any], instance: InstanceView) -> dict[str, Any]:
        if self.mapping is None:
            return response
        from serving.pipeline import obfuscation

        return obfuscation.deobfuscate_response(response, self.mapping)

    def inbound_event(self, event: dict[str, Any], instance: InstanceView) -> dict[str, Any]:
        if self.mapping is None:
            return event
        from serving.pipeline import obfuscation

        return obfuscation.deobfuscate_event(event, self.mapping)


@dataclass
class GenerateContext:
    """What one attempt of one prompt carries through a topology runner.

    Runners (``run_union`` here, Handoff / Trigger in ``router/topologies.py``) only sequence
    legs; ``leg`` does the per-engine work every topology shares.
    """

    pipeline: ServingPipeline
    request_id: str  # the client-facing request id (logs)
    prompt: TokenizedPrompt
    prompt_index: int
    attempt: int
    tokens: int  # prompt + resolved max output: what admission holds on the decoding instance

    async def leg(
        self, instance: InstanceView, request: dict[str, Any], *, phase: str, tokens: int | None = None
    ) -> dict[str, Any]:
        """One non-streaming generate on ``instance``: breaker, admission, load, boundary, validation.

        The breaker hears only the engine's own faults: a busy engine, a missing capability, a
        4xx about the request, admission refusals and cancellation leave it as it was.
        """
        p = self.pipeline
        breakers = p.scheduler.breakers
        if not breakers.begin(instance):
            raise EngineBusy(f"{instance.name} is held off by its circuit breaker", instance=instance.name)
        start = time.perf_counter()
        result = "ok"
        try:
            async with await p.scheduler.admission.acquire(instance, self.tokens if tokens is None else tokens):
                with p.scheduler.load.hold(instance):
                    raw = await p.engines.generate(instance, p.boundary.outbound(request, instance))
            response = p.boundary.inbound(raw, instance)
            problem = validate_generate_response(response, n=int(request.get("sampling_params", {}).get("n") or 1))
            if problem is not None:
                raise EngineError(f"{instance.name} answered an unusable GenerateResponse: {problem}", instance=instance.name)
        except (EngineBusy, EngineLacksCapability) as exc:
            result = type(exc).__name__
            breakers.release(instance)
            raise
        except EngineError as exc:
            result = type(exc).__name__
            breakers.failure(instance, exc.message[:200])
            metrics.record_request(instance.name, None, None, ok=False)
            raise
        except BaseException as exc:
            result = type(exc).__name__
            breakers.release(instance)
            raise
        finally:
            log = logger.info if result == "ok" else logger.warning
            log(
                "generate request_id=%s prompt=%d instance=%s phase=%s attempt=%d result=%s latency_ms=%.1f",
                self.request_id, self.prompt_index, instance.name, phase, self.attempt, result, _ms(start),
            )
        breakers.success(instance)
        metrics.record_request(instance.name, time.perf_counter() - start, None, ok=True)  # TTFT = whole answer
        return response

    async def stream_leg(
        self, instance: InstanceView, request: dict[str, Any], *, phase: str, tokens: int, stack: AsyncExitStack
    ) -> AsyncIterator[dict[str, Any]]:
        """Open one streaming generate on ``instance`` (established: HTTP 200); return its events.

        Its admission lease, load hold and HTTP stream go on ``stack`` (the attempt's), so a failed
        attempt releases them at once. The breaker hears the engine's own faults as in ``leg``.
        """
        p = self.pipeline
        breakers = p.scheduler.breakers
        if not breakers.begin(instance):
            raise EngineBusy(f"{instance.name} is held off by its circuit breaker", instance=instance.name)
        try:
            lease = await p.scheduler.admission.acquire(instance, tokens)
            stack.callback(lease.release)
            stack.enter_context(p.scheduler.load.hold(instance))
            events = await stack.enter_async_context(p.engines.generate_stream(instance, p.boundary.outbound(request, instance)))
        except (EngineBusy, EngineLacksCapability):
            breakers.release(instance)
            raise
        except EngineError as exc:
            breakers.failure(instance, exc.message[:200])
            metrics.record_request(instance.name, None, None, ok=False)
            raise
        except BaseException:
            breakers.release(instance)
            raise
        breakers.success(instance)
        logger.info("generate request_id=%s prompt=%d instance=%s phase=%s attempt=%d result=established stream=true",
                    self.request_id, self.prompt_index, instance.name, phase, self.attempt)
        return metrics.TimedEvents(instance.name, events)


TopologyRunner = Callable[[GenerateContext, Placement, dict[str, Any]], Awaitable[dict[str, Any]]]


async def run_union(ctx: GenerateContext, placement: Placement, engine_req: dict[str, Any]) -> dict[str, Any]:
    """Union: one instance prefills and decodes."""
    return await ctx.leg(placement.instances[0], engine_req, phase="union")


# Handoff / Trigger register here (router/topologies.py): one signature for every topology.
TOPOLOGY_RUNNERS: dict[str, TopologyRunner] = {"union": run_union}

# Streaming P/D: (ctx, placement, budgeted engine request, the attempt's stack) -> (decode instance,
# its leg's engine request id, D's events); the prefill side is over (or released) when it returns.
StreamOpener = Callable[
    [GenerateContext, Placement, dict[str, Any], AsyncExitStack],
    Awaitable[tuple[InstanceView, str, AsyncIterator[dict[str, Any]]]],
]
STREAM_OPENERS: dict[str, StreamOpener] = {}


def _no_pd_ineligibility(_engine_request: dict[str, Any]) -> str:
    return ""


# Why a request must stay on one instance (``topologies.pd_ineligible``, registered with the runners).
PD_INELIGIBLE: Callable[[dict[str, Any]], str] = _no_pd_ineligibility


class TriggerMultiPromptStream(NoCapacity):
    """A multi-prompt streaming request was placed on Trigger: the RFC serves it natively."""


class ServingPipeline:
    """Serves one request against one fleet snapshot."""

    def __init__(
        self,
        snapshot: FleetSnapshot,
        render: RenderClient,
        engines: EngineClient,
        scheduler: Scheduler,
        *,
        max_attempts: int = 2,
        native: NativeClient | None = None,
        counters: RouterCounters | None = None,
        boundary: EngineBoundary | None = None,
        render_health: RenderHealth | None = None,
        stream_settings: StreamSettings | None = None,
        live_streams: LiveStreams | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.render = render
        self.engines = engines
        self.scheduler = scheduler
        self.max_attempts = max_attempts  # engine attempts per prompt, across instances
        self.native = native or NativeClient(engines._client)
        self.counters = counters or RouterCounters()
        self.boundary = boundary or EngineBoundary()
        self.render_health = render_health or RenderHealth()
        self.stream_settings = stream_settings or StreamSettings()
        self.live_streams = live_streams or LiveStreams()

    # -- entry points ------------------------------------------------------------------------------

    async def chat(self, body: dict[str, Any], request_id: str) -> dict[str, Any] | EventStream | NativeStream:
        return await self._serve("chat", body, request_id)

    async def completions(self, body: dict[str, Any], request_id: str) -> dict[str, Any] | EventStream | NativeStream:
        return await self._serve("completions", body, request_id)

    async def responses(self, body: dict[str, Any], request_id: str) -> dict[str, Any] | NativeStream:
        """The Responses API: no derender exists for it, so it always passes through natively."""
        return await self._native("responses", body, request_id, "api:responses")

    async def messages(self, body: dict[str, Any], request_id: str) -> dict[str, Any] | NativeStream:
        """The Anthropic Messages API: passed through natively like Responses."""
        return await self._native("messages", body, request_id, "api:messages")

    # -- the token-only path -------------------------------------------------------------------------

    def _model(self, body: dict[str, Any]) -> ModelView:
        name = body.get("model") or ""
        model = self.snapshot.models.get(name)
        if model is None:
            raise ModelNotFound(str(name))
        return model

    async def _serve(self, kind: str, body: dict[str, Any], request_id: str) -> dict[str, Any] | EventStream | NativeStream:
        model = self._model(body)
        reason = native_reason(kind, body, self.snapshot, model.name)
        if reason is not None:
            return await self._native(kind, body, request_id, reason)
        # From render to the last derender this request calls the sidecar of its snapshot, even
        # if the snapshot moves to a replacement meanwhile (a graceful restart): counted from
        # here, not from the first chunk, so a request still waiting for admission counts too.
        release = self.live_streams.hold(self.snapshot.render.base_url.rstrip("/"))
        try:
            result = await self._serve_token_only(kind, body, request_id, model)
        except BaseException:
            release()
            raise
        if isinstance(result, EventStream):
            result.release_render = release  # the stream holds its sidecar until its aclose
        else:
            release()
        return result

    async def _serve_token_only(
        self, kind: str, body: dict[str, Any], request_id: str, model: ModelView
    ) -> dict[str, Any] | EventStream | NativeStream:
        tokenizer = TokenizationService(self.render, model, health=self.render_health)
        try:
            tokenized = await tokenizer.tokenize(kind, body, request_id)
        except NeedsNative as exc:
            self._log_render(request_id, model.name, None, "local", exc.fallback_reason, outcome=f"native:{exc.reason}")
            if self.snapshot.render.obfuscation:
                raise RenderUnavailable(
                    f"render is unavailable ({exc.fallback_reason}) and this request needs render's metadata; "
                    "the native path is closed with obfuscation on", reason=exc.fallback_reason,
                ) from exc
            return await self._native(kind, body, request_id, exc.reason)
        except MotorError as exc:
            self._log_render(request_id, model.name, None, "render", None, outcome=type(exc).__name__)
            raise
        self._log_render(request_id, model.name, tokenized, tokenized.tokenizer_source, tokenized.fallback_reason)
        self._check_poison(tokenized, model)
        # The client key's tokens-per-minute window is charged once the real count is known.
        rate_limit.charge(sum(_requested_tokens(p) for p in tokenized.prompts))
        requires_tokenizer = engine_tokenizer_feature(kind, body) is not None
        try:
            if body.get("stream"):
                return await self._open(body, kind, request_id, tokenized, requires_tokenizer)
            responses = await self._generate_all(tokenized, request_id, requires_tokenizer)
        except EngineLacksCapability:
            # Nothing reached the client yet: the whole request may move to the native path.
            if self.snapshot.render.obfuscation:
                raise
            return await self._native(kind, body, request_id, "engine_capability")
        return await self._derender(kind, body, request_id, tokenized, responses)

    def _log_render(
        self, request_id: str, model: str, tokenized: TokenizedRequest | None, source: str,
        fallback: str | None, *, outcome: str = "ok",
    ) -> None:
        self.counters.inc("motor_render_outcomes_total", source=source, result=outcome.split(":")[0],
                          fallback_reason=fallback or "")
        logger.info(
            "render request_id=%s model=%s result=%s prompts=%d prompt_tokens=%d latency_ms=%.1f "
            "tokenizer_source=%s fallback_reason=%s",
            request_id, model, outcome, len(tokenized.prompts) if tokenized else 0,
            tokenized.prompt_tokens if tokenized else 0, tokenized.latency_ms if tokenized else 0.0,
            source, fallback or "-",
        )

    def _check_poison(self, tokenized: TokenizedRequest, model: ModelView) -> None:
        """Ids outside the vocabulary or a prompt without room kill or fail an engine: 400 here."""
        vocab = model_vocab_size(model.model_path) if model.model_path else None
        for index, prompt in enumerate(tokenized.prompts):
            if vocab is not None:
                bad = next((t for t in prompt.token_ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise RequestError(
                        f"Token id {bad} in prompt {index} is out of vocabulary (vocab size {vocab}).", param="prompt"
                    )
            if len(prompt.token_ids) >= model.max_model_len:
                raise RequestError(
                    f"This model's maximum context length is {model.max_model_len} tokens. However, your request "
                    f"has {len(prompt.token_ids)} input tokens.",
                    param="messages" if tokenized.kind == "chat" else "prompt",
                )

    def _budget(self, prompt: TokenizedPrompt, instance: InstanceView) -> tuple[dict[str, Any], int]:
        """The engine request for ``instance`` and its admission tokens (prompt + max output).

        ``max_tokens`` is resolved first (render's omitted 16); with the context budget on it is
        clamped to the room the instance has left and written into ``sampling_params``.
        """
        return self._budget_request(dict(prompt.generate_request), len(prompt.token_ids), instance)

    def _budget_request(
        self, request: dict[str, Any], prompt_tokens: int, instance: InstanceView
    ) -> tuple[dict[str, Any], int]:
        req = dict(request)
        max_tokens = resolved_max_tokens(req)
        if self.snapshot.render.context_budget:
            room = instance.max_model_len - prompt_tokens
            max_tokens = max(1, min(max_tokens, room))
        req = with_max_tokens(req, max_tokens)
        n = int(req["sampling_params"].get("n") or 1)
        return req, prompt_tokens + max_tokens * n

    def _too_small(self, prompt: TokenizedPrompt) -> set[str]:
        """Instances whose own context cannot hold the prompt plus one output token."""
        return {i.name for i in self.snapshot.instances if i.max_model_len <= len(prompt.token_ids)}

    async def _generate_all(
        self, tokenized: TokenizedRequest, request_id: str, requires_tokenizer: bool
    ) -> list[dict[str, Any]]:
        if len(tokenized.prompts) == 1:
            return [await self._generate(tokenized, 0, request_id, requires_tokenizer)]
        # Prompts run concurrently; one failing prompt fails the request as a whole and cancels
        # the others (asyncio.gather would leave them generating, holding load, after we answer).
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self._generate(tokenized, i, request_id, requires_tokenizer))
                    for i in range(len(tokenized.prompts))
                ]
        except BaseExceptionGroup as group:
            raise _first_motor_error(group) from group
        return [t.result() for t in tasks]

    async def _generate(
        self, tokenized: TokenizedRequest, index: int, request_id: str, requires_tokenizer: bool
    ) -> dict[str, Any]:
        """Non-streaming generate of one prompt with a bounded retry budget across instances."""
        prompt = tokenized.prompts[index]
        excluded = self._too_small(prompt)
        last: EngineError | None = None
        for attempt in range(self.max_attempts):
            estimate = _requested_tokens(prompt)
            try:
                placement = self.scheduler.place(
                    self.snapshot, tokenized.model, prompt.token_ids, tokens=estimate, exclude=excluded,
                    requires_tokenizer=requires_tokenizer, pd_ineligible=PD_INELIGIBLE(dict(prompt.generate_request)),
                )
            except NoCapacity:
                if last is not None:
                    raise last from None
                raise
            engine_req, tokens = self._budget(prompt, placement.instances[-1])
            engine_req["request_id"] = attempt_request_id(prompt.request_id, attempt)
            logger.info(
                "placement request_id=%s prompt=%d attempt=%d topology=%s instances=%s prefix_hit_blocks=%d tokens=%d",
                request_id, index, attempt, placement.topology, placement.names, placement.prefix_hit_blocks, tokens,
            )
            ctx = GenerateContext(self, request_id, prompt, index, attempt, tokens)
            runner = TOPOLOGY_RUNNERS[placement.topology]
            try:
                return await runner(ctx, placement, engine_req)
            except EngineLacksCapability:
                raise
            except EngineError as exc:
                last = exc
                excluded.update(i.name for i in placement.instances)
        assert last is not None
        raise last

    async def _derender(
        self, kind: str, body: dict[str, Any], request_id: str, tokenized: TokenizedRequest,
        responses: list[dict[str, Any]],
    ) -> dict[str, Any]:
        start = time.perf_counter()
        prompt_ids = [p.token_ids for p in tokenized.prompts]
        result = "ok"
        try:
            if tokenized.tokenizer_source == "local":
                # Render was unusable for this request; its derender would be too.
                local = LocalDerenderer(await TokenizationService(self.render, self._model(body)).local_tokenizer())
                if kind == "chat":
                    out = local.chat(responses[0], prompt_ids=prompt_ids[0], body=body)
                else:
                    out = local.completions(responses, prompt_ids=prompt_ids, body=body)
            elif kind == "chat":
                out = await self.render.derender_chat(
                    responses[0], prompt_token_ids=prompt_ids[0], chat_request=body, model=body.get("model")
                )
            else:
                out = await self.render.derender_completions(
                    [sorted_choices(r) for r in responses], prompt_token_ids=prompt_ids,
                    completion_request=body, model=body.get("model"),
                )
        except BaseException as exc:
            result = type(exc).__name__
            raise
        finally:
            logger.info(
                "derender request_id=%s kind=%s source=%s result=%s latency_ms=%.1f",
                request_id, kind, tokenized.tokenizer_source, result, _ms(start),
            )
        out["id"] = f"chatcmpl-{request_id}" if kind == "chat" else f"cmpl-{request_id}"
        return out

    # -- the native path -----------------------------------------------------------------------------

    async def _native(self, kind: str, body: dict[str, Any], request_id: str, reason: str) -> dict[str, Any] | NativeStream:
        """Serve ``body`` on an engine's own OpenAI API, retrying elsewhere within the budget."""
        model = self._model(body)
        if self.snapshot.render.obfuscation:
            self.counters.inc("motor_route_decisions_total", path="refused", reason=reason)
            logger.info("route request_id=%s kind=%s path=refused reason=%s", request_id, kind, reason)
            raise RequestError(
                f"This request needs the engine's own OpenAI API ({reason}), which is not available while "
                "token obfuscation is on." + _hint(reason),
            )
        self.counters.inc("motor_route_decisions_total", path="native", reason=reason)
        logger.info("route request_id=%s kind=%s path=native reason=%s", request_id, kind, reason)
        excluded: set[str] = set()
        last: EngineError | None = None
        for attempt in range(self.max_attempts):
            candidates = sorted(
                (i for i in native_instances(self.snapshot, model.name)
                 if i.name not in excluded and self.scheduler.eligible(i)),
                key=lambda i: (self.scheduler.load.inflight(i.name) / max(i.weight, 1), i.name),
            )
            if not candidates:
                if last is not None:
                    raise last
                raise NoCapacity(
                    f"no engine serves the native OpenAI API for model {model.name!r} ({reason})" + _hint(reason)
                )
            instance = candidates[0]
            breakers = self.scheduler.breakers
            if not breakers.begin(instance):
                excluded.add(instance.name)
                continue
            start = time.perf_counter()
            stack = AsyncExitStack()
            try:
                # The body is the client's; the tokens are only an estimate (no prompt ids here).
                max_out = body.get("max_completion_tokens") or body.get("max_tokens") or 16
                lease = await self.scheduler.admission.acquire(instance, int(max_out) if isinstance(max_out, int) else 16)
                stack.callback(lease.release)
                stack.enter_context(self.scheduler.load.hold(instance))
                result = await self.native.call(instance, kind, body, request_id, stack)
            except (EngineBusy, EngineLacksCapability) as exc:
                await stack.aclose()
                breakers.release(instance)
                last = exc
                excluded.add(instance.name)
                logger.warning("native request_id=%s instance=%s attempt=%d result=%s", request_id, instance.name,
                               attempt, type(exc).__name__)
                continue
            except EngineError as exc:
                await stack.aclose()
                breakers.failure(instance, exc.message[:200])
                last = exc
                excluded.add(instance.name)
                logger.warning("native request_id=%s instance=%s attempt=%d result=%s", request_id, instance.name,
                               attempt, type(exc).__name__)
                continue
            except BaseException:
                await stack.aclose()
                breakers.release(instance)
                raise
            breakers.success(instance)
            logger.info("native request_id=%s instance=%s attempt=%d result=ok latency_ms=%.1f",
                        request_id, instance.name, attempt, _ms(start))
            if isinstance(result, NativeStream):
                return result
            await stack.aclose()
            return result
        if last is not None:
            raise last
        raise NoCapacity(f"no engine serves the native OpenAI API for model {model.name!r} ({reason})" + _hint(reason))

    # -- streaming -----------------------------------------------------------------------------------

    async def _open(
        self, body: dict[str, Any], kind: str, request_id: str, tokenized: TokenizedRequest, requires_tokenizer: bool
    ) -> EventStream | NativeStream | dict[str, Any]:
        """Establish every engine stream of the request before the client sees a byte."""
        streams: list[OpenStream] = []
        try:
            for index in range(len(tokenized.prompts)):
                streams.append(await self._open_one(tokenized, index, requires_tokenizer))
        except TriggerMultiPromptStream:
            # RFC: Trigger 多 prompt 流式仍沿用原生链路. Nothing reached the client yet.
            for s in streams:
                await s.aclose(self.engines)
            return await self._native(kind, body, request_id, "trigger_multi_prompt_stream")
        except BaseException:
            for s in streams:
                await s.aclose(self.engines)
            raise
        n = int(body.get("n") or 1)
        public_id = f"chatcmpl-{request_id}" if kind == "chat" else f"cmpl-{request_id}"
        return EventStream(
            self, kind, public_id, body, tokenized, streams, request_id=request_id,
            requires_tokenizer=requires_tokenizer, n=n,
        )

    async def _relay(
        self, stream: EventStream, session: StreamingRenderSession, failed: OpenStream, exc: EngineError
    ) -> OpenStream | None:
        """Continue a single-prompt stream on another instance from its committed output ids.

        Returns None when the whole output budget was already committed (nothing to generate).
        """
        prompt = stream.tokenized.prompts[failed.prompt_index]
        plan = RetryRequestPlan.build(prompt.generate_request, prompt.token_ids, session.committed_ids,
                                      attempt=failed.attempt + 1)
        session.relays += 1
        if plan.remaining_tokens < 1:
            logger.warning(
                "relay request_id=%s prompt=%d committed_tokens=%d remaining_tokens=0 old_instance=%s "
                "new_instance=- error=%s", stream.public_id, failed.prompt_index, len(plan.committed_ids),
                failed.instance.name, type(exc).__name__,
            )
            return None
        replacement = await self._open_one(
            stream.tokenized, failed.prompt_index, stream.requires_tokenizer, plan=plan, exclude={failed.instance.name}
        )
        logger.warning(
            "relay request_id=%s prompt=%d committed_tokens=%d remaining_tokens=%d old_instance=%s new_instance=%s "
            "old_engine_request_id=%s new_engine_request_id=%s relay=%d error=%s",
            stream.public_id, failed.prompt_index, len(plan.committed_ids), plan.remaining_tokens,
            failed.instance.name, replacement.instance.name, failed.request_id, replacement.request_id,
            session.relays, type(exc).__name__,
        )
        return replacement

    async def _open_one(
        self, tokenized: TokenizedRequest, index: int, requires_tokenizer: bool, *,
        plan: RetryRequestPlan | None = None, exclude: Collection[str] = (), first_attempt: int = 0,
    ) -> OpenStream:
        """Open one engine stream of prompt ``index`` (or of a relay ``plan``) within the retry budget."""
        prompt = tokenized.prompts[index]
        token_ids = plan.replay_ids if plan is not None else prompt.token_ids
        excluded = self._too_small(prompt) | set(exclude)
        last: EngineError | None = None
        first = plan.attempt if plan is not None else first_attempt
        multi_prompt = len(tokenized.prompts) > 1
        for attempt in range(first, first + self.max_attempts):
            base = replace(plan, attempt=attempt).request() if plan is not None else dict(prompt.generate_request)
            n = int(base.get("sampling_params", {}).get("n") or 1)
            estimate = len(token_ids) + resolved_max_tokens(base) * n
            ineligible = PD_INELIGIBLE(base)
            try:
                # A relay is placed like any prompt (same scheduler, same topology rules): in P/D,
                # P and D both get the replay ids.
                placement = self.scheduler.place(
                    self.snapshot, tokenized.model, token_ids, tokens=estimate, exclude=excluded,
                    requires_tokenizer=requires_tokenizer, pd_ineligible=ineligible,
                )
            except NoCapacity:
                if last is not None:
                    raise last from None
                raise
            if placement.topology == "trigger" and multi_prompt:
                logger.info("route request_id=%s prompt=%d path=native reason=trigger_multi_prompt_stream instances=%s",
                            prompt.request_id, index, placement.names)
                raise TriggerMultiPromptStream("multi-prompt streaming on Trigger takes the native path")
            # The decode instance's context bounds the budget (union: the one instance).
            instance = placement.instances[-1]
            engine_req, tokens = self._budget_request(base, len(token_ids), instance)
            rid = engine_req["request_id"] = attempt_request_id(prompt.request_id, attempt)
            logger.info(
                "placement request_id=%s prompt=%d attempt=%d topology=%s instances=%s prefix_hit_blocks=%d tokens=%d "
                "stream=true pd_ineligible=%s", rid, index, attempt, placement.topology, placement.names,
                placement.prefix_hit_blocks, tokens, ineligible or "-",
            )
            ctx = GenerateContext(self, prompt.request_id, prompt, index, attempt, tokens)
            attempt_stack = AsyncExitStack()
            try:
                # Per attempt: a failed attempt releases its holds now, not when the request ends.
                if placement.topology == "union":
                    events = await ctx.stream_leg(instance, engine_req, phase="union", tokens=tokens, stack=attempt_stack)
                    stream_instance, stream_rid = instance, rid
                else:
                    opener = STREAM_OPENERS.get(placement.topology)
                    if opener is None:
                        raise NoCapacity(f"no streaming runner for topology {placement.topology!r}")
                    stream_instance, stream_rid, events = await opener(ctx, placement, engine_req, attempt_stack)
            except EngineLacksCapability:
                await attempt_stack.aclose()
                raise
            except EngineError as exc:
                await attempt_stack.aclose()
                last = exc
                # The failed instance (its breaker already heard it in the leg); a P/D placement
                # without a named culprit moves off both.
                failed = {exc.instance} if exc.instance else {i.name for i in placement.instances}
                excluded.update(failed)
                logger.warning("generate request_id=%s prompt=%d instances=%s topology=%s attempt=%d result=%s stream=true",
                               rid, index, ",".join(sorted(failed)), placement.topology, attempt, type(exc).__name__)
                continue
            except BaseException:
                await attempt_stack.aclose()
                raise
            return OpenStream(index, stream_instance, stream_rid, events, stack=attempt_stack, attempt=attempt)
        if last is not None:
            raise last
        raise NoCapacity(f"no engine instance can serve model {tokenized.model!r} right now")
