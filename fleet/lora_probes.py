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

Runs on Celery beat (``fleet.tasks.probe_lora``, every probe interval: adapters can be loaded
and unloaded at runtime) and once when ``make run`` has started the stack (``runstack``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import httpx
from django.db import transaction

from fleet.models import EngineInstance
from fleet.probes import _client, _get_json
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


def probe_engine_adapters(client: httpx.Client, instance: EngineInstance) -> list[str]:
    """The adapters ``instance`` lists for its served model (raises ``httpx.HTTPError``, ``ValueError``)."""
    return loaded_adapters(_get_json(client, instance.url.rstrip("/") + "/v1/models"), instance.served_model.name)


def probe_lora_adapters(*, client: httpx.Client | None = None) -> LoraProbeSummary:
    """Read every engine's loaded adapters (not disabled ones) and record those that changed."""
    summary = LoraProbeSummary()
    instances = list(
        EngineInstance.objects.select_related("served_model").exclude(state=EngineInstance.State.DISABLED)
    )
    found: dict[int, list[str]] = {}
    with _client(client) as http:
        for instance in instances:
            summary.probed += 1
            try:
                found[instance.id] = probe_engine_adapters(http, instance)
            except (httpx.HTTPError, ValueError) as exc:
                summary.errors[instance.name] = repr(exc)[:300]
    with transaction.atomic():
        for instance in instances:
            adapters = found.get(instance.id)
            if adapters is None or adapters == sorted(instance.lora_adapters or []):
                continue
            EngineInstance.objects.filter(id=instance.id).update(lora_adapters=adapters)
            summary.changed.append(instance.name)
            logger.info("lora probe engine=%s adapters %s -> %s", instance.name, instance.lora_adapters, adapters)
        if summary.changed:
            bump_control_version()
    return summary
