"""motorsite's second small offline model, for serving two models from one fleet.

``python -m tinymodel.llama.build OUTDIR`` writes a model directory as ``tinymodel.build`` does
(same Qwen2 shape, which the vLLM CPU kernels are known to run) but with what makes two models
tell apart on the wire: a different vocabulary (3,000 tokens, trained with other special tokens,
so the same text has other token ids) and a chat template of another family (Llama 3's header
tokens instead of ChatML). No tools or reasoning markers: the sidecar serves it without parsers.
"""

from __future__ import annotations

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|eot_id|>"
PAD_TOKEN = "<|end_of_text|>"
# Special tokens in id order (ids 0..4), all special: skipped when decoding.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, "<|start_header_id|>", "<|end_header_id|>", EOS_TOKEN)
VOCAB_SIZE = 3000
