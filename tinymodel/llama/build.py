"""Build the second tiny model directory: ``python -m tinymodel.llama.build OUTDIR``.

Runs in the app environment like ``tinymodel.build``, whose shape, weights recipe and staged
write it reuses; only the tokenizer, its special tokens and the chat template differ.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer

from tinymodel import build as base
from tinymodel.llama import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, VOCAB_SIZE

HERE = Path(__file__).resolve().parent


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer of exactly VOCAB_SIZE tokens, specials first (ids 0..4)."""
    tok = base.train_bpe(VOCAB_SIZE, list(SPECIAL_TOKENS))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def tokenizer_files(tok: Tokenizer) -> dict[str, Any]:
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        # The template writes <|begin_of_text|> itself, as Llama 3's does.
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "chat_template": (HERE / "chat_template.jinja").read_text(encoding="utf-8"),
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": base.MAX_POSITIONS,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    special_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    return {"tokenizer_config.json": config, "special_tokens_map.json": special_map}


def build(out: Path) -> Path:
    """Write the model to ``out`` (which must not exist or be empty) and return it."""
    out = Path(out).resolve()
    with base.staged_dir(out, "tinymodel.llama") as tmp:
        tok = train_tokenizer()
        (tmp / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
        for name, data in tokenizer_files(tok).items():
            base.dump_json(tmp / name, data)
        bos, eos, pad = (tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN))
        config = {**base.model_config(tok), "bos_token_id": bos, "eos_token_id": eos}
        base.dump_json(tmp / "config.json", config)
        base.dump_json(tmp / "generation_config.json", {"bos_token_id": bos, "eos_token_id": [eos, pad], "pad_token_id": pad})
        save_file(base.weights(tok.get_vocab_size()), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m tinymodel.llama.build OUTDIR")
    print(f"tinymodel.llama: built {build(Path(argv[0]))}")


if __name__ == "__main__":
    main(sys.argv[1:])
