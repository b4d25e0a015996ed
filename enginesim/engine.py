"""The simulated engine: admission checks, generation loop, abort registry, stats.

One :class:`Generation` per generate request decodes its n choices in lock step (one
token per live choice per step, in index order), like a real engine batch, and yields a
:class:`ChoiceDelta` per choice per step. HTTP framing lives in ``generate.py`` (routes in ``app.py``).
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from enginesim.config import SimConfig
from enginesim.errors import SimError, bad_request
from enginesim.faults import FaultQueue
from enginesim.kvcache import EventPublisher, PrefixCache
from enginesim.model import TokenLogprobs, TokenModel
from enginesim.pd import KVTransfer
from enginesim.protocol import GenerateRequest
from enginesim.scripts import ScriptBook


@dataclass(frozen=True, slots=True)
class ResolvedParams:
    """Sampling parameters after vLLM's defaulting, as the decode loop uses them."""

    n: int
    max_tokens: int
    min_tokens: int
    # Ids that end a sequence: stop_token_ids plus the eos ids unless ignore_eos (a
    # tokens-only vLLM has no tokenizer eos, so generation_config's eos is a stop id).
    stop_token_ids: frozenset[int]
    logprobs: int | None


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """What one step produced for one choice."""

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None
    finish_reason: str | None
    stop_reason: int | None


@dataclass(slots=True)
class _Choice:
    index: int
    context: list[int]
    state: int
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass(slots=True)
class SimStats:
    """Counters behind ``GET /sim/stats`` and ``GET /metrics``."""

    requests_received: int = 0
    active_streams: int = 0
    # Requests hit by an abort while running (not ids, not choices).
    aborted: int = 0
    # Streams or non-streaming requests that ended because the client went away.
    disconnects: int = 0
    last_token_ids: list[int] | None = None
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    # vLLM's prompt_tokens_by_source: local_compute, local_cache_hit, external_kv_transfer.
    prompt_tokens_by_source: Counter[str] = field(default_factory=Counter)
    # The X-Request-Id header of the latest generate requests, oldest first (None: none sent), so a
    # test can see which id each leg was sent under; bounded, a benchmark sends thousands.
    x_request_ids: deque[str | None] = field(default_factory=lambda: deque(maxlen=256))
    # The W3C ``traceparent`` of the same requests (None: none sent), the trace header vLLM reads.
    traceparents: deque[str | None] = field(default_factory=lambda: deque(maxlen=256))
    # Calls of the engine's own OpenAI API by kind (chat, completions, messages, responses),
    # counted on arrival: also those a --tokens-only engine refuses.
    native_requests: Counter[str] = field(default_factory=Counter)

    def as_json(self, running: int) -> dict[str, object]:
        return {
            "requests_received": self.requests_received,
            "active_streams": self.active_streams,
            "aborted": self.aborted,
            "last_token_ids": self.last_token_ids,
            "disconnects": self.disconnects,
            "running": running,
            "finished": dict(self.finished),
            "x_request_ids": list(self.x_request_ids),
            "traceparents": list(self.traceparents),
            "native_requests": dict(self.native_requests),
        }


class Generation:
    """One admitted request: n choices decoded with the configured latency."""

    def __init__(
        self,
        *,
        engine_request_id: str,
        prompt: Sequence[int],
        params: ResolvedParams,
        model: TokenModel,
        scripts: ScriptBook,
        config: SimConfig,
        ttft_seconds: float,
    ) -> None:
        self.engine_request_id = engine_request_id
        self.prompt = tuple(prompt)
        self.params = params
        self.aborted = asyncio.Event()
        self._model = model
        self._scripts = scripts
        self._config = config
        self._ttft = ttft_seconds
        state = model.state(self.prompt)
        self.choices = [
            _Choice(index=i, context=list(self.prompt), state=state) for i in range(params.n)
        ]
        self._first_tokens: set[int] = set()
        # Prompt tokens found in the prefix cache when the request started.
        self.cached_tokens = 0

    def abort(self) -> None:
        self.aborted.set()

    async def _pause(self, seconds: float) -> None:
        # Even a zero pause yields to the loop, so an abort request or a disconnect can be
        # handled between tokens of a burst; an abort cuts a longer pause short.
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        try:
            await asyncio.wait_for(self.aborted.wait(), seconds)
        except TimeoutError:
            pass

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Per step, one delta per live choice; a finished choice's last delta says why."""
        await self._pause(self._ttft)
        live = list(self.choices)
        while live:
            if self.aborted.is_set():
                for choice in live:
                    choice.finish_reason = "abort"
                    yield ChoiceDelta(choice.index, (), None, "abort", None)
                return
            for choice in live:
                yield self._step(choice)
            live = [c for c in live if c.finish_reason is None]
            if live:
                await self._pause(self._config.tpot_seconds())

    def _step(self, choice: _Choice) -> ChoiceDelta:
        params = self.params
        first = not choice.output
        # vLLM's min_tokens processor masks every stop id until min_tokens are out.
        banned: frozenset[int] | set[int] = (
            params.stop_token_ids if len(choice.output) < params.min_tokens else frozenset()
        )
        if first and choice.index > 0:
            # Choices differ from their first token on; later tokens depend on the
            # context only, so a replay of choice i (with >= 1 output) continues it.
            banned = set(banned) | self._first_tokens
        token = self._scripts.next_token(choice.context) if self._scripts else None
        if token is None:
            token = self._model.sample(
                choice.state, salt=choice.index if first else 0, banned=banned
            )
        logprobs = None
        if params.logprobs is not None:
            k = self._config.vocab_size if params.logprobs == -1 else params.logprobs
            logprobs = (self._model.logprobs(choice.state, token, k),)
        choice.context.append(token)
        choice.output.append(token)
        choice.state = self._model.advance(choice.state, token)
        if first:
            self._first_tokens.add(token)
        self._check_stop(choice)
        return ChoiceDelta(
            choice.index, (token,), logprobs, choice.finish_reason, choice.stop_reason
        )

    def _check_stop(self, choice: _Choice) -> None:
        # Same order as vLLM's check_stop: stop ids (after min_tokens), then length.
        count = len(choice.output)
        last = choice.output[-1]
        if count >= self.params.min_tokens and last in self.params.stop_token_ids:
            choice.finish_reason, choice.stop_reason = "stop", last
        elif count >= self.params.max_tokens or len(choice.context) >= self._config.max_model_len:
            choice.finish_reason = "length"


class SimEngine:
    """Process-wide simulator state shared by all requests."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.model = TokenModel(
            seed=config.seed,
            vocab_size=config.vocab_size,
            eos_token_id=config.eos_token_id,
            eos_probability=config.eos_probability,
            special_token_ids=config.special_token_ids,
            sampleable_limit=config.sampleable_limit,
        )
        self.scripts = ScriptBook()
        self.faults = FaultQueue()
        self.stats = SimStats()
        self._running: dict[str, set[Generation]] = {}
        publisher = (
            EventPublisher(config.kv_events_endpoint, config.kv_events_topic)
            if config.kv_events_endpoint
            else None
        )
        self.cache = PrefixCache(config.block_size, config.cache_blocks, publisher)
        self.kv = KVTransfer(
            block_size=config.block_size,
            hold_seconds=config.kv_hold_seconds,
            push_timeout_seconds=config.kv_push_timeout_seconds,
            host=config.host,
            port=config.port,
            engine_id=config.kv_engine_id,
        )

    async def aclose(self) -> None:
        await self.kv.aclose()
        if self.cache.publisher is not None:
            self.cache.publisher.close()

    # -- checks ---------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.config.served_model_names:
            raise SimError(
                f"The model `{model}` does not exist.", status=404, type="NotFoundError", param="model"
            )

    def admit(self, request: GenerateRequest) -> None:
        """Checks vLLM runs before answering (errors are JSON even when streaming)."""
        sp = request.sampling_params
        if sp.n > self.config.max_num_seqs:
            raise bad_request(
                f"sampling_params.n must be at most the server's max_num_seqs "
                f"({self.config.max_num_seqs}), got {sp.n}."
            )
        if request.stream and sp.prompt_logprob_token_ids is not None:
            raise bad_request("prompt_logprob_token_ids is not supported with stream=True.")
        if sp.stop_strings():
            raise bad_request(
                "stop strings are not supported on a --tokens-only server (no tokenizer is "
                "loaded); use stop_token_ids instead."
            )
        if request.output_mode != "tokens":
            raise bad_request(
                f"output_mode={request.output_mode!r} requires a tokenizer; this is a "
                "--tokens-only server."
            )

    def validate(self, request: GenerateRequest) -> None:
        """Engine-level checks: 400 JSON when not streaming, in-band when streaming."""
        prompt_len = len(request.token_ids)
        max_len = self.config.max_model_len
        if prompt_len >= max_len:
            # Equal is refused too: there would be no room for one output token.
            detail = "is longer than" if prompt_len > max_len else "leaves no room for output within"
            raise bad_request(
                f"The decoder prompt (length {prompt_len}) {detail} the maximum model length "
                f"of {max_len}. Make sure that `max_model_len` is no smaller than the number "
                f"of text tokens. (parameter=input_tokens, value={prompt_len})",
                param="input_tokens",
            )
        top = max(request.token_ids)
        if top >= self.config.vocab_size:
            # A tokens-only vLLM has no tokenizer to check against and dies on such ids;
            # the simulator refuses them the way a tokenizer-loaded vLLM does.
            raise bad_request(f"Token id {top} is out of vocabulary", param="token_ids")
        sp = request.sampling_params
        if sp.logprobs is not None:
            wanted = self.config.vocab_size if sp.logprobs == -1 else sp.logprobs
            limit = self.config.max_logprobs
            if limit != -1 and wanted > limit:
                raise bad_request(
                    f"Requested sample logprobs of {wanted}, which is greater than max "
                    f"allowed: {limit}",
                    param="logprobs",
                )
        if sp.structured_outputs is not None:
            raise bad_request(
                "Structured outputs requires a tokenizer so it can't be used with "
                "'skip_tokenizer_init'"
            )

    def resolve(self, request: GenerateRequest) -> ResolvedParams:
        sp = request.sampling_params
        remaining = self.config.max_model_len - len(request.token_ids)
        if request.max_tokens_provided():
            assert sp.max_tokens is not None
            # Not clamped: the decode loop stops at the context end with "length".
            max_tokens = sp.max_tokens
        else:
            # vLLM re-defaults a missing max_tokens to the remaining context (or the
            # generation config's max_new_tokens when smaller).
            max_tokens = remaining
            if self.config.default_max_new_tokens is not None:
                max_tokens = min(max_tokens, self.config.default_max_new_tokens)
        stop_ids = set(sp.stop_token_ids or ())
        if not sp.ignore_eos:
            stop_ids.update(self.config.eos_token_ids)
        return ResolvedParams(
            n=sp.n,
            max_tokens=max(max_tokens, 1),
            min_tokens=sp.min_tokens,
            stop_token_ids=frozenset(stop_ids),
            logprobs=sp.logprobs,
        )

    # -- lifecycle ------------------------------------------------------------------------

    def start(
        self,
        engine_request_id: str,
        request: GenerateRequest,
        *,
        remote_kv: bool = False,
        aborted: bool = False,
    ) -> Generation:
        """Create and register a generation; pair with :meth:`finish` in a ``finally``.

        Only prompt tokens not found in the prefix cache cost prefill time; with
        ``remote_kv`` (a decode instance that received the KV) none do. ``aborted`` starts
        a request aborted while it waited for remote KV: it ends at once with "abort".
        """
        prompt = request.token_ids
        cached = self.cache.cached_tokens(prompt)
        external = len(prompt) - cached if remote_kv else 0
        uncached = 0 if aborted else len(prompt) - cached - external
        if not aborted:
            # The prompt's blocks are in the cache from now on (vLLM caches them as the
            # prefill fills them); received blocks too, like a real decode engine. An
            # aborted wait computed and received nothing, so it caches nothing.
            self.cache.store(prompt)
        generation = Generation(
            engine_request_id=engine_request_id,
            prompt=prompt,
            params=self.resolve(request),
            model=self.model,
            scripts=self.scripts,
            config=self.config,
            ttft_seconds=self.config.ttft_seconds(uncached),
        )
        generation.cached_tokens = cached
        if aborted:
            generation.abort()
        self._running.setdefault(engine_request_id, set()).add(generation)
        self.stats.prompt_tokens_total += len(generation.prompt)
        by_source = self.stats.prompt_tokens_by_source
        by_source["local_compute"] += uncached
        by_source["local_cache_hit"] += cached
        by_source["external_kv_transfer"] += external
        return generation

    def finish(self, generation: Generation) -> None:
        group = self._running.get(generation.engine_request_id)
        if group is not None:
            group.discard(generation)
            if not group:
                del self._running[generation.engine_request_id]
        first = generation.choices[0] if generation.choices else None
        if first is not None and len(first.output) > 1:
            # Output blocks are cached too; the last sampled token has no KV yet.
            self.cache.store(first.context[:-1])
        for choice in generation.choices:
            self.stats.generation_tokens_total += len(choice.output)
            if choice.finish_reason is not None:
                self.stats.finished[choice.finish_reason] += 1

    def abort(self, engine_request_ids: Sequence[str]) -> int:
        """Abort every running request with one of these ids, and every one still waiting
        for a KV push (it then starts aborted); unknown ids are ignored."""
        hit = 0
        for rid in engine_request_ids:
            hit += self.kv.abort_waiting(rid)
            for generation in self._running.get(rid, ()):
                if not generation.aborted.is_set():
                    generation.abort()
                    hit += 1
        self.stats.aborted += hit
        return hit

    @property
    def running(self) -> int:
        return sum(len(g) for g in self._running.values())
