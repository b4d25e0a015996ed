"""Capability probes of the engines: what each one's vLLM serves, asked of the engine itself.

- version: ``GET /version``; below 0.23 (the RFC's Token-In floor) no token-only request;
- routes: the engine's OpenAPI document (FastAPI serves it). vLLM leaves the scale-out stubs of
  a plain ``vllm serve`` out of it (``include_in_schema=False``; they answer 403), so a listed
  ``/inference/v1/generate`` is one that generates;
- tokenizer: ``POST /tokenize`` of a short text. A ``--tokens-only`` engine keeps the route but
  has no tokenizer (``skip_tokenizer_init``) and answers 400; a 404 (the served name is not
  the engine's) or an unreachable route gives no verdict;
- LoRA: enabled when ``/metrics`` carries ``vllm:lora_requests_info`` (vLLM registers it only
  with a LoRA config). Which adapters are loaded is not recorded here: they can change at runtime,
  so the LoRA probe (``fleet.lora_probes``) records them every probe round from the engine's
  ``/v1/models`` (``fleet.rounds``) into ``EngineInstance.lora_adapters``, the one record
  placement, the admin and the API read.

Runs after the version probe, in the probe round that runs it (once a minute, ``fleet.rounds``).

What the answers mean for placement is pure and lives in ``fleet.engine_capabilities``; a
change is written once (compare-and-set), with a history row, and bumps the control version
(the snapshot carries it).
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
from django.db import transaction

from fleet.engine_capabilities import routes_from_openapi, token_in
from fleet.models import EngineInstance, InstanceEvent
from fleet.probes import ACTOR, EngineAnswer, _client, _get_json, probed_engines, read_engine_answers
from motorsite.core import bump_control_version

logger = logging.getLogger(__name__)


def _tokenizer_loaded(client: httpx.Client, base: str, served_name: str) -> bool | None:
    try:
        response = client.post(base + "/tokenize", json={"model": served_name, "prompt": "hi"})
    except httpx.HTTPError:
        return None
    if response.status_code == 200:
        return True
    # vLLM's renderer: "Tokenizer not available when `skip_tokenizer_init=True`" (400).
    if response.status_code in (400, 500) and "tokenizer" in response.text.lower():
        return False
    return None


def _lora_enabled(client: httpx.Client, base: str) -> bool:
    try:
        metrics = client.get(base + "/metrics")
    except httpx.HTTPError:
        return False
    return metrics.status_code == 200 and "vllm:lora_requests_info" in metrics.text


def engine_capabilities(
    client: httpx.Client, base_url: str, served_name: str, *, version_answer: EngineAnswer | None = None
) -> dict[str, Any]:
    """What the engine at ``base_url`` reports it can do (raises ``httpx.HTTPError``, ``ValueError``
    when it gives no version: an engine that cannot say that is not probed at all).

    ``version_answer``: its ``/version``, read already by the probe round (``fleet.rounds``);
    read here when None."""
    base = base_url.rstrip("/")
    answer = _get_json(client, base + "/version") if version_answer is None else version_answer.body
    version = str((answer or {}).get("version") or "") if isinstance(answer, dict) else ""
    caps: dict[str, Any] = {"version": version, "token_in": token_in(version)}
    try:
        paths = set((_get_json(client, base + "/openapi.json") or {}).get("paths") or {})
    except (httpx.HTTPError, ValueError, AttributeError):
        caps["routes"] = None  # unknown: the version floor alone decides
    else:
        caps["routes"] = routes_from_openapi(paths)
        caps["token_in"] = caps["token_in"] and caps["routes"]["generate"]
    caps["tokenizer_loaded"] = _tokenizer_loaded(client, base, served_name)
    caps["lora"] = {"enabled": _lora_enabled(client, base)}
    return caps


def probe_engine_capabilities(
    *, client: httpx.Client | None = None, engine_versions: dict[int, EngineAnswer] | None = None
) -> dict[str, dict[str, Any] | None]:
    """Probe every engine not disabled; return name -> what it recorded (None: no answer).

    ``engine_versions``: the engines' ``/version`` the probe round has read already for the
    version probe (``fleet.rounds``); an engine without one is read here."""
    found: dict[str, dict[str, Any] | None] = {}
    with _client(client) as c:
        engines = probed_engines()
        versions = dict(engine_versions or {})
        versions.update(read_engine_answers(c, [i for i in engines if i.id not in versions], "/version"))
        for instance in engines:
            version = versions[instance.id]
            caps, error = None, version.error
            if not error:
                try:
                    caps = engine_capabilities(c, instance.url, instance.served_model.name, version_answer=version)
                except (httpx.HTTPError, ValueError) as exc:
                    error = f"{type(exc).__name__}: {exc}"
            if caps is None:
                # Keep the last record: an engine that is down is the health probe's to judge.
                logger.info("instance %s: capability probe failed: %s", instance.name, error)
                found[instance.name] = None
                continue
            record_capabilities(instance, caps)
            found[instance.name] = caps
    return found


def _summary(caps: dict[str, Any]) -> str:
    routes = caps.get("routes")
    route_text = "routes unknown" if not isinstance(routes, dict) else (
        ("generate, " if routes.get("generate") else "no generate, ")
        + ("native " + "/".join(routes.get("native") or []) if routes.get("native") else "no native API")
    )
    tokenizer = {True: "tokenizer loaded", False: "tokens-only", None: "tokenizer unknown"}[caps.get("tokenizer_loaded")]
    return f"vLLM {caps.get('version') or '?'}: {route_text}; {tokenizer}"


def record_capabilities(instance: EngineInstance, caps: dict[str, Any]) -> bool:
    """Write ``caps`` if they changed since the row was read; True if this call wrote them."""
    with transaction.atomic():
        old = EngineInstance.objects.filter(id=instance.id).values_list("capabilities", flat=True).first()
        if old is None or old == caps:
            return False
        # Compare-and-set on the record read: of two probes racing, the first writes the history row.
        if not EngineInstance.objects.filter(id=instance.id, capabilities=old).update(capabilities=caps):
            return False
        InstanceEvent.objects.create(
            instance=instance, kind="capabilities", old=str((old or {}).get("version") or "")[:30],
            new=str(caps.get("version") or "")[:30], actor=ACTOR, reason=_summary(caps)[:500],
        )
        bump_control_version()  # placement reads them from the snapshot
    instance.capabilities = caps
    logger.info("instance %s: capabilities %s", instance.name, _summary(caps))
    return True
