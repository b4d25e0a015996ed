"""Probes of each render pool member: its vLLM version, the routes it serves, and its health.

What a member can do is recorded on its own row (``catalog.RenderSidecar.capabilities``), where
the snapshot builder reads the version floors from (``serving.snapshots.render_members``) and the
admin shows it. Routes come from the sidecar's own OpenAPI document (FastAPI serves it): render
for chat, completions, messages and responses, and derender for chat and completions; a route
missing there is a route the member does not serve, whatever its version. Health is a real
one-token chat render, with the same rise/fall thresholds as the engines' probes.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
from django.db import transaction
from django.utils import timezone

from catalog.models import RenderSidecar, ServedModel
from catalog.render_versions import render_capabilities
from fleet.probes import _client, _post_ready, thresholds
from fleet.verdicts import next_health
from motorsite import tiers, unix_http
from motorsite.core import bump_control_version

logger = logging.getLogger(__name__)

RENDER_ROUTES = {
    "chat": "/v1/chat/completions/render", "completions": "/v1/completions/render",
    "messages": "/v1/messages/render", "responses": "/v1/responses/render",
}
DERENDER_ROUTES = {"chat": "/v1/chat/completions/derender", "completions": "/v1/completions/derender"}


def member_capabilities(client: httpx.Client, base_url: str) -> dict[str, Any]:
    """What the sidecar at ``base_url`` reports it can do (raises ``httpx.HTTPError``, ``ValueError``)."""
    with unix_http.reach(client, base_url) as (c, base):  # a sidecar on a unix socket too
        return _capabilities(c, base)


def _capabilities(client: httpx.Client, base: str) -> dict[str, Any]:
    version_answer = client.get(base + "/version")
    version_answer.raise_for_status()
    version = str((version_answer.json() or {}).get("version") or "")
    caps = render_capabilities(version)
    out: dict[str, Any] = {"version": version, "token_in": caps.token_in, "derender": caps.derender,
                           "streaming_derender": caps.streaming_derender}
    try:
        spec = client.get(base + "/openapi.json")
        spec.raise_for_status()
        paths = set((spec.json() or {}).get("paths") or {})
    except (httpx.HTTPError, ValueError):
        out["routes"] = None  # unknown: the version floors alone decide
    else:
        out["routes"] = {
            "render": [k for k, path in RENDER_ROUTES.items() if path in paths],
            "derender": [k for k, path in DERENDER_ROUTES.items() if path in paths],
        }
        # A member without the derender routes derenders nothing, whatever its version says.
        if not out["routes"]["derender"]:
            out["derender"] = out["streaming_derender"] = False
        if "chat" not in out["routes"]["render"]:
            out["token_in"] = False
    return out


def probe_render_pool(*, client: httpx.Client | None = None) -> dict[str, bool]:
    """Probe every member of every enabled render config's pool; return base URL -> health probe ok."""
    first = ServedModel.objects.order_by("id").first()
    outcomes: dict[str, bool] = {}
    with _client(client) as c:
        members = RenderSidecar.objects.filter(render_config__enable=True).select_related("render_config__served_model")
        for member in members.order_by("render_config_id", "id"):
            # A model's own sidecar knows only its model's name; the default config serves the first.
            owner = member.render_config.served_model or first
            outcome = _post_ready(c, member.base_url, tiers.render_ready_request(owner.name if owner else "default"))
            # The chat render proved the tokenizer and the template load.
            try:
                caps = {**member_capabilities(c, member.base_url), "tokenizer_loaded": outcome.ok}
            except (httpx.HTTPError, ValueError) as exc:
                caps, outcome.ok = dict(member.capabilities), False
                outcome.error = outcome.error or f"{type(exc).__name__}: {exc}"
            _record(member, caps, outcome.ok, outcome.error)
            outcomes[member.base_url] = outcome.ok
    return outcomes


def _record(member: RenderSidecar, caps: dict[str, Any], ok: bool, error: str) -> None:
    step = next_health(member.health, member.consecutive_successes, member.consecutive_failures, ok, thresholds())
    version = str(caps.get("version") or member.sidecar_version)
    with transaction.atomic():
        # Compare-and-set on the verdict read: a concurrent probe that wrote first owns the flip.
        written = RenderSidecar.objects.filter(id=member.id, health=member.health).update(
            health=step.health, consecutive_successes=step.successes, consecutive_failures=step.failures,
            sidecar_version=version, capabilities=caps, last_probe_at=timezone.now(), last_probe_error=error,
        )
        if written and (step.changed_from(member.health) or caps != member.capabilities
                        or version != member.sidecar_version):
            bump_control_version()  # health and capabilities are in the snapshot
            logger.info("render sidecar %s: health %s -> %s, capabilities %s", member.base_url, member.health,
                        step.health, caps)
