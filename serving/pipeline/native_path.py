"""The native path: a request served on an engine's own OpenAI API, retried elsewhere within the budget.

Where it goes, best first: union instances' own API (least loaded), then P/D pairs' through
the vllm-ascend guide's proxy flow (``topologies/native_pd.py``) when the request fits a pair.
Never with obfuscation on (fail closed). Charged what the engine may really process
(``engine/native.NativeEstimate``). ``ServingPipeline`` (``service.py``) inherits this; the
attributes declared below are the pipeline's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any

from serving.pipeline import metric_names, request_checks
from serving.pipeline.engine.leg import BreakerOpen, EngineGuard, Reservation
from serving.pipeline.engine.native import NATIVE_HINTS, NATIVE_PATHS, NativeEstimate, NativeStream, prompt_bound
from serving.pipeline.errors import (
    EngineError,
    ModelNotFound,
    NoCapacity,
    RenderUnavailable,
    RequestError,
    UpstreamRequestError,
)
from serving.pipeline.metrics import RouterCounters
from serving.pipeline.placement.filters import has_native_pd, unpaired_native_pd
from serving.pipeline.placement.scheduler import Scheduler
from serving.pipeline.protocol import ApiKind
from serving.pipeline.render.client import RenderClient
from serving.pipeline.render.tokenization import RenderHealth, TokenizedRequest
from serving.pipeline.resilience.attempts import AttemptPolicy, attempt_loop
from serving.pipeline.response import Response
from serving.pipeline.snapshot import FleetSnapshot, InstanceView, ModelView
from serving.pipeline.streaming.fanout import first_error
from serving.pipeline.topologies.metaserver import process_metaserver
from serving.pipeline.topologies.native_pd import (
    NativeCall,
    NativePair,
    native_pairs,
    native_pd_ineligible,
    run_native_handoff,
    run_native_trigger,
)
from serving.pipeline.topologies.native_prompts import NativePromptsStream, merge_whole, split_prompts

logger = logging.getLogger(__name__)


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def _names(route: InstanceView | NativePair) -> tuple[str, ...]:
    return route.names if isinstance(route, NativePair) else (route.name,)


def _hint(reason: str) -> str:
    hint = NATIVE_HINTS.get(reason)
    return f": {hint}." if hint else ""


def _no_native_engine(model: str, reason: str, note: str = "", *, unpaired: str = "") -> NoCapacity:
    if unpaired:
        # Its P and D engines serve their own OpenAI API: they only form no pair.
        return NoCapacity(f"no engine can serve the native OpenAI API for model {model!r} ({reason}{note}): there is "
                          f"no union engine with its own OpenAI API, and {unpaired}, so no prefill/decode pair forms"
                          + _hint(reason))
    return NoCapacity(f"no engine serves the native OpenAI API for model {model!r} ({reason}{note})" + _hint(reason))


class NativePath:
    """The native path's half of ``ServingPipeline``."""

    snapshot: FleetSnapshot
    render: RenderClient
    scheduler: Scheduler
    policy: AttemptPolicy
    counters: RouterCounters
    render_health: RenderHealth
    guard: EngineGuard

    def _model(self, body: dict[str, Any]) -> ModelView:
        name = body.get("model") or ""
        model = self.snapshot.models.get(name)
        if model is None:
            raise ModelNotFound(str(name))
        return model

    async def _native(
        self, kind: ApiKind, body: dict[str, Any], response: Response, reason: str,
        *, tokenized: TokenizedRequest | None = None, render_tried: bool = False,
    ) -> dict[str, Any] | NativeStream | NativePromptsStream:
        """Serve ``body`` on an engine's own OpenAI API, retrying elsewhere within the budget.

        ``tokenized``: the request's prompts when render (or the local tokenizer) already made
        them; ``render_tried``: render was just found unusable, so it is not asked to count.
        """
        request_id, phases = response.ctx.request_id, response.ctx.phases
        model = self._model(body)
        phases.placed("native")  # the end-to-end phase's topology
        if self.snapshot.render.obfuscation:
            self.counters.inc(metric_names.ROUTE_DECISIONS, model=model.name, path="refused", reason=reason)
            logger.info("route request_id=%s kind=%s path=refused reason=%s", request_id, kind, reason)
            raise RequestError(
                f"This request needs the engine's own OpenAI API ({reason}), which is not available while "
                "token obfuscation is on." + _hint(reason),
            )
        unservable = request_checks.unservable(self.snapshot, model.name, reason, body, kind)
        if unservable is not None:
            if kind in ("chat", "completions"):
                # Render's 400 for a malformed body.
                await self._render_verdict(kind, body, request_id, response.ctx.trace)
            self.counters.inc(metric_names.ROUTE_DECISIONS, model=model.name, path="refused", reason=reason)
            logger.info("route request_id=%s kind=%s path=refused reason=%s", request_id, kind, reason)
            raise unservable
        # A P/D pair's own API serves what it can serve exactly (topologies/native_pd.py).
        pd_unfit = native_pd_ineligible(kind, body)
        # Several completion prompts where only pairs serve the native path: one pair run per prompt.
        split = pd_unfit == "several_prompts" and self._splits(model.name, kind)
        if not split and not self._native_routes(model.name, pd_unfit, kind):
            # Decided native, but no engine can take it now: no render call to count its prompt.
            self.counters.inc(metric_names.ROUTE_DECISIONS, model=model.name, path="native", reason=reason)
            logger.info("route request_id=%s kind=%s path=native reason=%s result=no_engine", request_id, kind, reason)
            raise self._no_route(model.name, reason, pd_unfit, kind)
        # Charged what the engine may really process: prompt tokens plus n x the output bound it
        # will resolve (engine/native.NativeEstimate), per instance context length.
        estimate = await self._native_estimate(kind, body, request_id, tokenized, render_tried, response.ctx.trace)
        charge = estimate.tokens(model.max_model_len)
        self.counters.inc(metric_names.ROUTE_DECISIONS, model=model.name, path="native", reason=reason)
        logger.info("route request_id=%s kind=%s path=native reason=%s prompt_tokens=%d counted_by=%s tokens=%d",
                    request_id, kind, reason, sum(estimate.prompts), estimate.source, charge)
        # Charged here too (once per request: a request that moved from token-only is not charged twice).
        await response.charge(charge)
        if split:
            return await self._native_prompts(kind, body, request_id, reason, model.name, estimate, response.ctx.trace)
        return await self._native_attempts(
            kind, body, request_id, reason, model.name, pd_unfit, estimate, response.ctx.trace
        )

    async def _native_attempts(
        self, kind: ApiKind, body: dict[str, Any], request_id: str, reason: str, model: str, pd_unfit: str,
        estimate: NativeEstimate, trace: Mapping[str, str],
    ) -> dict[str, Any] | NativeStream:
        """The attempts (``attempt_loop``): the best native route now, elsewhere after a failure,
        within the budget. A pair is left whole, as the token-only attempt policy leaves one: the
        fault may lie between P and D (the KV transfer)."""
        excluded: set[str] = set()

        def place(attempt: int) -> InstanceView | NativePair:
            routes = self._native_routes(model, pd_unfit, kind, exclude=excluded)
            if not routes:
                raise self._no_route(model, reason, pd_unfit, kind)
            return routes[0]

        async def run(route: InstanceView | NativePair, attempt: int) -> dict[str, Any] | NativeStream:
            # The instance that answers the client: the union one, or the pair's decode side.
            instance = route.decode if isinstance(route, NativePair) else route
            start = time.perf_counter()
            stack = AsyncExitStack()
            try:
                if isinstance(route, NativePair) and route.transfer == "push":
                    result = await run_native_trigger(
                        self._native_call(kind, trace), route, kind, body, f"{request_id}-{attempt}",
                        metaserver=process_metaserver(), prompt_tokens=sum(estimate.prompts),
                        tokens=estimate.tokens(instance.max_model_len),
                        max_output=estimate.output(instance.max_model_len), stack=stack,
                    )
                elif isinstance(route, NativePair):
                    result = await run_native_handoff(
                        self._native_call(kind, trace), self.guard.reserve, route, kind, body,
                        f"{request_id}-{attempt}",
                        prompt_tokens=sum(estimate.prompts), tokens=estimate.tokens(instance.max_model_len),
                        max_output=estimate.output(instance.max_model_len), stack=stack,
                    )
                else:
                    result = await self.guard.native(
                        instance, kind, body, request_id, tokens=estimate.tokens(instance.max_model_len),
                        max_output=estimate.output(instance.max_model_len), stack=stack, trace=trace,
                    )
            except BaseException:
                await stack.aclose()
                raise
            logger.info("native request_id=%s instance=%s attempt=%d result=ok latency_ms=%.1f",
                        request_id, ",".join(_names(route)), attempt, _ms(start))
            if not isinstance(result, NativeStream):
                await stack.aclose()
            return result

        def failed(exc: EngineError, route: InstanceView | NativePair, attempt: int) -> tuple[str, ...]:
            # Busy, lacking the capability or failed (the guard told the breaker which): elsewhere.
            # A breaker holding it off (a raced half-open probe slot) is not this request's failure.
            if not isinstance(exc, BreakerOpen):
                logger.warning("native request_id=%s instance=%s attempt=%d result=%s", request_id,
                               ",".join(_names(route)), attempt, type(exc).__name__)
            return _names(route)

        return await attempt_loop(
            range(self.policy.max_attempts), excluded, place, run, failed,
            lambda: self._no_route(model, reason, pd_unfit, kind), unblamed=(BreakerOpen,),
        )

    async def _native_prompts(
        self, kind: ApiKind, body: dict[str, Any], request_id: str, reason: str, model: str,
        estimate: NativeEstimate, trace: Mapping[str, str],
    ) -> dict[str, Any] | NativePromptsStream:
        """Several completion prompts on P/D pairs: one pair run per prompt, concurrently, merged
        as vLLM answers the multi-prompt completion (``topologies/native_prompts.py``). A failing
        prompt cancels the others; every leg that opened is closed before the error propagates."""
        bodies = split_prompts(body)
        per_prompt = (
            [replace(estimate, prompts=(p,)) for p in estimate.prompts] if len(estimate.prompts) == len(bodies)
            else [NativeEstimate.of(kind, b, prompt_bound(kind, b), "bound") for b in bodies]
        )
        tasks: list[asyncio.Task[dict[str, Any] | NativeStream]] = []
        try:
            async with asyncio.TaskGroup() as tg:
                for i, (leg_body, leg_estimate) in enumerate(zip(bodies, per_prompt, strict=True)):
                    tasks.append(tg.create_task(self._native_attempts(
                        kind, leg_body, f"{request_id}-{i}", reason, model, "", leg_estimate, trace,
                    )))
        except BaseException as exc:
            # Cancelled by the client or failed: the legs already open hold admission and a connection.
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is None:
                    opened = task.result()
                    if isinstance(opened, NativeStream):
                        await opened.aclose()
            if isinstance(exc, BaseExceptionGroup):
                raise first_error(exc) from exc
            raise
        results = [t.result() for t in tasks]
        n = int(body.get("n") or 1)
        logger.info("native request_id=%s prompts=%d result=ok split=per_prompt", request_id, len(bodies))
        streams = [r for r in results if isinstance(r, NativeStream)]
        if streams:
            return NativePromptsStream(request_id, streams, n)
        return merge_whole([r for r in results if isinstance(r, dict)], n)

    def _native_routes(
        self, model: str, pd_unfit: str, kind: ApiKind, *, exclude: Collection[str] = ()
    ) -> list[InstanceView | NativePair]:
        """Where the native path may go now, best first: union instances' own API (least loaded),
        then P/D pairs' (the guide's proxy flow) when the request fits a pair; only engines whose
        probe found ``kind``'s route and a tokenizer (``InstanceView.serves_native``)."""
        routes: list[InstanceView | NativePair] = list(
            self.scheduler.native_candidates(self.snapshot, model, exclude=exclude, kind=kind)
        )
        if not pd_unfit:
            load = self.scheduler.load.inflight
            routes += native_pairs(
                self.snapshot, model, live=self.scheduler.eligible, exclude=exclude,
                load=lambda i: load(i.name) / max(i.weight, 1), kind=kind,
            )
        return routes

    def _splits(self, model: str, kind: ApiKind) -> bool:
        """Whether a body of several prompts goes per prompt through P/D pairs: no union instance
        takes it whole now, and some pair takes a single prompt."""
        return (not self.scheduler.native_candidates(self.snapshot, model, kind=kind)
                and bool(self._native_routes(model, "", kind)))

    def _no_route(self, model: str, reason: str, pd_unfit: str, kind: ApiKind) -> NoCapacity:
        """The 503 when no native route is left: why pairs are out, when that is the reason."""
        unpaired = "" if any(i.serves(model) and i.role == "union" and i.serves_native(kind)
                             for i in self.snapshot.instances) else unpaired_native_pd(self.snapshot, model, kind)
        note = self._pd_unfit_note(model, pd_unfit)
        if any(i.serves(model) and i.native_openai and not i.serves_native(kind) for i in self.snapshot.instances):
            # Some engine serves its own API, only not this route (an older vLLM): say which.
            note += f"; no engine of this model serves {NATIVE_PATHS[kind]}"
        return _no_native_engine(model, reason, note, unpaired=unpaired)

    def _pd_unfit_note(self, model: str, pd_unfit: str) -> str:
        """What the 503 adds when only P/D pairs serve the native path and this request fits none."""
        if pd_unfit and has_native_pd(self.snapshot, model):
            return f"; prefill/decode pairs cannot serve it exactly ({pd_unfit})"
        return ""

    def _native_call(self, kind: ApiKind, trace: Mapping[str, str]) -> NativeCall:
        """One guarded leg of a native P/D run (breaker, admission, load, the reply's deadline)."""

        async def call(
            instance: InstanceView, body: dict[str, Any], leg_id: str, tokens: int, max_output: int | None,
            stack: AsyncExitStack, reserved: Reservation | None,
        ) -> dict[str, Any] | NativeStream:
            return await self.guard.native(
                instance, kind, body, leg_id, tokens=tokens, max_output=max_output, stack=stack, reserved=reserved,
                trace=trace,
            )

        return call

    async def _native_estimate(
        self, kind: ApiKind, body: dict[str, Any], request_id: str, tokenized: TokenizedRequest | None,
        render_tried: bool, trace: Mapping[str, str],
    ) -> NativeEstimate:
        """The request's prompt tokens (render's count where it can give one, else a bound from the
        body's size) and output bound. Render is asked for a count only: its verdict on the body
        never replaces the engine's (a Responses request naming a response only the engine
        stored is a 4xx to render), and a sidecar that cannot answer costs a fallback, no error."""
        if tokenized is not None:
            counts = [len(p.token_ids) for p in tokenized.prompts]
            return NativeEstimate.of(kind, body, counts, tokenized.tokenizer_source)
        # A sidecar below the token-in floor (0.23) has no render route to count with.
        if (not render_tried and self.snapshot.render.enable and self.snapshot.render.token_in
                and not self.render_health.skip()):
            try:
                counts = await self.render.prompt_lengths(kind, body, request_id, trace)
            except RenderUnavailable as exc:
                self.render_health.mark(exc)
            except UpstreamRequestError:
                pass  # the engine's own API judges the body; the estimate falls back to its size
            else:
                self.render_health.mark(None)
                return NativeEstimate.of(kind, body, counts, "render")
        return NativeEstimate.of(kind, body, prompt_bound(kind, body), "bound")

    async def _render_verdict(
        self, kind: ApiKind, body: dict[str, Any], request_id: str, trace: Mapping[str, str]
    ) -> None:
        """Let render judge ``body`` (vLLM's own schema and validators): its 4xx propagates; an
        unusable sidecar has no verdict, and the caller's answer stands."""
        if not self.snapshot.render.enable or not self.snapshot.render.token_in or self.render_health.skip():
            return
        try:
            if kind == "chat":
                await self.render.render_chat(body, request_id, trace)
            else:
                await self.render.render_completions(body, request_id, trace)
        except RenderUnavailable as exc:
            self.render_health.mark(exc)
