"""The process's obfuscation keys: which mapping a request uses, and which instances may take it.

Keys are secrets and never enter the snapshot: the Django side (``serving.obfuscation_keys``)
resolves the render config's key reference when a snapshot is built and registers the mapping
here; the request path only looks it up by the key id the snapshot names. Both checks fail
closed: obfuscation on without the named key refuses all traffic (``require_mapping``), and an
instance whose weights were not obfuscated with that key takes none of it (``eligible``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.pipeline.obfuscation.mapping import ObfuscationKeyError, TokenMapping

if TYPE_CHECKING:
    from serving.pipeline.snapshot import FleetSnapshot, InstanceView, RenderView


def require_mapping(render: RenderView, mapping: TokenMapping | None) -> TokenMapping | None:
    """Return the mapping to use for a request: ``None`` without obfuscation, else ``mapping``.

    Raises ``ObfuscationKeyError`` when obfuscation is on and there is no key, or the loaded
    key is not the one the render config names (a rotation half done): traffic is refused, never
    sent plain and never sent to an engine's native OpenAI path instead.
    """
    if not render.obfuscation:
        return None
    if not render.obfuscation_key_id:
        raise ObfuscationKeyError("token obfuscation is on but the render config names no key id; refusing traffic")
    if mapping is None:
        raise ObfuscationKeyError(
            f"token obfuscation is on but key {render.obfuscation_key_id} is not available; refusing traffic"
        )
    if mapping.key_id != render.obfuscation_key_id:
        raise ObfuscationKeyError(
            f"token obfuscation key mismatch: the render config names {render.obfuscation_key_id}, "
            f"the loaded key is {mapping.key_id}; refusing traffic"
        )
    return mapping


def eligible(instance: InstanceView, render: RenderView) -> tuple[bool, str]:
    """Whether ``instance`` may take this deployment's token-only traffic, and why not.

    With obfuscation on, only instances that declare the render config's key id; with it off,
    only instances with plain weights (an obfuscated engine fed plain ids answers garbage).
    """
    if render.obfuscation:
        if not render.obfuscation_key_id:
            return False, "obfuscation is on but the render config names no key id"
        if not instance.obfuscation_key_id:
            return False, f"instance serves plain weights; obfuscated traffic needs key {render.obfuscation_key_id}"
        if instance.obfuscation_key_id != render.obfuscation_key_id:
            return False, (
                f"instance key id {instance.obfuscation_key_id} differs from the render config's "
                f"{render.obfuscation_key_id}"
            )
        return True, ""
    if instance.obfuscation_key_id:
        return False, f"instance serves weights obfuscated with key {instance.obfuscation_key_id} but obfuscation is off"
    return True, ""


_mappings: dict[str, TokenMapping] = {}
_latest: TokenMapping | None = None
_load_error = ""


def register_mapping(mapping: TokenMapping) -> None:
    global _latest, _load_error
    _mappings[mapping.key_id] = mapping
    _latest = mapping
    _load_error = ""


def register_load_error(reason: str) -> None:
    """Remember why the configured key could not be loaded (shown by ``load_error``, logged by the caller)."""
    global _load_error
    _load_error = reason


def load_error() -> str:
    return _load_error


def clear_mappings() -> None:
    global _latest, _load_error
    _mappings.clear()
    _latest = None
    _load_error = ""


def mapping_for(snapshot: FleetSnapshot) -> TokenMapping | None:
    """The loaded mapping the snapshot's render config names, else the last one loaded (or None).

    Returning the last one on a miss lets ``require_mapping`` say "mismatch" rather than "missing".
    """
    if not snapshot.render.obfuscation:
        return None
    return _mappings.get(snapshot.render.obfuscation_key_id) or _latest
