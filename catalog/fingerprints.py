"""Content hashes of the files that decide whether two tiers serve the same model. Pure, no Django.

The chat template may live in ``tokenizer_config.json`` (``chat_template``) or in
``chat_template.jinja``; either way the template text is hashed, so moving it between the two
does not count as a change. A missing file hashes to "".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

FILES = {"config": "config.json", "tokenizer": "tokenizer.json", "generation_config": "generation_config.json"}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def chat_template_text(model_dir: Path) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tok_cfg = model_dir / "tokenizer_config.json"
    if tok_cfg.is_file():
        try:
            template = json.loads(tok_cfg.read_text(encoding="utf-8")).get("chat_template")
        except ValueError:
            return None
        if isinstance(template, list):  # named templates: hash them all, in a stable form
            return json.dumps(template, sort_keys=True)
        if isinstance(template, str):
            return template
    return None


def fingerprint_model_dir(path: str | Path) -> dict[str, str]:
    """Return ``{"config", "tokenizer", "chat_template", "generation_config"}`` -> sha256 hex ("" if absent)."""
    model_dir = Path(path)
    out: dict[str, str] = {}
    for key, name in FILES.items():
        f = model_dir / name
        out[key] = _sha256(f.read_bytes()) if f.is_file() else ""
    template = chat_template_text(model_dir)
    out["chat_template"] = _sha256(template.encode("utf-8")) if template is not None else ""
    return out


def config_vocab_size(path: str | Path) -> int | None:
    """The model's ``vocab_size`` from ``config.json`` (or its ``text_config``), None when unreadable.

    Read fresh on every call (no cache): a missing file now may exist at the next probe.
    """
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    size = config.get("vocab_size")
    text = config.get("text_config")
    if size is None and isinstance(text, dict):
        size = text.get("vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
