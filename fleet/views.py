"""The fleet dashboard: every instance on one admin page, with sparklines of its recent traffic.

A changelist cannot show this: the plots add up every coordinator process's request buckets
(``serving.pipeline.metrics``; each process reports its own through ``fleet.reports``, in the
database or in Redis), and this process's live ones, next to each instance's control data and
its engine process's restarts, so every replica draws the same fleet. The sparklines are inline SVG drawn here, so the page needs no script and nothing from
the network. Staff only (wrapped in ``admin.site.admin_view`` in ``motorsite.urls``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe

from catalog.models import Health, RenderSidecar
from catalog.render_versions import member_traffic, render_traffic
from fleet.engine_capabilities import instance_traffic
from fleet.models import BreakerState, EngineInstance, ManagedProcess, process_of
from fleet.presenters import ObfuscationStatus, inflight_tokens, route_decisions
from fleet.reports import reports_read, this_process
from motorsite.core import current_render_config
from serving.pipeline import metrics

# Narrow enough that four plots and the text columns fit the admin's content box at 1400 px
# beside its nav sidebar (the browser test holds it); 60 buckets still get 1.3 px each.
SPARK_W, SPARK_H = 80, 28


def sparkline(values: Sequence[float | None], *, label: str, color: str = "#417690") -> SafeString:
    """An inline SVG polyline of ``values`` (None = no data, drawn as a gap) scaled to its own max."""
    present = [v for v in values if v is not None]
    top = max(present, default=0.0) or 1.0
    step = SPARK_W / max(len(values) - 1, 1)
    segments: list[list[str]] = [[]]
    for k, v in enumerate(values):
        if v is None:
            if segments[-1]:
                segments.append([])
            continue
        y = SPARK_H - 2 - (v / top) * (SPARK_H - 4)
        segments[-1].append(f"{k * step:.1f},{y:.1f}")
    lines = "".join(
        f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(s)}"/>'
        if len(s) > 1 else f'<circle cx="{s[0].split(",")[0]}" cy="{s[0].split(",")[1]}" r="1.5" fill="{color}"/>'
        for s in segments if s
    )
    # Every value is a number formatted here, and the label goes through format_html: safe.
    return format_html(
        '<svg class="spark" role="img" width="{}" height="{}" viewBox="0 0 {} {}" data-metric="{}">'
        '<title>{}</title><line x1="0" y1="{}" x2="{}" y2="{}" stroke="#ddd"/>{}</svg>',
        SPARK_W, SPARK_H, SPARK_W, SPARK_H, label, label, SPARK_H - 1, SPARK_W, SPARK_H - 1, mark_safe(lines),
    )


@dataclass(frozen=True, slots=True)
class Row:
    instance: EngineInstance
    breaker: str
    in_flight: int
    sick: bool
    why: list[str]
    plots: dict[str, SafeString]
    latest: dict[str, Any]
    obfuscation_excluded: str | None = None  # why obfuscation keeps this instance out of traffic
    process: ManagedProcess | None = None  # the launcher's process of this engine, if any
    traffic: str = ""  # the paths its record and probed capabilities leave it, its adapters (instance_traffic)


def _row(
    instance: EngineInstance, series: metrics.InstanceSeries | None, in_flight: int,
    obfuscation: ObfuscationStatus | None = None,
) -> Row:
    try:
        breaker = instance.breaker.state
    except BreakerState.DoesNotExist:
        breaker = BreakerState.State.CLOSED
    why = []
    if instance.health == Health.FAILING:
        why.append("probe failing")
    if breaker != BreakerState.State.CLOSED:
        why.append(f"breaker {breaker}")
    if instance.version_drift:
        why.append("version drift")
    if instance.model_mismatch:
        why.append("served model record differs")
    if instance.state == EngineInstance.State.QUARANTINED:
        why.append("quarantined")
    excluded = obfuscation.excluded_reason(instance) if obfuscation is not None else None
    if excluded:
        why.append("kept out by obfuscation")
    process = process_of(instance)
    if process is not None and process.state in (ManagedProcess.State.BACKOFF, ManagedProcess.State.FAILED):
        why.append(f"process {process.get_state_display()}")
    points = series.points if series else ()
    ttft = [p.ttft_s * 1000 if p.ttft_s is not None else None for p in points]
    tpot = [p.tpot_s * 1000 if p.tpot_s is not None else None for p in points]
    rate = [float(p.requests) for p in points]
    errors = [float(p.errors) for p in points]
    recent = points[-6:]  # the last minute
    latest = {
        "requests": sum(p.requests for p in recent),
        "errors": sum(p.errors for p in recent),
        "ttft_ms": next((v for v in reversed(ttft) if v is not None), None),
        "tpot_ms": next((v for v in reversed(tpot) if v is not None), None),
    }
    plots = {
        "ttft": sparkline(ttft, label=f"{instance.name} TTFT ms"),
        "tpot": sparkline(tpot, label=f"{instance.name} TPOT ms"),
        "rate": sparkline(rate, label=f"{instance.name} requests per bucket"),
        "errors": sparkline(errors, label=f"{instance.name} errors per bucket", color="#ba2121"),
    }
    traffic = instance_traffic(instance)
    return Row(instance, breaker, in_flight, bool(why), why, plots, latest, excluded, process, traffic)


def fleet_series(own: metrics.Export, reports: Sequence[Any], *, now: float) -> dict[str, metrics.InstanceSeries]:
    """Every coordinator's buckets added up: this process's live ``own`` plus the others' reports.

    This process's own report is left out (its live buckets are newer than what it last wrote).
    """
    me = this_process()
    others = [r.payload.get("series") or {} for r in reports if (r.host, r.pid) != me]
    return metrics.merge(
        [own, *others], now=now, bucket_s=metrics.REGISTRY.bucket_s, buckets=metrics.REGISTRY.buckets
    )


def fleet_in_flight(own: dict[str, int], reports: Sequence[Any]) -> dict[str, int]:
    me = this_process()
    total = dict(own)
    for r in reports:
        if (r.host, r.pid) != me:
            for name, tokens in (r.payload.get("in_flight") or {}).items():
                total[name] = total.get(name, 0) + int(tokens)
    return total


@dataclass(frozen=True, slots=True)
class NativeReason:
    model: str
    reason: str
    native: int  # sent to an engine's own OpenAI API
    refused: int  # needed it, and no engine (or obfuscation) allowed it
    token_only: int  # the RFC's native route kept token-only (a Trigger per prompt)


def native_reasons(own: Sequence[tuple[str, str, str, int]], reports: Sequence[Any]) -> list[NativeReason]:
    """Why each served model's requests went native, added up over this process's live counts
    and every other coordinator's report, by model then reason."""
    me = this_process()
    counts: dict[tuple[str, str], dict[str, int]] = {}
    decisions = [*own, *(d for r in reports if (r.host, r.pid) != me for d in r.payload.get("route_decisions") or ())]
    for model, path, reason, count in decisions:
        by_path = counts.setdefault((str(model), str(reason)), {})
        by_path[str(path)] = by_path.get(str(path), 0) + int(count)
    return [
        NativeReason(model, reason, c.get("native", 0), c.get("refused", 0), c.get("token_only", 0))
        for (model, reason), c in sorted(counts.items())
    ]


def dashboard(request: HttpRequest) -> HttpResponse:
    reports = reports_read()
    series = fleet_series(metrics.REGISTRY.export(), reports, now=time.time())
    in_flight = fleet_in_flight(inflight_tokens() or {}, reports)
    instances = EngineInstance.objects.select_related("served_model", "breaker", "process").order_by("name")
    render_config = current_render_config()
    obfuscation = ObfuscationStatus.of(render_config)  # once per page, not per row
    rows = [_row(i, series.get(i.name), in_flight.get(i.name, 0), obfuscation) for i in instances]
    context = {
        **admin.site.each_context(request),
        "title": "Fleet dashboard",
        "rows": rows,
        "render": render_config,
        # Where the version floors send traffic, and why (fleet.verdicts.render_traffic).
        "render_traffic": render_traffic(render_config.sidecar_version) if render_config is not None else "",
        "sick_count": sum(r.sick for r in rows),
        "native_reasons": native_reasons(route_decisions(), reports),
        # Every render pool member with what its probe found it serves (catalog.render_versions).
        "sidecars": [
            (m, member_traffic(m.sidecar_version, m.capabilities))
            for m in RenderSidecar.objects.select_related("render_config").order_by("render_config_id", "id")
        ],
        # The processes drawn: this one, and every other that reported (a replica, or a worker).
        "coordinators": 1 + sum((r.host, r.pid) != this_process() for r in reports),
        "bucket_s": metrics.REGISTRY.bucket_s,
        "window_min": metrics.REGISTRY.bucket_s * metrics.REGISTRY.buckets // 60,
    }
    return render(request, "fleet/dashboard.html", context)
