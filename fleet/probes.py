"""Health checks and version probes of the render sidecar and the engines.

What the answers mean is pure and lives in ``fleet.verdicts`` (health thresholds, versions,
render capabilities, drift, the served model's record); this module does the I/O for
the Celery tasks in ``fleet.tasks``: one real request per probe with an explicit timeout, one
``ProbeResult`` row per probe, and compare-and-set writes of the machine-owned fields, where only
a change of verdict writes history (``InstanceEvent``) and bumps the control version.

"Healthy" means a real one-token render (sidecar) or one-token generate (engine) succeeded:
vLLM answers ``/health`` before its model has ever run (see ``motorsite.tiers``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from catalog.fingerprints import config_vocab_size, fingerprint_model_dir
from catalog.models import Health, RenderConfig, ServedModel
from catalog.render_versions import (  # noqa: F401  (read as probes.* too)
    DERENDER_MIN,
    STREAMING_DERENDER_MIN,
    TOKEN_IN_MIN,
    RenderCapabilities,
    parse_version,
    render_capabilities,
    render_traffic,
)
from fleet.models import AuditReport, BreakerState, EngineInstance, InstanceEvent, ProbeResult
from fleet.verdicts import (  # noqa: F401  (the verdicts are part of what callers read as probes.*)
    FINGERPRINT_KEYS,
    HealthStep,
    Thresholds,
    TierReport,
    drift_reasons,
    next_health,
    record_mismatch,
)
from motorsite import tiers, unix_http
from motorsite.core import bump_control_version, current_render_config, render_configs_by_model

logger = logging.getLogger(__name__)

ACTOR = "probe"

# -- I/O: probes --------------------------------------------------------------------------------


def thresholds() -> Thresholds:
    return Thresholds(rise=settings.MOTOR_PROBE_RISE, fall=settings.MOTOR_PROBE_FALL)


def http_client() -> httpx.Client:
    # trust_env=False: a proxy from the environment must never answer for a 127.0.0.1 tier.
    # One timeout for the whole probe: a real one-token request on a loaded CPU engine takes
    # well under a second, so an answer slower than this counts as a failure.
    return httpx.Client(trust_env=False, timeout=httpx.Timeout(settings.MOTOR_PROBE_TIMEOUT_S))


@dataclass(slots=True)
class Outcome:
    ok: bool
    latency_ms: float
    error: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


def _post_ready(client: httpx.Client, base_url: str, request: tuple[str, dict[str, Any]]) -> Outcome:
    path, body = request
    start = time.perf_counter()
    try:
        with unix_http.reach(client, base_url) as (c, base):  # a sidecar on a unix socket too
            response = c.post(base + path, json=body)
    except httpx.HTTPError as exc:
        return Outcome(False, (time.perf_counter() - start) * 1000, f"{type(exc).__name__}: {exc}")
    latency = (time.perf_counter() - start) * 1000
    if response.status_code != 200:
        return Outcome(False, latency, f"{path} answered {response.status_code}: {response.text[:200]}")
    return Outcome(True, latency)


def probe_engine_health(instance_id: int, *, client: httpx.Client | None = None) -> ProbeResult | None:
    """One real one-token generate on the instance; update its verdict. None if it is gone."""
    instance = EngineInstance.objects.select_related("served_model").filter(id=instance_id).first()
    if instance is None:
        return None
    with _client(client) as c:
        outcome = _post_ready(c, instance.url, tiers.engine_ready_request(instance.served_model.name))
    return _record_engine_health(instance, outcome)


def _record_engine_health(instance: EngineInstance, outcome: Outcome) -> ProbeResult:
    now = timezone.now()
    with transaction.atomic():
        row = EngineInstance.objects.filter(id=instance.id).values(
            "health", "consecutive_successes", "consecutive_failures"
        ).first()
        assert row is not None
        step = next_health(row["health"], row["consecutive_successes"], row["consecutive_failures"], outcome.ok, thresholds())
        # Compare-and-set on everything we read: a concurrent probe of the same instance (probe
        # now + the schedule) that wrote first wins, and this outcome only leaves its result row.
        written = EngineInstance.objects.filter(
            id=instance.id, health=row["health"],
            consecutive_successes=row["consecutive_successes"], consecutive_failures=row["consecutive_failures"],
        ).update(
            health=step.health, consecutive_successes=step.successes, consecutive_failures=step.failures,
            last_probe_at=now, last_probe_ok=outcome.ok, last_probe_error=outcome.error,
        )
        if written and step.changed_from(row["health"]):
            InstanceEvent.objects.create(
                instance=instance, kind="health", old=row["health"], new=step.health, actor=ACTOR,
                reason=outcome.error or f"{step.successes} probe(s) in a row succeeded",
            )
            # The snapshot's `healthy` flag keeps traffic away from a failing instance.
            bump_control_version()
            logger.info("instance %s health %s -> %s", instance.name, row["health"], step.health)
        result = ProbeResult.objects.create(
            instance=instance, kind="health", ok=outcome.ok, latency_ms=outcome.latency_ms,
            detail={"health": step.health, "successes": step.successes, "failures": step.failures},
            error=outcome.error,
        )
    return result


def probe_render_health(*, client: httpx.Client | None = None) -> ProbeResult | None:
    """One real chat render on the sidecar; update the render config's verdict. None without one."""
    cfg = current_render_config()
    if cfg is None or not cfg.enable:
        return None
    model = ServedModel.objects.order_by("id").first()
    with _client(client) as c:
        outcome = _post_ready(c, cfg.base_url, tiers.render_ready_request(model.name if model else "default"))
    t = thresholds()
    # RenderConfig has no counters: the consecutive run is read back from the latest results.
    recent = list(
        ProbeResult.objects.filter(instance=None, kind="health").values_list("ok", flat=True)[: max(t.rise, t.fall)]
    )
    successes = failures = 0
    for ok in recent:
        if ok and not failures:
            successes += 1
        elif not ok and not successes:
            failures += 1
        else:
            break
    step = next_health(cfg.health, successes, failures, outcome.ok, t)
    with transaction.atomic():
        # Compare-and-set on the verdict read before the probe: a concurrent probe that wrote
        # first owns the flip (this one leaves only its result row).
        written = RenderConfig.objects.filter(id=cfg.id, health=cfg.health).update(
            health=step.health, last_probe_at=timezone.now(), last_probe_error=outcome.error,
        )
        if written and step.changed_from(cfg.health):
            logger.info("render sidecar %s health %s -> %s", cfg.base_url, cfg.health, step.health)
        return ProbeResult.objects.create(
            instance=None, kind="health", ok=outcome.ok, latency_ms=outcome.latency_ms,
            detail={"health": step.health, "url": cfg.base_url}, error=outcome.error,
        )


def _get_json(client: httpx.Client, url: str) -> Any:
    response = client.get(url)
    response.raise_for_status()
    return response.json()


def probed_engines() -> list[EngineInstance]:
    """The engines a probe round asks (every one not disabled), with their served models, by id."""
    return list(
        EngineInstance.objects.select_related("served_model").exclude(state=EngineInstance.State.DISABLED).order_by("id")
    )


@dataclass(slots=True)
class EngineAnswer:
    """An engine's answer to one GET, read once a probe round for every record taken from it:
    ``/v1/models`` for the version probe's (name, root, max_model_len) and the LoRA probe's
    adapters, ``/version`` for the version and the capability probes (``fleet.rounds``)."""

    body: Any = None
    error: str = ""  # why it was not read; each record then keeps what it had
    seconds: float = 0.0  # how long the read took (part of the version probe's latency)


def read_engine_answers(client: httpx.Client, engines: list[EngineInstance], path: str) -> dict[int, EngineAnswer]:
    """GET ``path`` of each engine once; engine id -> its answer."""
    answers: dict[int, EngineAnswer] = {}
    for instance in engines:
        start = time.perf_counter()
        try:
            answers[instance.id] = EngineAnswer(_get_json(client, instance.url.rstrip("/") + path))
        except (httpx.HTTPError, ValueError) as exc:
            answers[instance.id] = EngineAnswer(error=f"{type(exc).__name__}: {exc}")
        answers[instance.id].seconds = time.perf_counter() - start
    return answers


@dataclass(slots=True)
class VersionProbeSummary:
    render_version: str = ""
    streaming_derender: bool | None = None
    drifted: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


def probe_versions(
    *, client: httpx.Client | None = None, engine_models: dict[int, EngineAnswer] | None = None,
    engine_versions: dict[int, EngineAnswer] | None = None,
) -> VersionProbeSummary:
    """Ask the sidecar and every engine what they serve; negotiate render capabilities, flag drift.

    The render sidecar is the reference for the engines of each served model, with the model
    files' hashes taken from the model's active revision when one is set (the operator's record)
    and from the served model's ``model_path`` (the directory the sidecar loads) otherwise.
    ``engine_models`` and ``engine_versions``: the engines' ``/v1/models`` and ``/version`` this
    probe round has read already (``fleet.rounds``); an engine without one is read here.
    """
    summary = VersionProbeSummary()
    cfg = current_render_config()
    # LoRA adapters have no files of a model nor a sidecar of their own: the LoRA probe's business.
    models = list(ServedModel.objects.select_related("active_revision").filter(base=None).order_by("id"))
    # Each model's engines are compared with its own sidecar (one render config per model).
    configs = render_configs_by_model(models)
    sidecars = [cfg] if cfg is not None else []
    for config in configs.values():
        if config is not None and config.pk is not None and all(config.pk != x.pk for x in sidecars):
            sidecars.append(config)
    with _client(client) as c:
        references: dict[int, TierReport] = {}
        answers: dict[int, tuple[str, Any]] = {}  # render config id -> (version, its /v1/models)
        for config in sidecars:
            key = "render" if config is cfg else f"render:{config.name}"
            start = time.perf_counter()
            try:
                with unix_http.reach(c, config.base_url) as (sidecar, base):
                    version = _get_json(sidecar, base + "/version")
                    listed = _get_json(sidecar, base + "/v1/models")
            except (httpx.HTTPError, ValueError) as exc:
                summary.errors[key] = f"{type(exc).__name__}: {exc}"
                _version_result(None, False, start, {}, summary.errors[key])
                continue
            own = summary if config is cfg else VersionProbeSummary()
            own.render_version = str(version.get("version") or "") if isinstance(version, dict) else ""
            _apply_render_version(config, own, start)
            answers[config.pk] = (own.render_version, listed)
        for model in models:
            _record_vocab_size(model)
            fingerprint = (
                model.active_revision.fingerprint() if model.active_revision else fingerprint_model_dir(model.model_path)
            )
            config = configs.get(model.id)
            version, listed = answers.get(config.pk, ("", {})) if config is not None and config.pk else ("", {})
            references[model.id] = TierReport.from_answers(model.name, listed, {"version": version}, fingerprint)
        for config in sidecars:
            if config.pk in answers:
                own_models = sorted(
                    (m for m in models if (configs.get(m.id) is not None and configs[m.id].pk == config.pk)),
                    key=lambda m: m.name,
                )
                _record_render_mismatch(config, own_models, references)
        engines = probed_engines()
        listed_by = dict(engine_models or {})
        listed_by.update(read_engine_answers(c, [i for i in engines if i.id not in listed_by], "/v1/models"))
        # An engine that did not list its models is not asked its version: the result is a failure.
        versions_by = dict(engine_versions or {})
        versions_by.update(read_engine_answers(
            c, [i for i in engines if i.id not in versions_by and not listed_by[i.id].error], "/version"
        ))
        for instance in engines:
            _probe_engine_version(
                instance, listed_by[instance.id], versions_by.get(instance.id), references.get(instance.served_model_id),
                summary,
            )
    return summary


def _record_render_mismatch(cfg: RenderConfig, models: list[ServedModel], references: dict[int, TierReport]) -> None:
    """Compare what the sidecar's ``/v1/models`` reports with each served model's record, as the
    engines' reports are (``record_mismatch``); a change is written once and logged."""
    reasons = [
        f"{model.name}: {reason}" if len(models) > 1 else reason
        for model in models
        for reason in record_mismatch(model.name, model.model_path, references[model.id])
    ]
    mismatch = "; ".join(reasons)[:500]
    if RenderConfig.objects.filter(id=cfg.id).exclude(model_mismatch=mismatch).update(model_mismatch=mismatch):
        if mismatch:
            logger.warning("render sidecar %s: served model record mismatch: %s", cfg.base_url, mismatch)
        else:
            logger.info("render sidecar %s: the served model records match it again", cfg.base_url)


def _record_vocab_size(model: ServedModel) -> None:
    """Write the model's vocabulary size (config.json) into the catalog: the data plane's OOV bound.

    Only a size read from the files replaces the recorded one; an unreadable directory keeps it
    (the operator may have entered it for a coordinator that has no model files).
    """
    size = config_vocab_size(model.model_path)
    if size is not None and size != model.vocab_size:
        with transaction.atomic():
            if ServedModel.objects.filter(id=model.id).update(vocab_size=size):
                bump_control_version()  # vocab_size is in the snapshot
        model.vocab_size = size


def _version_result(instance: EngineInstance | None, ok: bool, start: float, detail: dict[str, Any], error: str = "") -> None:
    ProbeResult.objects.create(
        instance=instance, kind="version", ok=ok, latency_ms=(time.perf_counter() - start) * 1000,
        detail=detail, error=error,
    )


def _apply_render_version(cfg: RenderConfig, summary: VersionProbeSummary, start: float) -> None:
    caps = render_capabilities(summary.render_version)
    summary.streaming_derender = caps.streaming_derender
    problems = []
    if not caps.token_in:
        problems.append(f"sidecar vLLM {summary.render_version or '?'} is older than 0.23: no token-in render")
    elif not caps.derender:
        problems.append(f"sidecar vLLM {summary.render_version} is older than 0.24: no derender")
    elif not caps.streaming_derender:
        # Not an error: streaming requests take the engines' native path instead.
        logger.warning("render sidecar vLLM %s has no streaming derender (< 0.27)", summary.render_version)
    with transaction.atomic():
        changed = RenderConfig.objects.filter(id=cfg.id).exclude(
            sidecar_version=summary.render_version, streaming_derender=caps.streaming_derender
        ).update(sidecar_version=summary.render_version, streaming_derender=caps.streaming_derender)
        if changed:
            bump_control_version()  # streaming_derender is in the snapshot
        _version_result(
            None, not problems, start,
            {"version": summary.render_version, "token_in": caps.token_in, "derender": caps.derender,
             "streaming_derender": caps.streaming_derender},
            "; ".join(problems),
        )


def _probe_engine_version(
    instance: EngineInstance, models: EngineAnswer, version: EngineAnswer | None, reference: TierReport | None,
    summary: VersionProbeSummary,
) -> None:
    start = time.perf_counter() - models.seconds - (version.seconds if version is not None else 0.0)
    report, error = None, models.error or (version.error if version is not None else "")
    if not error and version is not None:
        try:
            fingerprint = fingerprint_model_dir(instance.model_dir) if instance.model_dir else None
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        else:
            report = TierReport.from_answers(instance.served_model.name, models.body, version.body, fingerprint)
    if report is None:
        summary.errors[instance.name] = error
        _version_result(instance, False, start, {}, error)
        return
    reasons = drift_reasons(instance.served_model.name, reference, report) if reference is not None else []
    drift_reason = "; ".join(reasons)[:500]
    mismatch = "; ".join(record_mismatch(instance.served_model.name, instance.served_model.model_path, report))[:500]
    with transaction.atomic():
        row = EngineInstance.objects.filter(id=instance.id).values_list("version_drift", "model_mismatch").first()
        # Compare-and-set on the flags we read, as the health probe does: of two version probes
        # racing (the schedule and "probe now"), the one that wrote first owns the flip and its
        # history row; the other leaves only its result row.
        written = row is not None and EngineInstance.objects.filter(
            id=instance.id, version_drift=row[0], model_mismatch=row[1]
        ).update(
            reported_version=report.version, reported_root=report.root, reported_name=report.name,
            reported_max_model_len=report.max_model_len, reported_fingerprint=report.fingerprint or {},
            version_drift=bool(reasons), drift_reason=drift_reason, model_mismatch=mismatch,
        )
        if not written:
            row = None
        if row is not None and row[1] != mismatch:  # only a change writes history, as for drift
            InstanceEvent.objects.create(
                instance=instance, kind="model", old=str(bool(row[1])).lower(), new=str(bool(mismatch)).lower(),
                actor=ACTOR, reason=mismatch or "the served model's record matches the engine again",
            )
            if mismatch:
                logger.warning("instance %s: served model record mismatch: %s", instance.name, mismatch)
        if row is not None and row[0] != bool(reasons):
            InstanceEvent.objects.create(
                instance=instance, kind="drift", old=str(row[0]).lower(), new=str(bool(reasons)).lower(),
                actor=ACTOR, reason=drift_reason or "matches render again",
            )
            bump_control_version()
        _version_result(
            instance, not reasons, start,
            {"version": report.version, "root": report.root, "max_model_len": report.max_model_len,
             "fingerprint": report.fingerprint, "reasons": reasons},
            drift_reason,
        )
    if reasons:
        summary.drifted.append(instance.name)
        # The policy acts on every probe, not only on the flip: an operator who re-activates a
        # drifted engine without fixing it sees it quarantined again at the next probe.
        if settings.MOTOR_QUARANTINE_ON_DRIFT and instance.quarantine(reason=f"version drift: {drift_reason}", actor=ACTOR):
            bump_control_version()
            summary.quarantined.append(instance.name)
            logger.warning("instance %s quarantined: %s", instance.name, drift_reason)


class _client:
    """Use the caller's client, or a fresh one closed afterwards."""

    def __init__(self, client: httpx.Client | None) -> None:
        self._given = client
        self._own: httpx.Client | None = None

    def __enter__(self) -> httpx.Client:
        if self._given is not None:
            return self._given
        self._own = http_client()
        return self._own

    def __exit__(self, *exc: object) -> None:
        if self._own is not None:
            self._own.close()


# -- retention and audit ------------------------------------------------------------------------


def prune_probe_results(*, now: Any = None) -> int:
    """Delete probe results older than ``MOTOR_PROBE_RETENTION_DAYS``; return how many."""
    cutoff = (now or timezone.now()) - timedelta(days=settings.MOTOR_PROBE_RETENTION_DAYS)
    deleted, _ = ProbeResult.objects.filter(created__lt=cutoff).delete()
    return deleted


def audit_fleet() -> AuditReport:
    """Record the fleet's state as the control plane sees it now (one row, a JSON summary)."""
    cfg = current_render_config()
    instances = []
    for i in EngineInstance.objects.select_related("served_model", "breaker").order_by("name"):
        try:
            breaker = i.breaker.state
        except BreakerState.DoesNotExist:
            breaker = BreakerState.State.CLOSED
        instances.append(
            {
                "name": i.name, "model": i.served_model.name, "role": i.role, "state": i.state,
                "health": i.health, "breaker": breaker, "version": i.reported_version,
                "version_drift": i.version_drift, "drift_reason": i.drift_reason,
                "last_probe_at": i.last_probe_at.isoformat() if i.last_probe_at else None,
            }
        )
    serving = [
        x["name"] for x in instances
        if x["state"] == "active" and x["health"] != Health.FAILING and x["breaker"] != BreakerState.State.OPEN
    ]
    summary = {
        "render": None if cfg is None else {
            "url": cfg.base_url, "enable": cfg.enable, "health": cfg.health, "version": cfg.sidecar_version,
            "streaming_derender": cfg.streaming_derender, "traffic": render_traffic(cfg.sidecar_version),
        },
        "instances": instances,
        "counts": {
            "total": len(instances),
            "serving": len(serving),
            "failing": sum(x["health"] == Health.FAILING for x in instances),
            "breaker_open": sum(x["breaker"] == BreakerState.State.OPEN for x in instances),
            "version_drift": sum(x["version_drift"] for x in instances),
            "by_state": {s: sum(x["state"] == s for x in instances) for s in EngineInstance.State.values},
        },
    }
    return AuditReport.objects.create(summary=summary)
