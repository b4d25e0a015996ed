"""Obfuscation keys: resolve the render config's key reference into a loaded token mapping.

The render config stores where the key is, never the key (``RenderConfig.obfuscation_key_ref``),
and may name only what exists to hold one (``catalog.key_refs``, checked again here):

- ``setting:MOTOR_OBFUSCATION_KEY[_NAME]``: the Django setting of that name, else the environment variable;
- ``file:/path`` under ``MOTOR_OBFUSCATION_KEY_DIR``: the file's contents (surrounding whitespace
  stripped), e.g. a mounted secret.

The key id is a short hash of the key (``serving.pipeline.obfuscation.key_id``): the render config
names it and each engine instance declares the one its weights were permuted with, so a rotation
is a new key, a new id, and engines moving over as they declare it.

``load_for`` runs where the snapshot is built (a worker thread, never the request path) and
registers the mapping with the data plane; a failure registers nothing, so requests are refused
(fail closed) with the reason logged and kept for the admin (``pipeline.obfuscation.load_error``).
"""

from __future__ import annotations

import json
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from django.conf import settings

from catalog.key_refs import InvalidKeyRef, check_key_ref
from serving.pipeline.obfuscation import keyring as obfuscation
from serving.pipeline.obfuscation.mapping import MIN_KEY_BYTES, TokenMapping, key_id

if TYPE_CHECKING:
    from catalog.models import RenderConfig
    from serving.pipeline.snapshot import ModelView

logger = logging.getLogger(__name__)


class KeyUnavailable(Exception):
    """The key reference cannot be resolved into usable key material."""


def resolve_key(ref: str) -> bytes:
    """Return the key material ``ref`` points to; raise ``KeyUnavailable`` saying why not (never the key)."""
    try:
        # Before anything is read: a reference to another secret must not even be looked at.
        kind, where = check_key_ref(ref)
    except InvalidKeyRef as exc:
        raise KeyUnavailable(str(exc)) from None
    if kind == "setting":
        value = getattr(settings, where, None)
        if value is None:
            value = os.environ.get(where)
        if not value:
            raise KeyUnavailable(f"setting or environment variable {where} is not set")
        key = value if isinstance(value, bytes) else str(value).encode()
    else:
        try:
            key = Path(where).read_bytes().strip()
        except OSError as exc:
            raise KeyUnavailable(f"cannot read key file {where}: {exc.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise KeyUnavailable(f"the key from {ref} is shorter than {MIN_KEY_BYTES} bytes")
    return key


def key_id_of(ref: str) -> str:
    """The key id of the key ``ref`` points to (for the admin's "fill in the key id" help)."""
    return key_id(resolve_key(ref))


def vocab_size_for(models: Iterable[ModelView]) -> int:
    """The vocabulary the mapping covers: ``MOTOR_OBFUSCATION_VOCAB_SIZE``, else the served model's ``config.json``.

    One vocabulary per deployment: the render sidecar serves one model, and engines permute the
    rows of that model's embedding (``vocab_size`` rows, padding included).
    """
    configured = getattr(settings, "MOTOR_OBFUSCATION_VOCAB_SIZE", None) or os.environ.get("MOTOR_OBFUSCATION_VOCAB_SIZE")
    if configured:
        return int(configured)
    for m in models:
        try:
            return int(json.loads((Path(m.model_path) / "config.json").read_text())["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    raise KeyUnavailable("no served model has a readable config.json; set MOTOR_OBFUSCATION_VOCAB_SIZE")


@lru_cache(maxsize=8)
def _mapping(key: bytes, vocab_size: int) -> TokenMapping:
    # Building a 150k-entry permutation takes tens of milliseconds: once per key and vocabulary.
    return TokenMapping.from_key(key, vocab_size)


def load_mapping(ref: str, vocab_size: int) -> TokenMapping:
    return _mapping(resolve_key(ref), vocab_size)


def load_for(cfg: RenderConfig, models: Iterable[ModelView]) -> TokenMapping | None:
    """Load and register the mapping of ``cfg``'s key when obfuscation is on; return it or None.

    Never raises: a missing or invalid key leaves no mapping for the configured key id, and the
    request path refuses traffic. A key whose id is not the configured one is registered anyway
    so the refusal says "mismatch" (a half-done rotation) rather than "missing".
    """
    if not cfg.obfuscation:
        return None
    try:
        if not cfg.obfuscation_key_ref:
            raise KeyUnavailable("the render config has no obfuscation key reference")
        mapping = load_mapping(cfg.obfuscation_key_ref, vocab_size_for(models))
    except (KeyUnavailable, ValueError) as exc:
        reason = f"obfuscation key {cfg.obfuscation_key_id or '(no id)'} unavailable: {exc}"
        logger.error("%s; refusing traffic", reason)
        obfuscation.register_load_error(reason)
        return None
    obfuscation.register_mapping(mapping)
    if mapping.key_id != cfg.obfuscation_key_id:
        reason = f"the key at {cfg.obfuscation_key_ref} has id {mapping.key_id}, the render config names {cfg.obfuscation_key_id}"
        logger.error("%s; refusing traffic", reason)
        obfuscation.register_load_error(reason)
    return mapping
