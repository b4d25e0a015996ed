"""What the admin, the dashboard and the REST API show about instances beyond their own rows.

Read once per page or response, never per row: the render config's obfuscation verdict
(``ObfuscationStatus``) and this process's tokens in flight (``inflight_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from catalog.models import RenderConfig
from fleet.models import EngineInstance
from motorsite.core import current_render_config
from serving import obfuscation_keys
from serving.pipeline.obfuscation import keyring as obfuscation
from serving.pipeline.snapshot import RenderView

if TYPE_CHECKING:
    from serving.pipeline.snapshot import InstanceView


def inflight_tokens() -> dict[str, int] | None:
    """Tokens in flight per instance name in this process's data plane; None when unknown."""
    # Imported on call, not at the top: the data-plane host builds its process singletons (admission,
    # breakers, clients) on import, which a Celery worker or `migrate` loading the admin must not do.
    from serving import runtime

    try:
        return dict(runtime.inflight_tokens())
    except Exception:  # a placeholder column must not break the admin or the API
        return None


@dataclass(frozen=True, slots=True)
class ObfuscationStatus:
    """The render config's obfuscation setting, read once per page or response, never per row."""

    render: RenderView
    key_error: str  # why the configured key cannot serve traffic; "" when it can (or obfuscation is off)

    @classmethod
    def current(cls) -> ObfuscationStatus:
        return cls.of(current_render_config())

    @classmethod
    def of(cls, cfg: RenderConfig | None) -> ObfuscationStatus:
        """From a render config the caller already fetched (None: the defaults, obfuscation off)."""
        cfg = cfg or RenderConfig()
        render = RenderView(
            enable=cfg.enable, base_url="", timeout_s=0.0,
            obfuscation=cfg.obfuscation, obfuscation_key_id=cfg.obfuscation_key_id,
        )
        return cls(render, _key_error(cfg) if cfg.obfuscation else "")

    def excluded_reason(self, instance: EngineInstance) -> str | None:
        # eligible() reads only obfuscation_key_id, which the model row carries under the same name.
        ok, why = obfuscation.eligible(cast("InstanceView", instance), self.render)
        if not ok:
            return why
        return self.key_error or None


def _key_error(cfg: RenderConfig) -> str:
    """Why ``cfg``'s key refuses traffic, checked here rather than trusted from this process's last snapshot.

    The admin may run in a process that never built a snapshot, so ``load_error`` alone could be
    empty; it still adds what only loading finds (the model's vocabulary).
    """
    if not cfg.obfuscation_key_ref:
        return "the render config has no obfuscation key reference"
    try:
        found = obfuscation_keys.key_id_of(cfg.obfuscation_key_ref)
    except obfuscation_keys.KeyUnavailable as exc:
        return f"obfuscation key {cfg.obfuscation_key_id or '(no id)'} unavailable: {exc}"
    if found != cfg.obfuscation_key_id:
        return f"the key at {cfg.obfuscation_key_ref} has id {found}, the render config names {cfg.obfuscation_key_id or '(none)'}"
    return obfuscation.load_error()


def route_decisions() -> list[tuple[str, str, str, int]]:
    """This process's route decisions as ``(model, path, reason, count)`` (the native path's reasons)."""
    from serving import runtime  # on call, as ``inflight_tokens``

    return runtime.counters.route_decisions()
