"""motorsite's small offline model: a Qwen2-shaped causal LM with random weights.

``python -m tinymodel.build OUTDIR`` writes a model directory that real vLLM (render sidecar and
CPU token engines) loads without a model hub: a byte-level BPE tokenizer trained on Python's
standard library sources, a ChatML chat template with tools, a Qwen2 ``config.json`` and about
5 MB of seeded random weights. The output is byte-identical for the same Python and packages.
"""

from __future__ import annotations

# Special tokens in id order; they take ids 0..8 of the vocabulary. The first three are
# "special" (skipped when decoding with skip_special_tokens); the tool and think markers are
# ordinary added tokens, as in Qwen2.5/Qwen3, so that the hermes tool-call parser and the qwen3
# reasoning parser still see them in the decoded text.
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKUP_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
SPECIAL_TOKENS = CONTROL_TOKENS + MARKUP_TOKENS
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 4096
