"""HTTP client for token engines: ``/inference/v1/generate`` (JSON or SSE) and abort.

Every failure is classified once here, so topology code never looks at status codes:
connect errors, timeouts, 5xx and truncated streams are ``EngineError`` (retryable, the
instance's fault); the engine's own admission 503 is ``EngineBusy``; a 4xx, or an in-band
error event with a 4xx code, is the request's fault (``UpstreamRequestError``); a route-level
404, a 501 or a 403 (vLLM's answer on a plain ``serve`` without scale-out) means the engine has no
token-only generate at all (``EngineLacksCapability``), which the router may serve natively.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Mapping

import httpx

from serving.pipeline import tracing
from serving.pipeline.engine.requests import validate_generate_event
from serving.pipeline.errors import EngineBusy, EngineError, EngineLacksCapability, MotorError, UpstreamRequestError
from serving.pipeline.http11 import Http11Client
from serving.pipeline.json_codec import loads
from serving.pipeline.protocol import EventBatches
from serving.pipeline.snapshot import InstanceView
from serving.pipeline.sse import EventBatchReader, SSEProtocolError, iter_event_batches

logger = logging.getLogger(__name__)

GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"


def engine_request_id(request_id: str) -> str:
    """The id the engine knows a request by, and the only one its abort acts on."""
    return f"generate-tokens-{request_id}"


def request_headers(request: Mapping[str, Any], trace: Mapping[str, str] = tracing.NO_TRACE) -> dict[str, str]:
    """``X-Request-Id`` for one generate leg: the leg's own ``request_id`` (what the logs name as
    ``engine_request_id``). vLLM builds its engine id from this header when it is present, in place
    of the body's, so it must be the body's id: an abort names ``generate-tokens-<that id>``. And
    the request's trace headers (``trace``), when it has any."""
    rid = request.get("request_id")
    return tracing.with_trace({"X-Request-Id": rid} if isinstance(rid, str) and rid else {}, trace)


def raise_for_status(
    instance: InstanceView, status: int, body: Any, *, source: str = "engine", lacks: str = "token-only generate"
) -> None:
    """Classify an engine's non-200 answer (its token-only generate, or its own OpenAI API when
    ``source`` is ``native``); ``lacks`` names what a route-level refusal says it has not."""
    if status == 503:
        raise EngineBusy(f"{instance.name} is busy", instance=instance.name)
    shaped = isinstance(body, dict) and isinstance(body.get("error"), dict)
    # 403 is what every scale-out route answers on a plain ``vllm serve``; a 404 without vLLM's
    # error shape is FastAPI's route-level {"detail": "Not Found"} (a NotFoundError about the
    # model is the request's fault and has the shape); 501 is an explicit "not implemented".
    if status in (403, 501) or (status == 404 and not shaped):
        raise EngineLacksCapability(
            f"{instance.name} has no {lacks} ({status}): {str(body)[:200]}", instance=instance.name
        )
    if 400 <= status < 500 and shaped:
        raise UpstreamRequestError(status, body, source=source)
    raise EngineError(f"{instance.name} answered {status}: {str(body)[:200]}", instance=instance.name)


def raise_for_error_event(instance: InstanceView, event: dict[str, Any]) -> None:
    """An in-band ``{"error": ...}`` after HTTP 200: 4xx is the request's, anything else the engine's."""
    err = event.get("error")
    if err is None:
        return
    code = err.get("code") if isinstance(err, dict) else None
    if isinstance(code, int) and 400 <= code < 500 and code != 429:
        raise UpstreamRequestError(code, {"error": err}, source="engine")
    raise EngineError(f"{instance.name} failed mid-stream: {str(err)[:200]}", instance=instance.name)


def _first_stop(batch: list[dict[str, Any]]) -> tuple[int | None, str | None]:
    """Where the first in-band error event or event not shaped as vLLM's (with what is wrong
    with it) of ``batch`` is, if there is one."""
    for i, event in enumerate(batch):
        problem = validate_generate_event(event)
        if problem is not None or event.get("error") is not None:
            return i, problem
    return None, None


@dataclass(frozen=True, slots=True)
class ReplyDeadline:
    """How long a non-streaming generate may take to answer: ``base_s`` plus ``per_token_s`` for
    each token of its output budget (``sampling_params.max_tokens``; the choices of ``n`` decode
    side by side, so they do not add up).

    A non-streaming engine sends nothing until it is done, so one flat read timeout would cut a
    slow but alive engine off in the middle of a long generation, count it as a breaker failure
    and run the whole generation again on a second engine.
    """

    base_s: float = 60.0
    per_token_s: float = 0.1

    def seconds(self, request: Mapping[str, Any]) -> float:
        """The deadline of a GenerateRequest, from its ``sampling_params.max_tokens``."""
        return self.for_budget((request.get("sampling_params") or {}).get("max_tokens"))

    def for_budget(self, max_tokens: object) -> float:
        """The deadline of a reply whose output is bounded by ``max_tokens`` per choice (the
        native path passes the bound the engine will resolve)."""
        budget = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0
        return self.base_s + self.per_token_s * budget

    def timeout(self, base: httpx.Timeout, max_tokens: object) -> httpx.Timeout:
        """``base`` with its read timeout (the wait for a whole non-streaming reply) set to
        ``for_budget(max_tokens)``; connect, write and pool stay the shared client's."""
        return httpx.Timeout(connect=base.connect, read=self.for_budget(max_tokens), write=base.write, pool=base.pool)


class EngineClient:
    def __init__(self, client: Http11Client, *, deadline: ReplyDeadline | None = None) -> None:
        self._client = client
        # None: a non-streaming reply gets the shared client's read timeout, whatever its budget.
        self.deadline = deadline

    def _reply_timeout(self, request: Mapping[str, Any]) -> httpx.Timeout | None:
        if self.deadline is None:
            return None
        return self.deadline.timeout(self._client.timeout, (request.get("sampling_params") or {}).get("max_tokens"))

    async def generate(
        self, instance: InstanceView, request: dict[str, Any], *, trace: Mapping[str, str] = tracing.NO_TRACE
    ) -> dict[str, Any]:
        """Non-streaming generate; returns the GenerateResponse JSON as the engine wrote it.

        The reply may take as long as ``deadline`` gives this request's budget.
        """
        timeout = self._reply_timeout(request)
        headers = request_headers(request, trace)
        try:
            if timeout is None:
                response = await self._client.post(instance.url + GENERATE, json=request, headers=headers)
            else:
                response = await self._client.post(
                    instance.url + GENERATE, json=request, headers=headers, timeout=timeout
                )
        except httpx.ReadTimeout as exc:
            raise EngineError(
                f"{instance.name} gave no answer in time ({exc!r}, budget {timeout.read if timeout else '-'}s)",
                instance=instance.name,
            ) from exc
        except httpx.HTTPError as exc:
            raise EngineError(f"{instance.name} unreachable: {exc!r}", instance=instance.name) from exc
        try:
            body = response.json()
        except ValueError:
            body = response.text
        if response.status_code != 200:
            raise_for_status(instance, response.status_code, body)
        if not (isinstance(body, dict) and isinstance(body.get("choices"), list)):
            raise EngineError(f"{instance.name} answered a malformed GenerateResponse", instance=instance.name)
        return body

    def generate_stream(
        self, instance: InstanceView, request: dict[str, Any], *, whole_reads: bool = False,
        trace: Mapping[str, str] = tracing.NO_TRACE,
    ) -> _GenerateStream:
        """Open a streaming generate; entering means the engine accepted it (HTTP 200).

        Yields the events, a list per read (``[DONE]`` consumed); iterating raises
        ``EngineError`` when the stream drops, stalls past the read timeout or reports an engine
        failure, after the events that came before it. ``whole_reads``: each read takes all that
        arrived since the last (for a coalescing reader), not one network chunk.
        """
        return _GenerateStream(self, instance, request, whole_reads, trace)

    async def abort(self, instance: InstanceView, request_ids: list[str]) -> None:
        """Ask the engine to drop work; best effort, the engine answers at once."""
        try:
            await self._client.post(
                instance.url + ABORT, json={"request_ids": [engine_request_id(r) for r in request_ids]}, timeout=2.0
            )
        except httpx.HTTPError as exc:
            logger.warning("abort on %s failed: %r", instance.name, exc)


class _EngineEvents:
    """An established generate stream's events, a list per read, until ``[DONE]``: a plain async
    iterator, not an async generator, so a stream whose client reads nothing keeps no suspended
    frame of it (nor asyncio's weak-set entry for one) while it waits (issue 31).

    An in-band error event or one not shaped as vLLM's raises (``raise_for_error_event``,
    ``EngineError``) after the events that came before it in the same read were handed on; a
    broken SSE body or a failed read is an ``EngineError``.
    """

    __slots__ = ("_instance", "_batches", "_error")

    def __init__(self, instance: InstanceView, batches: EventBatchReader) -> None:
        self._instance = instance
        self._batches = batches
        self._error: MotorError | None = None  # raised at the next read, once its read's events went

    def __aiter__(self) -> _EngineEvents:
        return self

    async def __anext__(self) -> list[dict[str, Any]]:
        instance = self._instance
        error = self._error
        if error is not None:
            self._error = None
            await self._batches.aclose()  # ended, as a generator that raised
            raise error
        try:
            batch = await self._batches.__anext__()
        except SSEProtocolError as exc:
            raise EngineError(f"{instance.name} stream broke: {exc}", instance=instance.name) from exc
        except httpx.HTTPError as exc:
            raise EngineError(f"{instance.name} stream failed: {exc!r}", instance=instance.name) from exc
        cut, problem = _first_stop(batch)
        if cut is None:
            return batch
        event = batch[cut]
        del batch[cut:]
        if problem is not None:
            error = EngineError(f"{instance.name} sent an unusable generate event: {problem}", instance=instance.name)
        else:
            try:
                raise_for_error_event(instance, event)
            except MotorError as exc:
                error = exc
        assert error is not None  # _first_stop found an error event, and raise_for_error_event raised
        if not batch:
            await self._batches.aclose()
            raise error
        self._error = error
        return batch  # what came before the error is the client's


class _GenerateStream:
    """``EngineClient.generate_stream``'s context manager: a class, not an ``asynccontextmanager``,
    whose suspended generator frame (and asyncio's weak registry entry for it) would be held while
    the stream lasts (issue 31's 64 KiB a silent stream). An ``httpx.HTTPError`` on the way in or
    out is an ``EngineError``."""

    __slots__ = ("_engines", "_instance", "_request", "_whole_reads", "_trace", "_opened")

    def __init__(
        self, engines: EngineClient, instance: InstanceView, request: dict[str, Any], whole_reads: bool,
        trace: Mapping[str, str],
    ) -> None:
        self._engines = engines
        self._instance = instance
        self._request: dict[str, Any] | None = request
        self._whole_reads = whole_reads
        self._trace = trace
        self._opened: Any = None

    async def __aenter__(self) -> EventBatches:
        instance, request = self._instance, self._request
        assert request is not None
        # Written: the request (a few KiB parsed) is not kept for the stream's life.
        self._request = None
        try:
            opened = self._engines._client.stream(
                "POST", instance.url + GENERATE, json=request, headers=request_headers(request, self._trace)
            )
            del request
            response = await opened.__aenter__()
            try:
                if response.status_code != 200:
                    raw = await response.aread()
                    try:
                        body: Any = loads(raw)
                    except ValueError:
                        body = raw.decode(errors="replace")
                    raise_for_status(instance, response.status_code, body)
                response.whole_reads = self._whole_reads
            except BaseException as exc:
                await opened.__aexit__(type(exc), exc, exc.__traceback__)
                raise
        except httpx.HTTPError as exc:
            raise EngineError(f"{instance.name} stream failed: {exc!r}", instance=instance.name) from exc
        self._opened = opened
        return _EngineEvents(instance, iter_event_batches(response.aiter_raw()))

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        instance = self._instance
        try:
            await self._opened.__aexit__(exc_type, exc, tb)
        except httpx.HTTPError as err:
            raise EngineError(f"{instance.name} stream failed: {err!r}", instance=instance.name) from err
        if isinstance(exc, httpx.HTTPError):
            raise EngineError(f"{instance.name} stream failed: {exc!r}", instance=instance.name) from exc
