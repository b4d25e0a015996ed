"""A probe round of the engines: each engine's ``/v1/models`` and ``/version`` are read once and
serve every record taken from them.

Celery beat runs a round every probe interval (``fleet.tasks.probe_engines``). Every round records
the LoRA adapters each engine has loaded (``fleet.lora_probes``: they can change at runtime). Once
a minute the round also reads each engine's ``/version`` and runs, on the same answers, the
version probe (``fleet.probes``: the sidecars' versions, each engine's served name, root,
max_model_len, version and model files, drift and the quarantine policy), then the capability
probe (``fleet.engine_probes``: the version again, routes, tokenizer, LoRA; no ``/v1/models``).
Versions change only when someone redeploys a tier, and the version probe reads four model files
per engine: once a minute catches a mismatched rollout quickly.

"Once a minute" is kept by the probe results themselves, so it holds across workers and restarts:
a round runs the version probe when none has recorded a result for a minute
(``versions_due``). An engine that does not answer ``/v1/models`` keeps its records, as each
probe alone did: whether it takes traffic is the health probe's verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
from django.conf import settings
from django.utils import timezone

from fleet.engine_probes import probe_engine_capabilities
from fleet.lora_probes import LoraProbeSummary, record_adapters
from fleet.models import ProbeResult
from fleet.probes import VersionProbeSummary, _client, probe_versions, probed_engines, read_engine_answers

VERSIONS_EVERY = timedelta(minutes=1)


@dataclass(slots=True)
class RoundSummary:
    lora: LoraProbeSummary
    versions: VersionProbeSummary | None = None  # None: not this round
    capabilities: dict[str, dict[str, Any] | None] | None = None


def versions_due(*, now: datetime | None = None) -> bool:
    """Whether this round runs the version probe: no version result in the last minute.

    Less half a probe interval: beat's rounds are an interval apart, so the round about a minute
    after the last version probe runs it, not the one after (late by however long that took)."""
    since = (now or timezone.now()) - VERSIONS_EVERY + timedelta(seconds=settings.MOTOR_PROBE_INTERVAL_S / 2)
    return not ProbeResult.objects.filter(kind="version", created__gte=since).exists()


def probe_round(*, versions: bool, client: httpx.Client | None = None) -> RoundSummary:
    """Read each engine's ``/v1/models`` once; record its adapters, and with ``versions`` read each
    engine's ``/version`` once and run the version probe and then the capability probe on the
    same answers."""
    with _client(client) as c:
        engines = probed_engines()
        answers = read_engine_answers(c, engines, "/v1/models")
        summary = RoundSummary(lora=record_adapters(engines, answers))
        if versions:
            versions_read = read_engine_answers(c, engines, "/version")
            summary.versions = probe_versions(client=c, engine_models=answers, engine_versions=versions_read)
            summary.capabilities = probe_engine_capabilities(client=c, engine_versions=versions_read)
    return summary
