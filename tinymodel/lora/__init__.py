"""A LoRA adapter for the tiny model, built offline: ``python -m tinymodel.lora.build OUTDIR``.

PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``), which vLLM loads with
``--enable-lora --lora-modules NAME=OUTDIR``. Seeded random low-rank updates on every attention
and MLP projection, large enough that greedy output moves away from the base model's.
"""

from __future__ import annotations

RANK = 8
