"""Build the tiny model's LoRA adapter: ``python -m tinymodel.lora.build OUTDIR``.

Runs in the app environment like ``tinymodel.build`` (numpy and safetensors, no torch, no
network) and writes through its staged directory, so a crashed build leaves nothing at OUTDIR.
The output is byte-identical on every run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from tinymodel import build as base
from tinymodel.lora import RANK

SEED = 20261206
ALPHA = 2 * RANK  # scaling alpha / r = 2: the update is as large as the weight it adds to
# (module, rows out, columns in) of each projection the adapter changes, per layer.
TARGETS = (
    ("self_attn.q_proj", base.HEADS * base.HEAD_DIM, base.HIDDEN),
    ("self_attn.k_proj", base.KV_HEADS * base.HEAD_DIM, base.HIDDEN),
    ("self_attn.v_proj", base.KV_HEADS * base.HEAD_DIM, base.HIDDEN),
    ("self_attn.o_proj", base.HIDDEN, base.HEADS * base.HEAD_DIM),
    ("mlp.gate_proj", base.INTERMEDIATE, base.HIDDEN),
    ("mlp.up_proj", base.INTERMEDIATE, base.HIDDEN),
    ("mlp.down_proj", base.HIDDEN, base.INTERMEDIATE),
)


def adapter_config(base_model: str) -> dict[str, Any]:
    return {
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": RANK,
        "target_modules": sorted(name.split(".")[-1] for name, _, _ in TARGETS),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def weights() -> dict[str, np.ndarray]:
    """PEFT's tensor names: ``lora_A`` (r x in) and ``lora_B`` (out x r) per target module.

    Both random (PEFT starts B at zero, which would change nothing): B A has entries of about
    the base weight's size (std 1/sqrt(in)), so the adapter moves greedy output within a few
    tokens while the logits stay of the base model's scale.
    """
    rng = np.random.default_rng(SEED)
    w: dict[str, np.ndarray] = {}
    for i in range(base.LAYERS):
        for name, rows, cols in TARGETS:
            prefix = f"base_model.model.model.layers.{i}.{name}."
            w[prefix + "lora_A.weight"] = (rng.standard_normal((RANK, cols)) / np.sqrt(cols)).astype(np.float32)
            w[prefix + "lora_B.weight"] = (rng.standard_normal((rows, RANK)) / np.sqrt(RANK * 2)).astype(np.float32)
    return w


def build(out: Path, base_model: str = "tiny") -> Path:
    """Write the adapter to ``out`` (which must not exist or be empty) and return it."""
    out = Path(out).resolve()
    with base.staged_dir(out, "tinymodel.lora") as tmp:
        base.dump_json(tmp / "adapter_config.json", adapter_config(base_model))
        save_file(weights(), str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m tinymodel.lora.build OUTDIR")
    print(f"tinymodel.lora: built {build(Path(argv[0]))}")


if __name__ == "__main__":
    main(sys.argv[1:])
