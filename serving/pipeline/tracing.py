"""Optional OpenTelemetry traces of a /v1 request's phases (``MOTOR_TRACING=true``; off by default).

One trace per request: a root span for the whole request (``request``, ended when the edge
observes the end-to-end phase, or when the request fails) and one child span per phase the
histograms time (``phases.Phases.observe`` is the one hook): ``render``, ``queue_wait``,
``placement``, ``first_chunk`` (per generate leg), ``first_derender``. Each span carries the
request id (``motor.request_id``) and the phase's labels (``motor.api``, ``motor.mode``,
``motor.topology``, ``motor.leg``, ``motor.source``); their times are the ones the histograms
count, so a trace and the metrics never disagree.

Spans go to an OTLP/HTTP exporter configured by the standard ``OTEL_*`` environment variables
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``..._HEADERS``,
``..._TIMEOUT``, ``OTEL_BSP_*`` for batching, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``)
through a batching processor, off the request path. OpenTelemetry is imported only by
``configure``: with tracing off nothing of it is loaded, and a request pays one ``None`` check
per phase.

Propagation (W3C Trace Context, the ``traceparent`` and ``tracestate`` headers vLLM reads,
``vllm.tracing.TRACE_HEADERS``): the edge reads them from the client's request (``incoming``);
with tracing on, the root span is their child and every render, derender and generate call
carries the root span's context; with tracing off, the client's own headers go to the sidecar
and the engines unchanged, so their traces still join the client's. The edge puts them in the
request's ``RequestContext`` (``trace``), which hands them explicitly to every render, derender,
generate and native call; each adds them to its own headers (``with_trace``): a request that
brought none, with tracing off, pays one empty-mapping check per call.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from serving.pipeline import metric_names

# The span of each phase family; the end-to-end family ends the request's root span.
SPAN_NAMES: dict[str, str] = {
    metric_names.PHASE_RENDER.name: "render",
    metric_names.PHASE_QUEUE_WAIT.name: "queue_wait",
    metric_names.PHASE_PLACEMENT.name: "placement",
    metric_names.PHASE_FIRST_CHUNK.name: "first_chunk",
    metric_names.PHASE_FIRST_DERENDER.name: "first_derender",
}
ROOT_SPAN = "request"
REQUEST_ID = "motor.request_id"
SERVICE_NAME = "motorsite-coordinator"

# The W3C Trace Context headers, named as vLLM reads them (``vllm/tracing/utils.py``).
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# version-traceid-parentid-flags, lower-case hex (W3C Trace Context, section 3.2); a later version
# may append fields. An all-zero trace or parent id is invalid.
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}(-[\x21-\x7e]*)?")
_TRACESTATE = re.compile(r"[\x20-\x7e]{0,512}")  # printable, within the spec's 512 bytes

# The trace headers of a request that has none (tracing off and the client sent none).
NO_TRACE: Mapping[str, str] = MappingProxyType({})


def incoming(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str] | None:
    """The client's W3C trace headers (an ASGI scope's ``headers``), or None without a valid
    ``traceparent`` (a ``tracestate`` alone means nothing: the spec drops it)."""
    parent = state = None
    for name, value in headers:
        if name == b"traceparent" and parent is None:
            parent = value
        elif name == b"tracestate" and state is None:
            state = value
    if parent is None:
        return None
    text = parent.decode("latin-1").strip()
    # Version ff is invalid; version 00 has exactly the four fields.
    if text[:2] == "ff" or (text[:2] == "00" and len(text) != 55) or not _TRACEPARENT.fullmatch(text):
        return None
    carrier = {TRACEPARENT: text}
    if state is not None:
        kept = state.decode("latin-1").strip()
        if kept and _TRACESTATE.fullmatch(kept):
            carrier[TRACESTATE] = kept
    return carrier


def with_trace(headers: dict[str, str], trace: Mapping[str, str]) -> dict[str, str]:
    """``headers`` of an upstream call, with the request's trace headers (``trace``) added."""
    if trace:
        headers.update(trace)
    return headers


class PhaseTracer:
    """Starts one ``RequestTrace`` per request on an OpenTelemetry tracer (built by ``configure``)."""

    def __init__(self, tracer: Any, provider: Any = None) -> None:
        self._tracer = tracer
        self.provider = provider  # the SDK's TracerProvider, for flush and shutdown

    def begin(
        self, request_id: str, labels: Mapping[str, str], start: float, clock: Callable[[], float],
        parent: Mapping[str, str] | None = None,
    ) -> RequestTrace:
        """The trace of a request that arrived at ``start`` on ``clock`` (the histograms' clock),
        continuing the client's trace when ``parent`` (its W3C headers, ``incoming``) names one."""
        return RequestTrace(self._tracer, request_id, labels, start, clock, parent)

    def force_flush(self, timeout_ms: int = 30000) -> bool:
        return bool(self.provider.force_flush(timeout_ms)) if self.provider is not None else True

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


class RequestTrace:
    """One request's root span and its phase spans, timed on the histograms' monotonic clock."""

    def __init__(
        self, tracer: Any, request_id: str, labels: Mapping[str, str], start: float, clock: Callable[[], float],
        parent: Mapping[str, str] | None = None,
    ) -> None:
        # Loaded already (configure imported them). W3C Trace Context itself, not the process's
        # configured propagator: it is what vLLM reads.
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = tracer
        self.request_id = request_id
        # Monotonic readings become wall-clock nanoseconds through one offset taken now, so every
        # span of the request keeps the exact durations the histograms count.
        self._offset_ns = time.time_ns() - int(clock() * 1e9)
        w3c = TraceContextTextMapPropagator()
        self._root = tracer.start_span(
            ROOT_SPAN, context=w3c.extract(parent) if parent else None, start_time=self._ns(start),
            attributes={REQUEST_ID: request_id, **_attributes(labels)},
        )
        self._context = trace.set_span_in_context(self._root)
        # What every upstream call of the request carries: the root span as their parent.
        self.headers: dict[str, str] = {}
        w3c.inject(self.headers, context=self._context)
        self._open = True

    def _ns(self, t: float) -> int:
        return self._offset_ns + int(t * 1e9)

    def phase(self, family: metric_names.Family, start: float, end: float, labels: Mapping[str, str]) -> None:
        """A span for one observed phase; the end-to-end phase ends the root span."""
        if family is metric_names.PHASE_END_TO_END:
            if self._open:
                self._root.set_attributes(_attributes(labels))
                self._open = False
                self._root.end(end_time=self._ns(end))
            return
        span = self._tracer.start_span(
            SPAN_NAMES.get(family.name, family.name), context=self._context, start_time=self._ns(start),
            attributes={REQUEST_ID: self.request_id, **_attributes(labels)},
        )
        span.end(end_time=self._ns(end))

    def close(self, end: float, error: BaseException | None = None) -> None:
        """End the root span if the request ended without its end-to-end phase (it failed)."""
        if not self._open:
            return
        self._open = False
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self._root.set_status(Status(StatusCode.ERROR, type(error).__name__))
            self._root.set_attribute("error.type", type(error).__name__)
        self._root.end(end_time=self._ns(end))


def _attributes(labels: Mapping[str, str]) -> dict[str, str]:
    return {f"motor.{k}": v for k, v in labels.items()}


def configure(*, replica: str, processor: Any = None) -> PhaseTracer:
    """A tracer exporting over OTLP/HTTP as the ``OTEL_*`` environment says (or to ``processor``,
    for tests); the resource names the service and this replica (``service.instance.id``)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    attributes = {"service.instance.id": replica}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = SERVICE_NAME
    # Resource.create adds OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME from the environment.
    provider = TracerProvider(resource=Resource.create(attributes))
    if processor is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        processor = BatchSpanProcessor(OTLPSpanExporter())
    provider.add_span_processor(processor)
    return PhaseTracer(provider.get_tracer("motorsite"), provider)
