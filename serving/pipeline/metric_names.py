"""Every metric this process exports: its name, type, help and label names, in one registry.

Names follow Prometheus' conventions: a ``motor_`` prefix, base units in the name (``_seconds``,
``_tokens``), ``_total`` on counters, a summary's ``_sum`` and ``_count`` (a histogram's also its
``_bucket`` series, by ``le``) under one family.
New metrics are added here first; ``RouterCounters.inc`` and the ``/metrics`` text take a
``Family`` and refuse labels it does not declare, so a typo cannot start a new series.

Every label's values come from a fixed set, so no request can add a series (a client's JSON key
in a label would be unbounded cardinality): a family declares, per label, the frozenset of its
values (``values``), or the label is one the operator names (``OPERATOR_LABELS``: instance and
process names, bounded by the fleet). ``Family.series`` maps any other value to ``"other"``;
the counters record through it and the exposition passes every series through it again.
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

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family: what ``# HELP`` and ``# TYPE`` say, and the labels its series carry."""

    name: str
    type: Literal["counter", "gauge", "summary", "histogram"]
    help: str
    labels: tuple[str, ...] = ()
    # Each label's allowed values; every label not in OPERATOR_LABELS must have a set here.
    values: Mapping[str, frozenset[str]] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # At import: a family with an open label would let requests mint series.
        open_labels = [k for k in self.labels if k not in self.values and k not in OPERATOR_LABELS]
        if open_labels or not set(self.values) <= set(self.labels):
            raise ValueError(f"{self.name}: declare the values of {open_labels or sorted(set(self.values) - set(self.labels))}")

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

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.type}"]


# -- per engine instance (``metrics.MetricsRegistry``) ---------------------------------------
ENGINE_REQUESTS = Family("motor_engine_requests_total", "counter", "Engine requests finished (ok or failed).",
                         ("instance",))
ENGINE_ERRORS = Family("motor_engine_errors_total", "counter", "Engine requests that failed on the engine's side.",
                       ("instance",))
ENGINE_TTFT = Family("motor_engine_ttft_seconds", "summary", "Time to first token.", ("instance",))
ENGINE_TPOT = Family("motor_engine_tpot_seconds", "summary", "Time per output token.", ("instance",))
ENGINE_IN_FLIGHT_TOKENS = Family("motor_engine_in_flight_tokens", "gauge",
                                 "Prompt + output tokens this process has in flight.", ("instance",))

# -- the router (``metrics.RouterCounters``) --------------------------------------------------
# Why a request took the native path (``engine.native.native_reason``, the pipeline's own
# reasons, and the local fallback's ``NeedsNative`` categories).
NATIVE_REASONS = frozenset({
    "api:responses", "api:messages", "render_disabled", "no_token_in", "no_derender", "no_streaming_derender", "echo",
    "stop_strings", "structured_output", "forced_tool_choice", "engine_capability",
    "trigger_multi_prompt_stream", "local:stream", "local:param", "local:messages",
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
                         "each prompt on its own Trigger), by reason.", ("path", "reason"),
                         {"path": frozenset({"native", "refused", "token_only"}),
                          "reason": NATIVE_REASONS | TOKEN_ONLY_REASONS})
RENDER_OUTCOMES = Family("motor_render_outcomes_total", "counter",
                         "Tokenizations by source (render or local), result and fallback reason.",
                         ("source", "result", "fallback_reason"),
                         {"source": frozenset(get_args(TokenizerSource)), "result": RENDER_RESULTS,
                          "fallback_reason": frozenset({"", *RenderUnavailable.REASONS})})
STREAM_RELAYS = Family("motor_stream_relays_total", "counter",
                       "Streams moved to another instance after output reached the client, by the failed "
                       "stream's topology and why it failed (stall: no chunk within the chunk timeout; "
                       "failure: anything else the engine did).", ("topology", "reason"),
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


def _phase(name: str, help: str, labels: tuple[str, ...]) -> Family:
    return Family(name, "histogram", help, labels, {k: PHASE_VALUES[k] for k in labels})


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
                          "A /v1 request answered 200, from its arrival to its last byte.", ("api", "mode", "topology"))
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


def label_value(value: str) -> str:
    """Escape a Prometheus label value."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def sample(name: str, labels: Labels, value: float) -> str:
    """One exposition line: ``name{label="value",...} value``."""
    if not labels:
        return f"{name} {value!r}"
    text = ",".join(f'{k}="{label_value(v)}"' for k, v in labels)
    return f"{name}{{{text}}} {value!r}"


def _order(item: tuple[tuple[str, Labels], float]) -> tuple[str, Labels, float]:
    """Series by name and labels; a histogram's buckets by their bound as a number (``+Inf`` last)."""
    (name, labels), _ = item
    le = next((v for k, v in labels if k == "le"), None)
    if le is None:
        return name, labels, 0.0
    return name, tuple(kv for kv in labels if kv[0] != "le"), float(le)


def exposition(samples: Mapping[tuple[str, Labels], float], *, declare: tuple[Family, ...] = ()) -> list[str]:
    """Lines for ``samples`` keyed ``(series name, labels)``: each family's header once, then its series.

    A summary's ``_sum`` and ``_count`` series (a histogram's ``_bucket`` too, in increasing ``le``
    as the text format requires) belong to their family's header. Families in
    ``declare`` get their header even without a series (an idle gauge is still exported, so a
    scraper can tell idle from missing). Every series goes through its family's ``series`` (a
    value outside its set is summed into ``other``). Raises ``KeyError`` for a series of no
    registered family, ``ValueError`` for labels its family does not declare.
    """
    folded: dict[tuple[str, Labels], float] = {}
    families: dict[str, Family] = {}
    for (name, labels), value in samples.items():
        family = FAMILIES.get(name) or FAMILIES[
            name.removesuffix("_sum").removesuffix("_count").removesuffix("_bucket")
        ]
        # A bucket's bound is the histogram's own label, not the family's: fold the rest, keep it.
        bound = tuple(kv for kv in labels if kv[0] == "le") if name.endswith("_bucket") else ()
        rest = dict(kv for kv in labels if kv[0] != "le") if bound else dict(labels)
        key = (name, family.series(rest) + bound)  # ``le`` last, as Prometheus' own clients write it
        folded[key] = folded.get(key, 0.0) + value
        families[name] = family
    by_family: dict[str, list[str]] = {f.name: [] for f in declare}
    for (name, labels), value in sorted(folded.items(), key=_order):
        by_family.setdefault(families[name].name, []).append(sample(name, labels, value))
    lines: list[str] = []
    for name, series in by_family.items():
        lines += FAMILIES[name].header() + series
    return lines
