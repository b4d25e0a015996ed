"""Render -> place -> generate -> derender for one OpenAI request, streaming or not.

``ServingPipeline`` is built per request from the fleet snapshot and the process-wide clients;
it holds no state of its own between requests. Streaming responses are returned as an
``EventStream`` whose engine streams are already established (HTTP 200 from every engine), so
a failure before that still gets a proper status instead of a broken 200.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from serving.pipeline.errors import EngineError, MotorError, error_body
from serving.pipeline.render.client import RenderClient
from serving.pipeline.router.engine_client import EngineClient
from serving.pipeline.router.scheduler import Scheduler
from serving.pipeline.router.token_only import engine_request, sorted_choices
from serving.pipeline.snapshot import FleetSnapshot, InstanceView
from serving.pipeline.sse import DONE, frame

logger = logging.getLogger(__name__)

GENERATE_PREFIX = "generate-tokens-"
# Bounded queue between per-prompt producers and the client: a slow reader makes producers wait.
MERGE_QUEUE_SIZE = 64


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


@dataclass
class OpenStream:
    """One established engine stream of a request: its prompt, engine and id."""

    prompt_index: int
    instance: InstanceView
    request_id: str
    events: AsyncIterator[dict[str, Any]]
    finished: bool = False


@dataclass
class EventStream:
    """The SSE body of a streaming response; owns the engine streams until it is closed."""

    pipeline: ServingPipeline
    kind: str  # "chat" | "completions"
    public_id: str
    body: dict[str, Any]
    prompts: list[list[int]]
    streams: list[OpenStream]
    stack: AsyncExitStack
    n: int = 1
    _started: bool = field(default=False, init=False)
    _closed: bool = field(default=False, init=False)

    @property
    def started(self) -> bool:
        """Whether ``frames()`` ran; from then on its ``finally`` closes the engine streams."""
        return self._started

    async def frames(self) -> AsyncIterator[bytes]:
        self._started = True
        start = time.perf_counter()
        outcome = "ok"
        source = self._derendered(self.streams[0]) if len(self.streams) == 1 else self._merged()
        try:
            # aclosing: when the client leaves mid-stream (GeneratorExit here), the source must be
            # closed now, so _merged cancels its producers before the engine streams are closed.
            async with aclosing(source) as chunks:
                async for chunk in chunks:
                    yield frame(chunk)
        except MotorError as exc:
            # After the first frame the status is already 200: an error frame, then [DONE].
            outcome = type(exc).__name__
            yield frame(error_body(exc)[1])
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except GeneratorExit:
            outcome = "closed"
            raise
        finally:
            await self.aclose()
            logger.info(
                "response request_id=%s kind=%s stream=true result=%s latency_ms=%.1f",
                self.public_id, self.kind, outcome, _ms(start),
            )
        yield DONE

    async def _derendered(self, stream: OpenStream, *, remap: bool = False) -> AsyncIterator[dict[str, Any]]:
        """Derender one engine stream chunk by chunk, one committed state per choice."""
        render = self.pipeline.render
        states: dict[int, dict[str, Any] | None] = {}
        prompt_ids = self.prompts[stream.prompt_index]
        async for event in stream.events:
            choices = event.get("choices") or []
            index = choices[0].get("index", 0) if choices else -1
            chunk, next_state = await render.derender_chunk(
                self.kind, event, stream_state=states.get(index), prompt_token_ids=prompt_ids,
                request=self.body, model=self.body.get("model"),
            )
            chunk["id"] = self.public_id
            if remap:
                for c in chunk.get("choices") or []:
                    c["index"] = stream.prompt_index * self.n + c.get("index", 0)
            yield chunk
            # Commit only after the chunk was handed on (architecture invariant 2).
            if choices:
                states[index] = next_state
        stream.finished = True

    async def _merged(self) -> AsyncIterator[dict[str, Any]]:
        """Fan-in of per-prompt streams: global choice index, one merged usage chunk."""
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(MERGE_QUEUE_SIZE)
        usage: dict[str, int] = {}
        usage_template: dict[str, Any] | None = None

        async def produce(stream: OpenStream) -> None:
            async with aclosing(self._derendered(stream, remap=True)) as chunks:
                async for chunk in chunks:
                    await queue.put(chunk)

        async def run_all() -> None:
            try:
                async with asyncio.TaskGroup() as tg:
                    for s in self.streams:
                        tg.create_task(produce(s))
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
            if isinstance(exc, BaseExceptionGroup):
                raise _first_motor_error(exc) from exc
            raise
        if usage_template is not None:
            yield {**usage_template, "usage": {**usage_template["usage"], **usage}}

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        unfinished = [s for s in self.streams if not s.finished]
        try:
            await self.stack.aclose()
        finally:
            for s in unfinished:
                # The client left or the stream failed: free the engine's slot now.
                await self.pipeline.engines.abort(s.instance, [s.request_id])


def _first_motor_error(group: BaseExceptionGroup) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_motor_error(exc)
        return exc
    return group


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
    ) -> None:
        self.snapshot = snapshot
        self.render = render
        self.engines = engines
        self.scheduler = scheduler
        self.max_attempts = max_attempts

    async def chat(self, body: dict[str, Any], request_id: str) -> dict[str, Any] | EventStream:
        model = body.get("model") or ""
        start = time.perf_counter()
        rendered = await self.render.render_chat(body, request_id)
        self._log_render(request_id, model, [rendered], start)
        public_id = f"chatcmpl-{request_id}"
        if body.get("stream"):
            return await self._open(body, "chat", public_id, model, [rendered])
        response = await self._generate(model, rendered, 0, request_id)
        start = time.perf_counter()
        out = await self.render.derender_chat(
            response, prompt_token_ids=rendered["token_ids"], chat_request=body, model=body.get("model")
        )
        logger.info("derender request_id=%s kind=chat result=ok latency_ms=%.1f", request_id, _ms(start))
        out["id"] = public_id
        return out

    async def completions(self, body: dict[str, Any], request_id: str) -> dict[str, Any] | EventStream:
        model = body.get("model") or ""
        start = time.perf_counter()
        rendered = await self.render.render_completions(body, request_id)
        self._log_render(request_id, model, rendered, start)
        public_id = f"cmpl-{request_id}"
        if body.get("stream"):
            return await self._open(body, "completions", public_id, model, rendered)
        # Prompts run concurrently; one failing prompt fails the request as a whole and cancels
        # the others (asyncio.gather would leave them generating, holding load, after we answer).
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._generate(model, r, i, request_id)) for i, r in enumerate(rendered)]
        except BaseExceptionGroup as group:
            raise _first_motor_error(group) from group
        responses = [t.result() for t in tasks]
        start = time.perf_counter()
        out = await self.render.derender_completions(
            [sorted_choices(r) for r in responses],
            prompt_token_ids=[r["token_ids"] for r in rendered],
            completion_request=body,
            model=body.get("model"),
        )
        logger.info("derender request_id=%s kind=completions result=ok latency_ms=%.1f", request_id, _ms(start))
        out["id"] = public_id
        return out

    def _log_render(self, request_id: str, model: str, rendered: list[dict[str, Any]], start: float) -> None:
        logger.info(
            "render request_id=%s model=%s prompts=%d prompt_tokens=%d latency_ms=%.1f tokenizer_source=render",
            request_id, model, len(rendered), sum(len(r["token_ids"]) for r in rendered), _ms(start),
        )

    async def _generate(self, model: str, rendered: dict[str, Any], prompt_index: int, request_id: str) -> dict[str, Any]:
        """Non-streaming generate with a bounded retry on another instance after an engine failure."""
        failed: set[str] = set()
        for attempt in range(self.max_attempts):
            instance = self.scheduler.pick_union(self.snapshot, model, exclude=failed)
            # Every attempt has its own engine id, so aborting one can never hit its successor.
            rid = rendered["request_id"] if attempt == 0 else f"{rendered['request_id']}-a{attempt}"
            start = time.perf_counter()
            try:
                with self.scheduler.load.hold(instance):
                    response = await self.engines.generate(instance, engine_request(rendered, request_id=rid))
            except EngineError as exc:
                logger.warning(
                    "generate request_id=%s prompt=%d instance=%s phase=union attempt=%d result=%s latency_ms=%.1f: %s",
                    request_id, prompt_index, instance.name, attempt, type(exc).__name__, _ms(start), exc.message,
                )
                failed.add(instance.name)
                if attempt + 1 == self.max_attempts:
                    raise
                continue
            logger.info(
                "generate request_id=%s prompt=%d instance=%s phase=union attempt=%d result=ok latency_ms=%.1f",
                request_id, prompt_index, instance.name, attempt, _ms(start),
            )
            return response
        raise AssertionError("unreachable: the loop returns or raises")

    async def _open(
        self, body: dict[str, Any], kind: str, public_id: str, model: str, rendered: list[dict[str, Any]]
    ) -> EventStream:
        """Establish every engine stream of the request before the client sees a byte."""
        stack = AsyncExitStack()
        streams: list[OpenStream] = []
        try:
            for index, r in enumerate(rendered):
                streams.append(await self._open_one(stack, model, r, index))
        except BaseException:
            for s in streams:
                await self.engines.abort(s.instance, [s.request_id])
            await stack.aclose()
            raise
        n = int(body.get("n") or 1)
        return EventStream(self, kind, public_id, body, [r["token_ids"] for r in rendered], streams, stack, n=n)

    async def _open_one(self, stack: AsyncExitStack, model: str, rendered: dict[str, Any], index: int) -> OpenStream:
        failed: set[str] = set()
        for attempt in range(self.max_attempts):
            instance = self.scheduler.pick_union(self.snapshot, model, exclude=failed)
            rid = rendered["request_id"] if attempt == 0 else f"{rendered['request_id']}-a{attempt}"
            try:
                # Per attempt: a failed attempt releases its hold now, not when the stream ends.
                async with AsyncExitStack() as attempt_stack:
                    attempt_stack.enter_context(self.scheduler.load.hold(instance))
                    events = await attempt_stack.enter_async_context(
                        self.engines.generate_stream(instance, engine_request(rendered, request_id=rid))
                    )
                    stack.push_async_exit(attempt_stack.pop_all())
            except EngineError as exc:
                failed.add(instance.name)
                logger.warning(
                    "generate request_id=%s prompt=%d instance=%s phase=union attempt=%d result=%s stream=true",
                    rid, index, instance.name, attempt, type(exc).__name__,
                )
                if attempt + 1 == self.max_attempts:
                    raise
                continue
            logger.info("generate request_id=%s prompt=%d instance=%s phase=union result=established", rid, index, instance.name)
            return OpenStream(index, instance, rid, events)
        raise AssertionError("unreachable: the loop returns or raises")
