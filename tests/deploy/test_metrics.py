"""docs/metrics.md's list of metrics is the registry's, and is what ``/metrics`` serves."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from fleet.models import ManagedProcess
from serving.pipeline import metrics
from serving.pipeline.metric_names import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(motor_[a-z0-9_]+)` \| (counter|gauge|histogram) \| ([^|]*) \|")


def documented_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    """docs/metrics.md's table of families: name -> (type, label names)."""
    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in found, f"{m.group(1)} is listed twice"
            labels = tuple(re.findall(r"`([a-z_]+)`", m.group(3)))
            found[m.group(1)] = (m.group(2), labels)
    return found


def test_the_doc_lists_every_metric_of_the_registry_with_its_type_and_labels() -> None:
    listed = documented_metrics()
    assert len(listed) >= 10  # the table was found and parsed
    registered = {name: (f.type, f.labels) for name, f in FAMILIES.items()}
    missing = sorted(registered.keys() - listed.keys())
    assert not missing, f"add a line to the table of docs/metrics.md for {missing}"
    assert not sorted(listed.keys() - registered.keys()), "docs/metrics.md lists metrics the registry does not have"
    for name, (kind, labels) in registered.items():
        assert listed[name] == (kind, labels), name


@pytest.mark.django_db
def test_every_family_metrics_serves_is_in_the_doc(client: Client) -> None:
    metrics.REGISTRY.clear()
    metrics.record_request("e1", 0.01, 0.002, ok=True)
    ManagedProcess.objects.create(name="engine-1", restarts=1)
    try:
        text = client.get("/metrics").content.decode()
    finally:
        metrics.REGISTRY.clear()
    served = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert {"motor_engine_requests_total", "motor_process_restarts_total", "motor_admission_waiting"} <= served.keys()
    listed = documented_metrics()
    for name, kind in served.items():
        assert name in listed and listed[name][0] == kind, name


@pytest.mark.django_db
def test_metrics_serves_the_phase_histograms_of_the_process(client: Client) -> None:
    from serving import runtime
    from serving.pipeline.metric_names import PHASE_RENDER

    runtime.phase_histograms.clear()
    runtime.phase_histograms.observe(PHASE_RENDER, 0.004, {"model": "tiny", "api": "chat", "mode": "json", "source": "render"})
    try:
        text = client.get("/metrics").content.decode()
    finally:
        runtime.phase_histograms.clear()
    series = 'api="chat",mode="json",model="tiny",source="render"'
    bucket = 'motor_request_render_seconds_bucket{{api="chat",le="{}",mode="json",model="tiny",source="render"}}'
    assert bucket.format("0.0025") + " 0.0" in text
    assert bucket.format("0.005") + " 1.0" in text
    assert bucket.format("+Inf") + " 1.0" in text
    assert bucket.format("0.004") not in text  # le is a bound, not the value
    assert f"motor_request_render_seconds_sum{{{series}}} 0.004" in text
    assert f"motor_request_render_seconds_count{{{series}}} 1.0" in text


@pytest.mark.django_db
def test_metrics_names_the_process_and_counts_the_callbacks_it_forwarded(
    client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from serving.pipeline.topologies import metaserver

    settings.MOTOR_REPLICA = "coordinator-7f9c"
    replica = metaserver.MetaServer("http://127.0.0.1:8000")
    monkeypatch.setattr(metaserver, "_process", replica)
    text = client.get("/metrics").content.decode()
    info = f'motor_coordinator_info{{host="{socket.gethostname()}",pid="{os.getpid()}",replica="coordinator-7f9c"}} 1.0'
    assert info in text
    # Every result from zero: a replica that never forwarded still exports the series.
    for result in ("accepted", "refused", "unreachable"):
        assert f'motor_trigger_callbacks_total{{result="{result}"}} 0.0' in text
    replica.forward_results.update({"accepted": 2, "unreachable": 1})
    text = client.get("/metrics").content.decode()
    assert 'motor_trigger_callbacks_total{result="accepted"} 2.0' in text
    assert 'motor_trigger_callbacks_total{result="unreachable"} 1.0' in text
