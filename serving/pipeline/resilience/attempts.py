"""Attempts: one placement and execution of one prompt, and the bounded retry around them.

``AttemptPolicy`` is the one rule for both modes: what a failed attempt excludes from the next
and whether another attempt follows. ``Attempts`` runs the same loop and the same topology
opener for a non-streaming prompt (``run``: the opener's whole answer) and a streaming one
(``open``: an established ``OpenStream``), so the two modes cannot drift apart again.

The exclusion rule, after a failed attempt: every instance of its placement (union: the one;
P/D: both P and D), whichever instance the error names. The named instance's breaker already
heard the fault in the guarded leg; its partner is excluded too because a P/D failure can lie
in the pair (the KV transfer between them, a P whose KV D could not use) and the budget is small,
so the next attempt should be the most different one. Streaming used to exclude only the named
instance while non-streaming excluded both; both now exclude both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from serving.pipeline import metric_names
from serving.pipeline.engine.client import EngineClient
from serving.pipeline.engine.leg import EngineGuard, GenerateContext
from serving.pipeline.engine.requests import attempt_request_id, engine_request, resolved_max_tokens
from serving.pipeline.errors import EngineError, EngineLacksCapability, NoCapacity, TriggerMultiPromptStream
from serving.pipeline.exit_stack import ExitStack
from serving.pipeline.flow_control.admission import LeaseGroup
from serving.pipeline.metrics import RouterCounters
from serving.pipeline.phases import NO_PHASES, Phases
from serving.pipeline.placement.scheduler import Placement, Scheduler
from serving.pipeline.protocol import EventBatches, TopologyName
from serving.pipeline.render.tokenization import TokenizedPrompt, TokenizedRequest
from serving.pipeline.snapshot import FleetSnapshot, InstanceView
from serving.pipeline.streaming.fanout import first_error
from serving.pipeline.streaming.relay import RetryRequestPlan
from serving.pipeline.topologies.registry import TopologyRegistry
from serving.pipeline.tracing import NO_TRACE

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(frozen=True, slots=True)
class AttemptPolicy:
    """What a failed attempt excludes and whether the request tries again (both modes)."""

    max_attempts: int = 2  # engine attempts per prompt (or per relay), across instances

    def retries(self, exc: EngineError) -> bool:
        """A missing capability moves the whole request (native path), not the attempt."""
        return not isinstance(exc, EngineLacksCapability)

    def excluded_after(self, exc: EngineError, placement: Placement) -> frozenset[str]:
        """Instances the next attempt avoids after ``placement`` failed with ``exc``: all of them."""
        return frozenset(i.name for i in placement.instances)

    def excluded_after_stream_failure(self, instance: InstanceView) -> frozenset[str]:
        """A relay after an established stream failed mid-way avoids the instance that streamed
        (in P/D: D; P's leg was over and answered)."""
        return frozenset({instance.name})

    def excluded_after_restart(self, exc: EngineError) -> frozenset[str]:
        """A whole-request restart (nothing visible yet) avoids the instance the error names."""
        return frozenset({exc.instance})


@dataclass
class OpenStream:
    """One established engine stream (one attempt of one prompt): its engine, id and holds.

    ``stack`` holds the attempt's admission lease, load hold and HTTP stream, so a failed attempt
    releases them at once while the request relays on to a new one.
    """

    prompt_index: int
    instance: InstanceView
    request_id: str
    events: EventBatches
    stack: AsyncExitStack = field(default_factory=AsyncExitStack)
    attempt: int = 0
    topology: TopologyName = "union"
    finished: bool = False
    # The client's choice index when this stream continues one choice of an n > 1 request (a
    # relay: the engine calls it choice 0); None when its events carry the client's indexes.
    choice: int | None = None
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


async def open_together(
    openers: Sequence[Callable[[LeaseGroup], Coroutine[Any, Any, OpenStream]]], engines: EngineClient
) -> list[OpenStream]:
    """Run ``openers`` concurrently and return their streams in order, all or none.

    The streams of one response (the prompts of a multi-prompt stream, the choices a relay
    continues) open at once, so under Handoff their prefills overlap instead of queueing one
    after another; the caller commits the response only once every one is established (RFC: all
    generate streams ready before the client's response). The first failure cancels and awaits
    the others, closes (and aborts) whatever had opened, and is raised. Each opener gets the
    streams' one ``LeaseGroup``: their leases are taken one at a time (``admission_turn`` in the
    guarded leg), as if the streams opened one after another: only the first may wait for room,
    while its siblings hold nothing.
    """
    group = LeaseGroup()
    if len(openers) == 1:
        return [await openers[0](group)]
    tasks: list[asyncio.Task[OpenStream]] = []
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(opener(group)) for opener in openers]
    except BaseException as exc:
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is None:
                await t.result().aclose(engines)
        if isinstance(exc, BaseExceptionGroup):
            raise first_error(exc) from exc
        raise
    return [t.result() for t in tasks]


def context_room(
    snapshot: FleetSnapshot, scheduler: Scheduler, model: str, prompt_tokens: int, *, exclude: Collection[str] = ()
) -> int | None:
    """The output room the context budget grants a prompt: the smallest context among the
    instances its placement may end on (union or decode), minus the prompt. None: no such instance.

    The clamp must come before placement and charging (RFC: the scheduling budget and the
    engine's budget agree), when the chosen engine is not known yet: the smallest context is the
    one bound every candidate honours (vLLM wants ``--max-model-len`` equal across a model's
    instances; a fleet that differs gets the tightest). Instances that cannot hold the prompt
    plus one token are skipped, as placement skips them (``Attempts.too_small``).
    """
    contexts = [
        i.max_model_len for i in scheduler.pool(snapshot, model, exclude=exclude)
        if i.token_generate and i.role in ("union", "decode") and i.max_model_len > prompt_tokens
    ]
    return min(contexts) - prompt_tokens if contexts else None


def clamped_max_tokens(
    snapshot: FleetSnapshot, scheduler: Scheduler, model: str, request: Mapping[str, Any], prompt_tokens: int, *,
    exclude: Collection[str] = (),
) -> int:
    """``request``'s ``max_tokens`` resolved (render's omitted 16) and, with the context budget on,
    clamped to ``context_room``; the one value placement, admission, the rate-limit charge and the
    engine all see."""
    max_tokens = resolved_max_tokens(request)
    if snapshot.render.context_budget:
        room = context_room(snapshot, scheduler, model, prompt_tokens, exclude=exclude)
        if room is not None:
            max_tokens = max(1, min(max_tokens, room))
    return max_tokens


def requested_tokens(prompt: TokenizedPrompt, snapshot: FleetSnapshot, scheduler: Scheduler, model: str) -> int:
    """Prompt + max output per choice, as the context budget leaves it (``clamped_max_tokens``):
    what the request is charged, the number its placement and lease will use."""
    max_tokens = clamped_max_tokens(snapshot, scheduler, model, prompt.generate_request, len(prompt.token_ids))
    n = int(prompt.sampling_params.get("n") or 1)
    return len(prompt.token_ids) + max_tokens * n


@dataclass(frozen=True, slots=True)
class _Placed:
    """One token-only attempt, placed: where, its engine request and admission tokens, its recorder."""

    placement: Placement
    request: dict[str, Any]
    tokens: int
    phases: Phases
    ineligible: str


async def attempt_loop(
    attempts: range, excluded: set[str], place: Callable[[int], _T],
    run: Callable[[_T, int], Awaitable[_R]], failed: Callable[[EngineError, _T, int], Collection[str] | None],
    no_target: Callable[[], NoCapacity], *, unblamed: tuple[type[EngineError], ...] = (),
) -> _R:
    """The one attempt loop, of the token-only path and the native one.

    Each attempt: ``place`` it (avoiding ``excluded``; ``NoCapacity`` when nothing is left), then
    ``run`` it. After an engine failure ``failed`` names what the next attempt avoids (added to
    ``excluded``), or None when the failure is not retried and propagates. When the budget is
    spent or nothing is left to place, the last engine failure is raised (``unblamed`` ones, a
    breaker holding an instance off, only exclude), else ``no_target()``'s or placement's own.
    """
    last: EngineError | None = None
    for attempt in attempts:
        try:
            target = place(attempt)
        except NoCapacity:
            if last is not None:
                raise last from None
            raise
        try:
            return await run(target, attempt)
        except EngineError as exc:
            names = failed(exc, target, attempt)
            if names is None:
                raise
            excluded.update(names)
            if not isinstance(exc, unblamed):
                last = exc
    if last is not None:
        raise last
    raise no_target()


class Attempts:
    """Places and runs the attempts of one request's prompts within the policy's budget."""

    def __init__(
        self, snapshot: FleetSnapshot, guard: EngineGuard, topologies: TopologyRegistry, policy: AttemptPolicy,
        *, request_id: str, counters: RouterCounters | None = None, phases: Phases = NO_PHASES,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> None:
        self.snapshot = snapshot
        self.guard = guard
        self.topologies = topologies
        self.policy = policy
        self.request_id = request_id  # the client-facing id (logs)
        self.counters = counters or RouterCounters()  # the process's, for relays
        self.phases = phases  # the request's; each attempt's copy carries its topology
        self.trace = trace  # the request's trace headers, on every leg of every attempt and relay
        # Multi-prompt streams may run on Trigger (one Trigger run per prompt, merged): only once
        # the request found no native path (the RFC's route for them), never by default.
        self.trigger_fanout = False

    def budget(
        self, request: Mapping[str, Any], prompt_tokens: int, model: str, *, exclude: Collection[str] = ()
    ) -> tuple[int, int]:
        """The engine request's ``max_tokens`` and its tokens (prompt + max output per choice),
        before placement.

        ``max_tokens`` is resolved (render's omitted 16) and, with the context budget on, clamped
        to the room the candidates have (``context_room``); the engine request gets it in
        ``sampling_params`` (``engine_request``): placement scores, admission holds and the engine
        generates the same number.
        """
        max_tokens = clamped_max_tokens(
            self.snapshot, self.guard.scheduler, model, request, prompt_tokens, exclude=exclude
        )
        n = int((request.get("sampling_params") or {}).get("n") or 1)
        return max_tokens, prompt_tokens + max_tokens * n

    def too_small(self, prompt: TokenizedPrompt) -> set[str]:
        """Instances whose own context cannot hold the prompt plus one output token."""
        return {i.name for i in self.snapshot.instances if i.max_model_len <= len(prompt.token_ids)}

    async def run(self, tokenized: TokenizedRequest, index: int, requires_tokenizer: bool) -> dict[str, Any]:
        """Non-streaming generate of prompt ``index``; returns its GenerateResponse."""
        result = await self._attempts(tokenized, index, requires_tokenizer, stream=False)
        assert isinstance(result, dict)
        return result

    async def open(
        self, tokenized: TokenizedRequest, index: int, requires_tokenizer: bool, *,
        plan: RetryRequestPlan | None = None, exclude: Collection[str] = (), first_attempt: int = 0,
        leases: LeaseGroup | None = None,
    ) -> OpenStream:
        """Open one engine stream of prompt ``index`` (or of a relay ``plan``), established (HTTP 200);
        ``leases``: the group of the response's streams opened with it (``open_together``)."""
        result = await self._attempts(
            tokenized, index, requires_tokenizer, stream=True, plan=plan, exclude=exclude, first_attempt=first_attempt,
            leases=leases,
        )
        assert isinstance(result, OpenStream)
        return result

    async def _attempts(
        self, tokenized: TokenizedRequest, index: int, requires_tokenizer: bool, *, stream: bool,
        plan: RetryRequestPlan | None = None, exclude: Collection[str] = (), first_attempt: int = 0,
        leases: LeaseGroup | None = None,
    ) -> dict[str, Any] | OpenStream:
        """The attempts of both modes, through ``attempt_loop``: place, budget, run or open, and on
        an engine failure exclude what the policy says and try again while the budget lasts."""
        prompt = tokenized.prompts[index]
        token_ids = plan.replay_ids if plan is not None else prompt.token_ids
        excluded = self.too_small(prompt) | set(exclude)
        first = plan.attempt if plan is not None else first_attempt

        def place(attempt: int) -> _Placed:
            attempt_plan = replace(plan, attempt=attempt) if plan is not None else None
            base = attempt_plan.request() if attempt_plan is not None else prompt.generate_request
            # Clamped before placement: the scores, the lease and the engine see one budget.
            max_tokens, tokens = self.budget(base, len(token_ids), tokenized.model, exclude=excluded)
            ineligible = self.topologies.pd_ineligible(base)
            start = self.phases.now()
            # A relay is placed like any prompt (same scheduler, same topology rules): in P/D,
            # P and D both get the replay ids.
            placement = self.guard.scheduler.place(
                self.snapshot, tokenized.model, token_ids, tokens=tokens, exclude=excluded,
                requires_tokenizer=requires_tokenizer, pd_ineligible=ineligible,
            )
            phases = self.phases.placed(placement.topology)
            phases.observe(metric_names.PHASE_PLACEMENT, start)
            rid = attempt_plan.request_id if attempt_plan is not None else attempt_request_id(prompt.request_id, attempt)
            return _Placed(placement, engine_request(base, request_id=rid, max_tokens=max_tokens), tokens, phases,
                           ineligible)

        async def run(placed: _Placed, attempt: int) -> dict[str, Any] | OpenStream:
            placement = placed.placement
            if stream and placement.topology == "trigger" and len(tokenized.prompts) > 1 and not self.trigger_fanout:
                logger.info("route request_id=%s prompt=%d path=native reason=trigger_multi_prompt_stream instances=%s",
                            prompt.request_id, index, placement.names)
                raise TriggerMultiPromptStream("multi-prompt streaming on Trigger takes the native path")
            logger.info(
                "placement request_id=%s prompt=%d attempt=%d topology=%s instances=%s prefix_hit_blocks=%d tokens=%d "
                "stream=%s pd_ineligible=%s", placed.request["request_id"], index, attempt, placement.topology,
                placement.names, placement.prefix_hit_blocks, placed.tokens, str(stream).lower(), placed.ineligible or "-",
            )
            ctx = GenerateContext(
                self.guard, self.snapshot, self.request_id, prompt, index, attempt, placed.tokens, stream,
                phases=placed.phases, leases=leases, trace=self.trace,
            )
            return await self._open_attempt(ctx, placement, placed.request, index, attempt)

        def failed(exc: EngineError, placed: _Placed, attempt: int) -> frozenset[str] | None:
            if not self.policy.retries(exc):
                return None
            names = self.policy.excluded_after(exc, placed.placement)
            logger.warning("generate request_id=%s prompt=%d instances=%s topology=%s attempt=%d result=%s stream=%s",
                           placed.request["request_id"], index, ",".join(sorted(names)), placed.placement.topology,
                           attempt, type(exc).__name__, str(stream).lower())
            return names

        return await attempt_loop(
            range(first, first + self.policy.max_attempts), excluded, place, run, failed,
            lambda: NoCapacity(f"no engine instance can serve model {tokenized.model!r} right now"),
        )

    async def _open_attempt(
        self, ctx: GenerateContext, placement: Placement, engine_req: dict[str, Any], index: int, attempt: int
    ) -> dict[str, Any] | OpenStream:
        opener = self.topologies.openers.get(placement.topology)
        if opener is None:
            raise NoCapacity(f"no opener for topology {placement.topology!r}")
        # Per attempt: a failed attempt releases its holds now, not when the request ends.
        stack: AsyncExitStack = ExitStack()
        try:
            opened = await opener(ctx, placement, engine_req, stack)
        except BaseException:
            await stack.aclose()
            raise
        if opened.events is None:
            # The whole answer: nothing of the attempt outlives it.
            await stack.aclose()
            assert opened.response is not None
            return opened.response
        return OpenStream(
            index, opened.instance, opened.request_id, opened.events, stack=stack, attempt=attempt,
            topology=placement.topology,
        )
