"""Every metric this process exports: its name, type, help, label names and buckets, in one registry.

Names follow Prometheus' conventions: a ``motor_`` prefix, base units in the name (``_seconds``,
``_tokens``), ``_total`` on counters, a histogram's ``_bucket`` (by ``le``), ``_sum`` and
``_count`` series under one family. New metrics are added here first: ``exporter`` builds each
family's ``prometheus_client`` object from its declaration, and every recorder takes a ``Family``
and refuses labels it does not declare, so a typo cannot start a new series (docs/metrics.md).

Every label's values come from a fixed set, so no request can add a series (a client's JSON key
in a label would be unbounded cardinality): a family declares, per label, the frozenset of its
values (``values``), or the label is one the operator names (``OPERATOR_LABELS``: instance and
process names, bounded by the fleet), or it is ``model``, a served model of the request's snapshot
(``MODEL_LABEL``). ``Family.series`` maps any other value to ``"other"``;
every recorder (``exporter.Recorder``) and every series read at scrape time passes through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from serving.pipeline.errors import RenderUnavailable
from serving.pipeline.protocol import TokenizerSource, TopologyName

# What a label value outside its family's set is recorded as.
OTHER = "other"
# Labels whose values are names from the fleet's records or the launcher's process specs, or that
# describe the exporting process itself (one series per process: its replica name, host and pid).
OPERATOR_LABELS = frozenset({"instance", "process", "replica", "host", "pid"})
# The request-level families' ``model`` label: its closed set is the served model names of the
# snapshot the request was served with. A client's ``model`` field never reaches a recorder: the
# edge resolves it against the snapshot first (``ModelNotFound`` otherwise) and the pipeline
# records its ``ModelView.name``; a recorder used without a served model says OTHER.
MODEL_LABEL = "model"


Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family: what ``# HELP`` and ``# TYPE`` say, and the labels its series carry."""

    name: str
    type: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...] = ()
    # Each label's allowed values; every label not in OPERATOR_LABELS must have a set here.
    values: Mapping[str, frozenset[str]] = field(default_factory=dict, compare=False)
    # A histogram's upper bounds in seconds, increasing (``+Inf`` is added by the exporter).
    buckets: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        # At import: a family with an open label would let requests mint series.
        open_labels = [k for k in self.labels
                       if k not in self.values and k not in OPERATOR_LABELS and k != MODEL_LABEL]
        if open_labels or not set(self.values) <= set(self.labels):
            raise ValueError(f"{self.name}: declare the values of {open_labels or sorted(set(self.values) - set(self.labels))}")
        if (self.type == "histogram") != bool(self.buckets) or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"{self.name}: a histogram, and only a histogram, takes increasing buckets")

    def check(self, labels: Mapping[str, str]) -> None:
        """Raise ``ValueError`` unless ``labels`` are exactly this family's label names."""
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, got {tuple(sorted(labels))}")

    def series(self, labels: Mapping[str, str]) -> Labels:
        """The sorted ``(label, value)`` pairs of one series, each value outside its label's set ``OTHER``.

        Raises ``ValueError`` for label names the family does not declare (``check``).
        """
        self.check(labels)
        return tuple(sorted(
            (k, OTHER if k in self.values and v not in self.values[k] else v) for k, v in labels.items()
        ))



# Bucket bounds (seconds), chosen from what bench/RESULTS.md measures (docs/metrics.md lists the
# readings each set must resolve), after vLLM's own (``vllm/v1/metrics/buckets.py``).
# The coordinator's phases: 35-180 us placements and 20 us admission grants, render and derender
# calls of a few to tens of ms, a queued lease or a slow engine's first chunk of seconds.
PHASE_BUCKETS = (0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Time to first token: vLLM's TIME_TO_FIRST_TOKEN_BUCKETS to 640 s (12 ms enginesim, 0.6 s at 64 streams).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
# Time per output token: from enginesim's 0.13 ms through 2-12 ms decode steps to an 85 ms crowd;
# vLLM's INTER_TOKEN_LATENCY_BUCKETS start at 10 ms, too coarse for the sub-10 ms readings.
TPOT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0)
# A whole request: 10 ms JSON answers on the simulated fleet to minutes of a long real-engine stream.
END_TO_END_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                      15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)


# -- per engine instance (``metrics.MetricsRegistry``) ---------------------------------------
ENGINE_REQUESTS = Family("motor_engine_requests_total", "counter", "Engine requests finished (ok or failed).",
                         ("instance",))
ENGINE_ERRORS = Family("motor_engine_errors_total", "counter", "Engine requests that failed on the engine's side.",
                       ("instance",))
ENGINE_TTFT = Family("motor_engine_ttft_seconds", "histogram", "Time to first token.", ("instance",),
                     buckets=TTFT_BUCKETS)
ENGINE_TPOT = Family("motor_engine_tpot_seconds", "histogram", "Time per output token.", ("instance",),
                     buckets=TPOT_BUCKETS)
ENGINE_IN_FLIGHT_TOKENS = Family("motor_engine_in_flight_tokens", "gauge",
                                 "Prompt + output tokens this process has in flight.", ("instance",))

# -- the router (``metrics.RouterCounters``) --------------------------------------------------
# Why a request took the native path (``engine.native.native_reason``, the pipeline's own
# reasons, and the local fallback's ``NeedsNative`` categories).
NATIVE_REASONS = frozenset({
    "api:responses", "api:messages", "render_disabled", "no_token_in", "no_derender", "no_streaming_derender", "echo",
    "stop_strings", "structured_output", "forced_tool_choice", "engine_capability",
    "trigger_multi_prompt_stream", "local:stream", "local:param", "local:messages",
    # What only a stateful Responses server (or its built-in tools) serves (``apis/responses.py``).
    "api:responses:previous_response_id", "api:responses:background", "api:responses:stored_state",
    "api:responses:builtin_tools", "api:responses:tool_choice",
})
# A tokenization's result: ok, moved to the native path, or the MotorError it raised.
RENDER_RESULTS = frozenset({"ok", "native", "RenderUnavailable", "UpstreamRequestError", "RequestError"})
TOPOLOGIES = frozenset(get_args(TopologyName))

# The route the RFC names native that stays token-only: a Trigger multi-prompt stream where the
# fleet has no native path for it, each prompt run on its own Trigger (``service._open``).
TOKEN_ONLY_REASONS = frozenset({"trigger_per_prompt"})
ROUTE_DECISIONS = Family("motor_route_decisions_total", "counter",
                         "Requests sent to an engine's native OpenAI API, refused it, or kept token-only where the "
                         "RFC's route is native (token_only: a Trigger multi-prompt stream without a native path, "
                         "each prompt on its own Trigger), by served model and reason.", ("model", "path", "reason"),
                         {"path": frozenset({"native", "refused", "token_only"}),
                          "reason": NATIVE_REASONS | TOKEN_ONLY_REASONS})
RENDER_OUTCOMES = Family("motor_render_outcomes_total", "counter",
                         "Tokenizations by served model, source (render or local), result and fallback reason.",
                         ("model", "source", "result", "fallback_reason"),
                         {"source": frozenset(get_args(TokenizerSource)), "result": RENDER_RESULTS,
                          "fallback_reason": frozenset({"", *RenderUnavailable.REASONS})})
STREAM_RELAYS = Family("motor_stream_relays_total", "counter",
                       "Streams moved to another instance after output reached the client, by served model, the "
                       "failed stream's topology and why it failed (stall: no chunk within the chunk timeout; "
                       "failure: anything else the engine did).", ("model", "topology", "reason"),
                       {"topology": TOPOLOGIES, "reason": frozenset({"stall", "failure"})})
# A callback forwarded to the replica that started the request: what that owner answered.
TRIGGER_CALLBACK_RESULTS = frozenset({"accepted", "refused", "unreachable"})
TRIGGER_CALLBACKS = Family("motor_trigger_callbacks_total", "counter",
                           "Trigger metaserver callbacks this process received for a request another replica "
                           "started and forwarded to it, by the owner's answer (accepted: 2xx; refused: any other "
                           "status) or unreachable.", ("result",), {"result": TRIGGER_CALLBACK_RESULTS})
ADMISSION_WAITING = Family("motor_admission_waiting", "gauge", "Requests waiting in the admission queue.")

# -- where a /v1 request's time goes (``phases.Histograms``, observed through ``phases.Phases``) --
PHASE_VALUES: dict[str, frozenset[str]] = {
    "api": frozenset({"chat", "completions", "responses", "messages"}),
    "mode": frozenset({"stream", "json"}),
    "topology": TOPOLOGIES | {"native"},  # native: an engine's own OpenAI API
    "leg": frozenset({"union", "prefill", "decode"}),
    "source": frozenset(get_args(TokenizerSource)),
}


def _phase(name: str, help: str, labels: tuple[str, ...], buckets: tuple[float, ...] = PHASE_BUCKETS) -> Family:
    # Every phase is of one request, of one served model: ``model`` first, then the phase's own.
    return Family(name, "histogram", help, (MODEL_LABEL, *labels), {k: PHASE_VALUES[k] for k in labels}, buckets)


PHASE_RENDER = _phase("motor_request_render_seconds",
                      "Render (or local tokenization) of a request's prompts.", ("api", "mode", "source"))
PHASE_QUEUE_WAIT = _phase("motor_request_queue_wait_seconds",
                          "Wait for an admission lease on an instance (zero when granted at once).",
                          ("api", "mode", "topology"))
PHASE_PLACEMENT = _phase("motor_request_placement_seconds",
                         "One placement decision (filters, load and KV-affinity scores).", ("api", "mode", "topology"))
PHASE_FIRST_CHUNK = _phase("motor_request_first_chunk_seconds",
                           "From sending a generate leg to its first stream event, or to its JSON answer.",
                           ("api", "mode", "topology", "leg"))
PHASE_FIRST_DERENDER = _phase("motor_request_first_derender_seconds",
                              "The derender call of a prompt's first chunk (its whole answer when not streaming).",
                              ("api", "mode", "topology"))
PHASE_END_TO_END = _phase("motor_request_duration_seconds",
                          "A /v1 request answered 200, from its arrival to its last byte.", ("api", "mode", "topology"),
                          END_TO_END_BUCKETS)
PHASES = (PHASE_RENDER, PHASE_QUEUE_WAIT, PHASE_PLACEMENT, PHASE_FIRST_CHUNK, PHASE_FIRST_DERENDER, PHASE_END_TO_END)

# -- KV affinity (``placement/``) -------------------------------------------------------------
AFFINITY_INDEX_BLOCKS = Family("motor_affinity_index_blocks", "gauge", "Prefix blocks held by the KV affinity index.")
KV_EVENT_BATCHES = Family("motor_kv_event_batches_total", "counter", "KV cache event batches received.",
                          ("instance",))
KV_EVENT_ERRORS = Family("motor_kv_event_errors_total", "counter", "KV cache event subscriber errors.",
                         ("instance",))

# -- the launcher's processes (``serving.views``, from the database) -------------------------
PROCESS_RESTARTS = Family("motor_process_restarts_total", "counter", "Restarts of a launcher child so far.",
                          ("process",))
PROCESS_UP = Family("motor_process_up", "gauge", "Whether a launcher child is running (1) or not (0).", ("process",))

# -- the coordinator process itself ---------------------------------------------------------
COORDINATOR_INFO = Family("motor_coordinator_info", "gauge",
                          "Always 1: this coordinator process's replica name (MOTOR_REPLICA, default the host "
                          "name), host and pid; join on the scraped instance to sum any metric by replica.",
                          ("replica", "host", "pid"))

FAMILIES: dict[str, Family] = {f.name: f for f in (
    ENGINE_REQUESTS, ENGINE_ERRORS, ENGINE_TTFT, ENGINE_TPOT, ENGINE_IN_FLIGHT_TOKENS, ROUTE_DECISIONS,
    RENDER_OUTCOMES, STREAM_RELAYS, TRIGGER_CALLBACKS, ADMISSION_WAITING, AFFINITY_INDEX_BLOCKS, KV_EVENT_BATCHES,
    KV_EVENT_ERRORS, PROCESS_RESTARTS, PROCESS_UP, COORDINATOR_INFO, *PHASES,
)}

