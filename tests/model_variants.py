"""Variants of the tiny model for tests: the same files, one of them changed.

Built in a test's temporary directory in milliseconds: every file but the changed one is a
symlink to the cached tiny model (``MOTOR_MODEL_DIR``), so no weights or tokenizer are copied
and the model's cache key (``toolchain``) is untouched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Sampling defaults as a chat model ships them (Qwen3's generation_config.json sets the first
# four); max_new_tokens makes an omitted chat max_tokens observable in a short answer.
GENERATION_DEFAULTS: dict[str, Any] = {
    "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05,
    "max_new_tokens": 9,
}


def with_generation_config(source: str | Path, target: Path, defaults: dict[str, Any] = GENERATION_DEFAULTS) -> Path:
    """``target`` made the model at ``source`` with ``defaults`` added to its generation_config.json."""
    source = Path(source)
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name != "generation_config.json":
            (target / f.name).symlink_to(f.resolve())
    original = source / "generation_config.json"
    config = json.loads(original.read_text()) if original.exists() else {}
    (target / "generation_config.json").write_text(json.dumps({**config, **defaults}, indent=2))
    return target
