"""Render -> place -> generate -> derender for one OpenAI request, streaming or not.

``ServingPipeline`` is built once per snapshot view (``serving/runtime.py`` ``pipeline_for``)
from the fleet snapshot and the process-wide objects the composition root made: clients,
scheduler with its breakers and token admission, the engine boundary, the topology registry,
counters. It holds no state of its own between requests: what one request carries is its
``RequestContext`` (``request_context.py``). The phases, each logged once per outcome with the request id:

0. body checks (``request_checks.py``): numbers, engine controls and key policy, before any
   path uses the body; every JSON answer is scrubbed of engine-internal fields on the way out;
1. routing: ``native_reason`` sends what token-only cannot serve exactly to an engine's own
   OpenAI API (``engine/native.py``: a union engine's, or a P/D pair's through the guide's proxy
   flow, ``topologies/native_pd.py``), or refuses it with obfuscation on;
2. tokenization (``render/tokenization.py``): render, or the local tokenizer when render is
   unusable; the local fallback hands requests it cannot build exactly to the native path;
3. poison check (``request_checks.check_tokenized``): ids outside the vocabulary (503 while
   the vocabulary size is unknown) or a prompt without room in the context are 400 before any
   engine sees them;
4. attempts (``resilience/attempts.py``): placement, budget and the topology's opener (one
   per topology for both modes), within one retry policy; every engine call goes through the guarded
   leg (``engine/leg.py``): breaker, token admission, load, the obfuscation boundary, validation;
5. derender: full (``derender/full.py``) or per chunk (``streaming/event_stream.py``).

A request's ``Response`` (``response.py``) owns what it holds from the first step on (its
charge, its render count, its engine streams). Streaming responses are returned as that
``Response``, whose body (an ``EventStream``, or a relayed ``NativeStream``) has its engine
streams already established (HTTP 200 from every engine), so a failure before that still gets a
proper status instead of a broken 200; a JSON answer is returned as a dict once the stack closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

from serving.pipeline import metric_names, request_checks
from serving.pipeline.apis import responses as responses_api
from serving.pipeline.apis.messages import chat_view, to_message
from serving.pipeline.apis.messages_stream import MessagesEvents, MessagesStream
from serving.pipeline.apis.responses_stream import ResponsesEvents, ResponsesStream
from serving.pipeline.derender.full import derender_full
from serving.pipeline.derender.local_stream import stream_derenderer
from serving.pipeline.derender.session import StreamSettings
from serving.pipeline.engine.client import EngineClient
from serving.pipeline.engine.leg import EngineGuard
from serving.pipeline.engine.native import (
    NativeClient,
    NativeStream,
    engine_tokenizer_feature,
    native_reason,
)
from serving.pipeline.errors import (
    EngineLacksCapability,
    MotorError,
    RenderUnavailable,
    RequestError,
    TriggerMultiPromptStream,
    UpstreamRequestError,
)
from serving.pipeline.flow_control.admission import LeaseGroup
from serving.pipeline.metrics import RouterCounters
from serving.pipeline.native_path import NativePath
from serving.pipeline.obfuscation.boundary import EngineBoundary
from serving.pipeline.phases import NO_PHASES, Phases
from serving.pipeline.placement.scheduler import Scheduler
from serving.pipeline.protocol import ApiKind, TokenKind
from serving.pipeline.render.client import RenderClient
from serving.pipeline.render.pool import pool_members
from serving.pipeline.render.sidecar_holds import SidecarHolds
from serving.pipeline.render.tokenization import (
    NeedsNative,
    RenderHealth,
    TokenizationService,
    TokenizedRequest,
)
from serving.pipeline.request_checks import RequestLimits
from serving.pipeline.request_context import RequestContext
from serving.pipeline.resilience.attempts import (
    AttemptPolicy,
    Attempts,
    OpenStream,
    open_together,
    requested_tokens,
)
from serving.pipeline.response import Response, StreamBody, respond
from serving.pipeline.snapshot import FleetSnapshot, ModelView
from serving.pipeline.streaming.event_stream import EventStream
from serving.pipeline.streaming.fanout import first_error
from serving.pipeline.topologies.native_pd import (
    native_pd_ineligible,
)
from serving.pipeline.topologies.native_prompts import NativePromptsStream
from serving.pipeline.topologies.registry import TopologyRegistry
from serving.pipeline.tracing import NO_TRACE

logger = logging.getLogger(__name__)

_R = TypeVar("_R")
# What the token path serves: its own kinds, and Messages through the chat one.
ServedKind = TokenKind | Literal["messages", "responses"]


def _scrubbed(result: _R) -> _R:
    """A JSON answer without engine-internal fields; streams pass as they are."""
    if isinstance(result, dict):
        request_checks.scrub_response(result)
    return result


class ServingPipeline(NativePath):
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
        sidecar_holds: SidecarHolds | None = None,
        topologies: TopologyRegistry | None = None,
        limits: RequestLimits | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.render = render
        self.engines = engines
        self.scheduler = scheduler
        self.policy = AttemptPolicy(max_attempts=max_attempts)
        # The native path's JSON replies get the token-only path's deadline (ReplyDeadline).
        self.native = native or NativeClient(engines._client, deadline=engines.deadline)
        self.counters = counters or RouterCounters()
        self.boundary = boundary or EngineBoundary()
        self.render_health = render_health or RenderHealth()
        self.stream_settings = stream_settings or StreamSettings()
        self.sidecar_holds = sidecar_holds or SidecarHolds()
        self.topologies = topologies or TopologyRegistry()
        self.limits = limits or RequestLimits()
        self.guard = EngineGuard(scheduler, engines, self.boundary, self.native)

    def attempts(
        self, request_id: str, phases: Phases = NO_PHASES, trace: Mapping[str, str] = NO_TRACE
    ) -> Attempts:
        """The attempt loop of one request (both modes), on this pipeline's snapshot and guard."""
        return Attempts(
            self.snapshot, self.guard, self.topologies, self.policy, request_id=request_id, counters=self.counters,
            phases=phases, trace=trace,
        )

    # -- entry points ------------------------------------------------------------------------------

    async def chat(
        self, body: dict[str, Any], request: RequestContext | str, phases: Phases = NO_PHASES
    ) -> dict[str, Any] | Response:
        return await self._respond("chat", body, RequestContext.of(request, phases))

    async def completions(
        self, body: dict[str, Any], request: RequestContext | str, phases: Phases = NO_PHASES
    ) -> dict[str, Any] | Response:
        return await self._respond("completions", body, RequestContext.of(request, phases))

    async def responses(
        self, body: dict[str, Any], request: RequestContext | str, phases: Phases = NO_PHASES
    ) -> dict[str, Any] | Response:
        """The Responses API: the chat token path from render's ``/v1/responses/render``, its
        answer converted at the end (``apis/responses.py``); native where render cannot."""
        return await self._respond("responses", body, RequestContext.of(request, phases))

    async def messages(
        self, body: dict[str, Any], request: RequestContext | str, phases: Phases = NO_PHASES
    ) -> dict[str, Any] | Response:
        """The Anthropic Messages API: the chat token path from render's ``/v1/messages/render``,
        its answer converted at the end (``apis/messages.py``); native where render cannot."""
        return await self._respond("messages", body, RequestContext.of(request, phases))

    async def _respond(self, kind: ServedKind, body: dict[str, Any], ctx: RequestContext) -> dict[str, Any] | Response:
        """A JSON answer, or the stream's ``Response`` (``response.py``: it owns what the request holds)."""
        self._check_body(kind, body, ctx)
        return await respond(ctx, lambda response: self._answer(kind, body, response))

    async def _answer(self, kind: ServedKind, body: dict[str, Any], response: Response) -> dict[str, Any] | StreamBody:
        with self._engine_errors_scrubbed():
            result = await self._serve(kind, body, response)
        request_id = response.ctx.request_id
        if isinstance(result, EventStream) and kind == "responses":  # the chat stream, sent as Responses events
            return ResponsesStream(result, ResponsesEvents(
                body, result.tokenized.prompts[0].generate_request, f"resp_{request_id}"))
        if isinstance(result, EventStream) and kind == "messages":  # the chat stream, sent as Anthropic events
            return MessagesStream(result, MessagesEvents(
                f"msg_{request_id}", str(body.get("model")), result.tokenized.prompt_tokens))
        return _scrubbed(result)

    @contextmanager
    def _engine_errors_scrubbed(self) -> Iterator[None]:
        """With obfuscation on, an engine's 4xx keeps its status but not its text (physical ids)."""
        try:
            yield
        except UpstreamRequestError as exc:
            shown = self.boundary.client_error(exc)
            if shown is exc:
                raise
            raise shown from None

    def _check_body(self, kind: ApiKind, body: dict[str, Any], ctx: RequestContext) -> None:
        """Every path starts here: the body's numbers, engine controls and id fields (request_checks)."""
        model = self._model(body)
        if model.base and self.snapshot.render.obfuscation:
            # The engines' weights are permuted with the render config's key, an adapter's are
            # not: its answers would be noise. Refused rather than served wrong (fail closed).
            raise RequestError(
                f"The LoRA adapter `{model.name}` is not served with token obfuscation on: its weights are "
                "not permuted with the base model's key.", param="model",
            )
        request_checks.check_body(kind, body, model, self.limits, ctx.policy)
        if model.vocab_size is not None:
            # The token-only path checks the rendered ids again; the native one has only these.
            request_checks.check_body_ids(kind, body, model.vocab_size)

    # -- the token-only path -------------------------------------------------------------------------

    async def _serve(
        self, kind: ServedKind, body: dict[str, Any], response: Response
    ) -> dict[str, Any] | EventStream | NativeStream | NativePromptsStream:
        model = self._model(body)
        reason = native_reason(kind, body, self.snapshot, model.name)
        if reason is not None:
            return await self._native(kind, body, response, reason)
        # From render to the last derender this request calls the sidecar of its snapshot, even
        # if the snapshot moves to a replacement meanwhile (a graceful restart): counted from
        # here, not from the first chunk, so a request still waiting for admission counts too.
        # With a pool, any member may serve any of its calls: it holds every member of its pool.
        release = response.hold(self.sidecar_holds.hold_all(m.base_url for m in pool_members(self.snapshot.render)))
        result = await self._serve_token_only(kind, body, model, response)
        if not isinstance(result, EventStream):
            release()  # no derender call follows (a JSON answer, or the native path took it)
        return result

    async def _serve_token_only(
        self, kind: ServedKind, body: dict[str, Any], model: ModelView, response: Response
    ) -> dict[str, Any] | EventStream | NativeStream | NativePromptsStream:
        request_id, phases = response.ctx.request_id, response.ctx.phases
        request_checks.require_vocab(model)  # 503 before render while the vocabulary is unknown
        tokenizer = TokenizationService(self.render, model, health=self.render_health)
        start = phases.now()
        try:
            tokenized = await tokenizer.tokenize(kind, body, request_id, response.ctx.trace)
        except NeedsNative as exc:
            self._log_render(request_id, model.name, None, "local", exc.fallback_reason, outcome=f"native:{exc.detail}")
            if self.snapshot.render.obfuscation:
                raise RenderUnavailable(
                    f"render is unavailable ({exc.fallback_reason}) and this request needs render's metadata; "
                    "the native path is closed with obfuscation on", reason=exc.fallback_reason,
                ) from exc
            return await self._native(kind, body, response, exc.reason, render_tried=True)
        except MotorError as exc:
            self._log_render(request_id, model.name, None, "render", None, outcome=type(exc).__name__)
            raise
        phases.on(source=tokenized.tokenizer_source).observe(metric_names.PHASE_RENDER, start)
        self._log_render(request_id, model.name, tokenized, tokenized.tokenizer_source, tokenized.fallback_reason)
        request_checks.check_tokenized(tokenized.prompts, kind=tokenized.kind, model=model)
        for prompt in tokenized.prompts:
            self.boundary.admit(prompt.generate_request)  # with obfuscation on: a 400 before any quota
        # The client key's tokens-per-minute window is charged once the real count is known, with
        # the output bound the context budget leaves (the one placement and admission use).
        await response.charge(
            sum(requested_tokens(p, self.snapshot, self.scheduler, model.name) for p in tokenized.prompts)
        )
        requires_tokenizer = engine_tokenizer_feature(kind, body) is not None
        # A Messages request runs as the chat request its render stands for (apis/messages.py).
        token_kind: TokenKind = tokenized.kind
        rendered = tokenized.prompts[0].generate_request
        token_body = (chat_view(body, rendered) if kind == "messages"
                      else responses_api.chat_view(body, rendered) if kind == "responses" else body)
        try:
            if body.get("stream"):
                return await self._open(token_body, token_kind, tokenized, requires_tokenizer, response)
            responses = await self._generate_all(tokenized, response.ctx, requires_tokenizer)
        except EngineLacksCapability:
            # Nothing reached the client yet: the whole request may move to the native path.
            if self.snapshot.render.obfuscation:
                raise
            return await self._native(kind, body, response, "engine_capability", tokenized=tokenized)
        out = await self._derender(token_kind, token_body, response.ctx, tokenized, responses)
        if kind == "responses":
            return responses_api.to_response(out, body, rendered, f"resp_{request_id}")
        return to_message(out, f"msg_{request_id}") if kind == "messages" else out

    def _log_render(
        self, request_id: str, model: str, tokenized: TokenizedRequest | None, source: str,
        fallback: str | None, *, outcome: str = "ok",
    ) -> None:
        self.counters.inc(metric_names.RENDER_OUTCOMES, model=model, source=source, result=outcome.split(":")[0],
                          fallback_reason=fallback or "")
        logger.info(
            "render request_id=%s model=%s result=%s prompts=%d prompt_tokens=%d latency_ms=%.1f "
            "tokenizer_source=%s fallback_reason=%s",
            request_id, model, outcome, len(tokenized.prompts) if tokenized else 0,
            tokenized.prompt_tokens if tokenized else 0, tokenized.latency_ms if tokenized else 0.0,
            source, fallback or "-",
        )

    async def _generate_all(
        self, tokenized: TokenizedRequest, ctx: RequestContext, requires_tokenizer: bool
    ) -> list[dict[str, Any]]:
        attempts = self.attempts(ctx.request_id, ctx.phases, ctx.trace)
        if len(tokenized.prompts) == 1:
            return [await attempts.run(tokenized, 0, requires_tokenizer)]
        # Prompts run concurrently; one failing prompt fails the request as a whole and cancels
        # the others (asyncio.gather would leave them generating, holding load, after we answer).
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(attempts.run(tokenized, i, requires_tokenizer))
                    for i in range(len(tokenized.prompts))
                ]
        except BaseExceptionGroup as group:
            raise first_error(group) from group
        return [t.result() for t in tasks]

    async def _derender(
        self, kind: TokenKind, body: dict[str, Any], ctx: RequestContext, tokenized: TokenizedRequest,
        responses: list[dict[str, Any]],
    ) -> dict[str, Any]:
        return await derender_full(
            self.render, self._model(body), kind, body, ctx.request_id, tokenized, responses, phases=ctx.phases,
            trace=ctx.trace,
        )

    async def _open(
        self, body: dict[str, Any], kind: TokenKind, tokenized: TokenizedRequest, requires_tokenizer: bool,
        response: Response, *, trigger_fanout: bool = False,
    ) -> EventStream | NativeStream | NativePromptsStream | dict[str, Any]:
        """Establish every engine stream of the request before the client sees a byte.

        The prompts open concurrently (their prefills overlap, as the non-streaming path runs
        them); the response is committed once, when every stream is established. The streams are
        the response's from the moment they are open (closed and aborted with its stack).
        """
        request_id, phases = response.ctx.request_id, response.ctx.phases
        attempts = self.attempts(request_id, phases, response.ctx.trace)
        attempts.trigger_fanout = trigger_fanout

        def opener(index: int) -> Callable[[LeaseGroup], Coroutine[Any, Any, OpenStream]]:
            return lambda leases: attempts.open(tokenized, index, requires_tokenizer, leases=leases)

        try:
            streams = await open_together([opener(i) for i in range(len(tokenized.prompts))], self.engines)
            for stream in streams:
                response.stack.push_async_callback(stream.aclose, self.engines)
        except TriggerMultiPromptStream:
            # RFC: Trigger 多 prompt 流式仍沿用原生链路. Nothing reached the client yet, and
            # open_together closed whatever had opened.
            pd_unfit = native_pd_ineligible(kind, body)
            # Pairs' own APIs serve it too, one prompt each (native_path._native_prompts).
            fleet_native = bool(self._native_routes(tokenized.model, pd_unfit, kind)) or (
                pd_unfit == "several_prompts" and self._splits(tokenized.model, kind))
            if fleet_native and not self.snapshot.render.obfuscation:
                return await self._native(kind, body, response, "trigger_multi_prompt_stream", tokenized=tokenized)
            # No native path for it here (a Trigger-only fleet whose engines serve no OpenAI API of
            # their own; nor with obfuscation on): rather than fail the
            # request, each prompt runs its own Trigger, merged as on Handoff. The fan-out is the
            # one every topology shares; nothing in it is Trigger-specific.
            self.counters.inc(metric_names.ROUTE_DECISIONS, model=tokenized.model, path="token_only",
                              reason="trigger_per_prompt")
            logger.info("route request_id=%s kind=%s path=token_only reason=trigger_per_prompt "
                        "result=fanout (no native path)", request_id, kind)
            return await self._open(body, kind, tokenized, requires_tokenizer, response, trigger_fanout=True)
        for prompt in tokenized.prompts:
            prompt.pack()  # held while the stream lasts, read again only by a relay
        n = int(body.get("n") or 1)
        public_id = f"chatcmpl-{request_id}" if kind == "chat" else f"cmpl-{request_id}"
        # RenderConfig.local_stream_detokenize: a plain stream's chunks derendered here, not by the sidecar.
        local = await stream_derenderer(self.snapshot.render, self.snapshot.models.get(tokenized.model), kind, body)
        return EventStream(
            attempts, local or self.render, self.stream_settings, kind, public_id, body, tokenized, streams,
            request_id=request_id,
            requires_tokenizer=requires_tokenizer, n=n, phases=phases, trace=response.ctx.trace,
        )
