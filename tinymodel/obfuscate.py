"""Build an obfuscated copy of a model directory: ``python -m tinymodel.obfuscate SRC OUT``.

The key comes from the environment variable named by ``--key-env`` (default
``MOTOR_OBF_KEY``), never from argv (visible in ``ps``). The copy serves physical token ids:

- ``model.embed_tokens.weight`` and ``lm_head.weight`` rows are permuted, so physical id
  ``forward[s]`` embeds and scores exactly like semantic id ``s``; nothing else depends on ids;
- every special-token id in ``config.json``, ``generation_config.json`` and the
  ``added_tokens_decoder`` of ``tokenizer_config.json`` is mapped the same way. A
  ``--tokens-only`` engine loads no tokenizer and stops on ``generation_config.json``'s
  ``eos_token_id``s, so those must be the physical ones;
- no ``tokenizer.json`` and no chat template: the engine never needs them, and a tokenizer
  beside obfuscated weights would encode text straight into ids the model does not use.

The permutation is ``serving.pipeline.obfuscation.mapping.permutation``, the same function the
coordinator maps requests with. Output goes to a sibling temporary directory renamed into place.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from serving.pipeline.obfuscation.mapping import TokenMapping
from tinymodel.build import dump_json, staged_dir

# Tensors with one row per vocabulary entry (Qwen2, untied embeddings).
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
# Kept only if present; everything else (tokenizer.json, vocab files, README) stays behind.
COPIED = ("special_tokens_map.json",)
MARKER = "obfuscation.json"


def _map_ids(value: Any, mapping: TokenMapping) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return mapping.physical(value)
    if isinstance(value, list):
        return mapping.to_physical(value)
    return value


def map_config(config: dict[str, Any], mapping: TokenMapping) -> dict[str, Any]:
    """Return ``config`` (config.json or generation_config.json) with its token-id fields physical."""
    out = dict(config)
    for name in ID_FIELDS:
        if name in out:
            out[name] = _map_ids(out[name], mapping)
    return out


def map_tokenizer_config(config: dict[str, Any], mapping: TokenMapping) -> dict[str, Any]:
    out = {k: v for k, v in config.items() if k != "chat_template"}
    decoder = config.get("added_tokens_decoder") or {}
    out["added_tokens_decoder"] = {str(mapping.physical(int(k))): v for k, v in decoder.items()}
    return out


def permute_weights(tensors: dict[str, np.ndarray], mapping: TokenMapping) -> dict[str, np.ndarray]:
    """Permute every vocabulary-row tensor: new row ``forward[s]`` is old row ``s``."""
    out = dict(tensors)
    for name in VOCAB_TENSORS:
        if name not in tensors:
            continue
        w = tensors[name]
        if w.shape[0] != mapping.vocab_size:
            raise SystemExit(f"obfuscate: {name} has {w.shape[0]} rows, the mapping covers {mapping.vocab_size}")
        # physical row p holds semantic row inverse[p].
        out[name] = np.ascontiguousarray(w[mapping.inverse])
    return out


def _read(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def obfuscate(src: Path, out: Path, key: bytes) -> Path:
    """Write the obfuscated copy of ``src`` to ``out`` (absent or empty) and return it."""
    src, out = Path(src).resolve(), Path(out).resolve()
    with staged_dir(out, "obfuscate") as tmp:
        config = _read(src / "config.json")
        mapping = TokenMapping.from_key(key, int(config["vocab_size"]))
        dump_json(tmp / "config.json", map_config(config, mapping))
        if (src / "generation_config.json").exists():
            dump_json(tmp / "generation_config.json", map_config(_read(src / "generation_config.json"), mapping))
        if (src / "tokenizer_config.json").exists():
            dump_json(tmp / "tokenizer_config.json", map_tokenizer_config(_read(src / "tokenizer_config.json"), mapping))
        for name in COPIED:
            if (src / name).exists():
                shutil.copyfile(src / name, tmp / name)
        tensors = load_file(str(src / "model.safetensors"))
        save_file(permute_weights(tensors, mapping), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # The key id only: which key the weights need, for the instance's declaration.
        dump_json(tmp / MARKER, {"key_id": mapping.key_id, "vocab_size": mapping.vocab_size})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tinymodel.obfuscate", description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--key-env", default="MOTOR_OBF_KEY", help="environment variable holding the key")
    args = parser.parse_args(argv)
    key = os.environ.get(args.key_env, "")
    if not key:
        raise SystemExit(f"obfuscate: set {args.key_env} to the obfuscation key")
    print(f"tinymodel: obfuscated copy in {obfuscate(args.src, args.out, key.encode())}")


if __name__ == "__main__":
    main()
