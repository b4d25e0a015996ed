"""The Grafana dashboard queries only metrics and labels the registry declares."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from serving.pipeline.metric_names import FAMILIES, Family

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "motorsite.json"
# Labels Prometheus puts on every scraped series: the coordinator scraped, and its job.
TARGET_LABELS = frozenset({"instance", "job"})
METRIC = re.compile(r"\b(motor_[a-z0-9_]+)\b")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
# ``* on (instance) group_left (replica) motor_coordinator_info``: the joined series' labels
# reach every series of the expression (how a dashboard sums a metric by coordinator replica).
JOIN = re.compile(r"\bgroup_left\s*\(([^)]*)\)\s*(motor_[a-z0-9_]+)")


def family_of(series: str) -> Family | None:
    """The family a queried series belongs to (a histogram's ``_bucket``, ``_sum`` and ``_count`` belong to it)."""
    for name in (series, series.removesuffix("_sum"), series.removesuffix("_count"), series.removesuffix("_bucket")):
        family = FAMILIES.get(name)
        if family is not None and (name == series or family.type == "histogram"):
            return family
    return None


def label_problems(expr: str) -> list[str]:
    """Labels ``expr`` groups or matches by that the series it queries cannot carry.

    A family's own label reaches Prometheus as itself, or as ``exported_<label>`` when it clashes
    with a target label (``instance``: the engine's name is renamed, the default honor_labels:
    false); so a bare ``instance`` on a family that has one means the coordinator, not the engine.
    """
    used = {label.strip() for group in GROUPING.findall(expr) for label in group.split(",") if label.strip()}
    used |= set(MATCHER.findall(expr))
    problems = []
    joined: set[str] = set()
    # A joined series only lends labels: the grouping above applies to the join's result.
    lenders = {series for _, series in JOIN.findall(expr)}
    for group, series in JOIN.findall(expr):
        labels = {label.strip() for label in group.split(",") if label.strip()}
        family = family_of(series)
        own = set(family.labels) if family is not None else set()
        problems += [f"{series} has no label {label!r} to join" for label in sorted(labels - own)]
        joined |= labels & own
    for series in set(METRIC.findall(expr)):
        family = family_of(series)
        if family is None or series in lenders:
            continue
        allowed = {
            (f"exported_{label}" if label in TARGET_LABELS else label) for label in family.labels
        } | TARGET_LABELS | joined
        if series.endswith("_bucket"):
            allowed.add("le")  # a histogram bucket's bound (histogram_quantile groups by it)
        problems += [f"{series} has no label {label!r}" for label in sorted(used - allowed)]
    return problems


def targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            yield panel["title"], target["expr"]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_every_metric_the_dashboard_queries_is_registered(dashboard: dict[str, Any]) -> None:
    queried = {series for _, expr in targets(dashboard) for series in METRIC.findall(expr)}
    assert len(queried) >= 10  # the panels were found
    unknown = sorted(s for s in queried if family_of(s) is None)
    assert not unknown, f"the dashboard queries metrics the registry does not declare: {unknown}"


def test_every_label_the_dashboard_uses_exists_on_its_metric(dashboard: dict[str, Any]) -> None:
    problems = [f"{title}: {p}" for title, expr in targets(dashboard) for p in label_problems(expr)]
    assert not problems


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ("rate(motor_engine_requests_totl[5m])", None),  # a typo: caught by the registry check
        ("sum by (instance) (motor_engine_in_flight_tokens)", None),  # the coordinator: allowed
        ("sum by (engine) (motor_engine_in_flight_tokens)", "has no label 'engine'"),
        ('motor_process_up{proces="x"}', "has no label 'proces'"),
        ("sum by (exported_instance) (rate(motor_engine_ttft_seconds_sum[5m]))", None),
        ("histogram_quantile(0.99, sum by (le, exported_instance) (rate(motor_engine_tpot_seconds_bucket[5m])))", None),
        ("histogram_quantile(0.99, sum by (le, instance_name) (rate(motor_engine_tpot_seconds_bucket[5m])))",
         "has no label 'instance_name'"),
        ("sum by (exported_process) (motor_process_up)", "has no label 'exported_process'"),
        ("sum by (le, topology) (rate(motor_request_placement_seconds_bucket[5m]))", None),
        ("sum by (le) (rate(motor_request_render_seconds_sum[5m]))", "has no label 'le'"),
        ("sum by (le, leg) (rate(motor_request_render_seconds_bucket[5m]))", "has no label 'leg'"),
        ("sum by (replica) (rate(motor_stream_relays_total[5m]))", "has no label 'replica'"),
        ("sum by (replica, reason) (rate(motor_stream_relays_total[5m]) * on (instance) group_left (replica) "
         "motor_coordinator_info)", None),
        ("sum by (reason) (rate(motor_stream_relays_total[5m]) * on (instance) group_left (zone) motor_coordinator_info)",
         "has no label 'zone' to join"),
    ],
)
def test_the_label_check_finds_what_is_wrong(expr: str, problem: str | None) -> None:
    found = label_problems(expr)
    if problem is None:
        assert found == []
    else:
        assert len(found) == 1 and problem in found[0]
    assert family_of("motor_engine_requests_totl") is None and family_of("motor_process_up_sum") is None
    assert family_of("motor_engine_requests_total_bucket") is None  # a counter has no buckets
    assert family_of("motor_engine_ttft_seconds_bucket") is FAMILIES["motor_engine_ttft_seconds"]


def test_the_dashboard_sums_relays_fallbacks_and_callbacks_by_replica(dashboard: dict[str, Any]) -> None:
    by_replica = {series for _, expr in targets(dashboard) if JOIN.search(expr) for series in METRIC.findall(expr)}
    assert {"motor_stream_relays_total", "motor_render_outcomes_total", "motor_trigger_callbacks_total"} <= by_replica


def test_the_dashboard_is_importable_json(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys()


def test_the_dashboard_shows_ttft_tpot_and_duration_quantiles_from_their_buckets(dashboard: dict[str, Any]) -> None:
    quantiles = {
        series for _, expr in targets(dashboard) if "histogram_quantile(" in expr for series in METRIC.findall(expr)
    }
    for family in ("motor_engine_ttft_seconds", "motor_engine_tpot_seconds", "motor_request_duration_seconds"):
        assert f"{family}_bucket" in quantiles, family


def test_the_dashboard_breaks_request_level_metrics_down_by_served_model(dashboard: dict[str, Any]) -> None:
    by_model = {series for _, expr in targets(dashboard) if re.search(r"\bby \([^)]*\bmodel\b", expr)
                for series in METRIC.findall(expr)}
    assert {"motor_route_decisions_total", "motor_render_outcomes_total", "motor_request_duration_seconds_count",
            "motor_request_duration_seconds_bucket"} <= by_model
    [variable] = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    assert "label_values(motor_request_duration_seconds_count, model)" in variable["definition"]
