"""The LoRA probe: which LoRA adapters each engine has loaded, from the engine's own ``/v1/models``.

vLLM lists every adapter it loaded (``--enable-lora --lora-modules NAME=DIR``, or at runtime) as
a card of its own whose ``parent`` is the model it adapts. The probe records those names on the
engine's row (``EngineInstance.lora_adapters``); the snapshot carries them
(``InstanceView.lora_adapters``) and placement sends a request for an adapter's served model only
to engines that list it (``placement/filters.py``). A change bumps the control version, so it
reaches traffic within one snapshot poll. An engine that does not answer keeps its last record:
whether it takes traffic at all is the health probe's verdict, not this one's.

This is the one record of an engine's adapters: the capability probe (``fleet.engine_probes``)
records only whether LoRA is enabled, and the admin, the API (``lora_adapters``) and the
dashboard show this list (``fleet.engine_capabilities.instance_traffic``).

Runs in every probe round of Celery beat (``fleet.rounds``, every probe interval: adapters can be
loaded and unloaded at runtime) on the same ``/v1/models`` answer the version probe reads, and
alone once when ``make run`` has started the stack (``runstack``, ``manage.py probe_lora``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import httpx
from django.db import transaction

from fleet.models import EngineInstance
from fleet.probes import EngineAnswer, _client, probed_engines, read_engine_answers
from motorsite.core import bump_control_version

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoraProbeSummary:
    probed: int = 0
    changed: list[str] = field(default_factory=list)  # engines whose adapters changed
    errors: dict[str, str] = field(default_factory=dict)  # engine name -> why it was not read


def loaded_adapters(models: Any, served_name: str) -> list[str]:
    """The adapter names in a ``/v1/models`` answer: cards whose ``parent`` is ``served_name``, sorted.

    Raises ValueError for an answer that is not a model list."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models answered without a model list")
    return sorted({
        str(card["id"]) for card in data
        if isinstance(card, dict) and card.get("parent") == served_name and card.get("id")
    })


def record_adapters(engines: list[EngineInstance], answers: dict[int, EngineAnswer]) -> LoraProbeSummary:
    """Record the adapters each engine lists in its ``/v1/models`` answer, where they changed."""
    summary = LoraProbeSummary(probed=len(engines))
    found: dict[int, list[str]] = {}
    for instance in engines:
        answer = answers[instance.id]
        if answer.error:
            summary.errors[instance.name] = answer.error[:300]
            continue
        try:
            found[instance.id] = loaded_adapters(answer.body, instance.served_model.name)
        except ValueError as exc:
            summary.errors[instance.name] = str(exc)[:300]
    with transaction.atomic():
        for instance in engines:
            adapters = found.get(instance.id)
            if adapters is None or adapters == sorted(instance.lora_adapters or []):
                continue
            EngineInstance.objects.filter(id=instance.id).update(lora_adapters=adapters)
            summary.changed.append(instance.name)
            logger.info("lora probe engine=%s adapters %s -> %s", instance.name, instance.lora_adapters, adapters)
        if summary.changed:
            bump_control_version()
    return summary


def probe_lora_adapters(*, client: httpx.Client | None = None) -> LoraProbeSummary:
    """Read every engine's loaded adapters (not disabled ones) and record those that changed: a
    round of the LoRA probe alone (``manage.py probe_lora``; beat's rounds are ``fleet.rounds``)."""
    engines = probed_engines()
    with _client(client) as http:
        return record_adapters(engines, read_engine_answers(http, engines, "/v1/models"))
