"""Build the tiny model directory: ``python -m tinymodel.build OUTDIR``.

Runs in the app environment (tokenizers, safetensors, numpy; no torch, no network). Everything
is written into a sibling temporary directory and renamed into place at the end, so a crashed
build never leaves a half-written model at OUTDIR.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tinymodel import CONTROL_TOKENS, EOS_TOKEN, MARKUP_TOKENS, PAD_TOKEN, SPECIAL_TOKENS, VOCAB_SIZE

HERE = Path(__file__).resolve().parent
SEED = 20240613

# Training text: a fixed, sorted list of standard-library sources (code, docstrings and
# comments give a mix of English and Python). Missing files are skipped: the model cache key
# includes the exact Python version, so the same interpreter always sees the same set.
CORPUS = sorted(
    [
        "argparse.py",
        "ast.py",
        "base64.py",
        "calendar.py",
        "collections/__init__.py",
        "configparser.py",
        "csv.py",
        "dataclasses.py",
        "datetime.py",
        "difflib.py",
        "email/message.py",
        "enum.py",
        "fractions.py",
        "functools.py",
        "gettext.py",
        "heapq.py",
        "http/client.py",
        "http/server.py",
        "inspect.py",
        "ipaddress.py",
        "json/__init__.py",
        "json/decoder.py",
        "json/encoder.py",
        "logging/__init__.py",
        "pathlib.py",
        "pprint.py",
        "random.py",
        "shutil.py",
        "statistics.py",
        "string.py",
        "subprocess.py",
        "tarfile.py",
        "textwrap.py",
        "threading.py",
        "typing.py",
        "unittest/case.py",
        "urllib/parse.py",
    ]
)

# Qwen2 shape. head_dim = 128 / 4 = 32 is one the vLLM CPU attention kernel supports (64 / 4 =
# 16 starts, reports healthy and dies on the first request).
HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2
INTERMEDIATE = 256
MAX_POSITIONS = 2048


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in CORPUS if (stdlib / name).is_file()]
    if len(files) < 20:
        raise SystemExit(f"tinymodel: only {len(files)} training files found under {stdlib}")
    return files


def train_bpe(vocab_size: int, special_tokens: list[str]) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the corpus: ``special_tokens`` first (ids 0..), then
    merges up to ``vocab_size``. The specials' flags are the caller's to set (the ids stay)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [p.read_text(encoding="utf-8") for p in corpus_files()]
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_tokenizer() -> Tokenizer:
    """Return a byte-level BPE tokenizer of exactly VOCAB_SIZE tokens, specials first."""
    # The trainer gives the specials ids 0..8 but marks all of them special; the flags are
    # corrected after training (see CONTROL_TOKENS vs MARKUP_TOKENS).
    tok = train_bpe(VOCAB_SIZE, list(SPECIAL_TOKENS))
    # Re-declare the specials with the flags transformers and vLLM look at; the ids stay.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def tokenizer_files(tok: Tokenizer) -> dict[str, Any]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in CONTROL_TOKENS,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "chat_template": (HERE / "chat_template.jinja").read_text(encoding="utf-8"),
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": MAX_POSITIONS,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    special_map = {
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
    }
    return {"tokenizer_config.json": config, "special_tokens_map.json": special_map}


def model_config(tok: Tokenizer) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": tok.token_to_id(PAD_TOKEN),
        "eos_token_id": tok.token_to_id(EOS_TOKEN),
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": LAYERS,
        "model_type": "qwen2",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": None,
        # Untied: with a tied random embedding greedy decoding repeats the last prompt token.
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": tok.get_vocab_size(),
    }


def generation_config(tok: Tokenizer) -> dict[str, Any]:
    # Only token ids: sampling defaults here would become render's default sampling params.
    return {
        "bos_token_id": tok.token_to_id(PAD_TOKEN),
        "eos_token_id": [tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)],
        "pad_token_id": tok.token_to_id(PAD_TOKEN),
    }


def weights(vocab: int) -> dict[str, np.ndarray]:
    """Return seeded random float32 weights named as vLLM's Qwen2 loader expects.

    Scales keep every layer's contribution to the residual stream around unit size (std
    1/sqrt(fan_in)) and give logits of std ~1, so greedy output moves between tokens instead of
    locking onto one, and seeded sampling has a real distribution to draw from.
    """
    rng = np.random.default_rng(SEED)

    def normal(*shape: int, fan_in: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    ones = np.ones(HIDDEN, dtype=np.float32)
    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)).astype(np.float32),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(HEADS * HEAD_DIM, HIDDEN, fan_in=HIDDEN)
        w[p + "self_attn.q_proj.bias"] = normal(HEADS * HEAD_DIM, fan_in=HIDDEN)
        w[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN, fan_in=HIDDEN)
        w[p + "self_attn.k_proj.bias"] = normal(KV_HEADS * HEAD_DIM, fan_in=HIDDEN)
        w[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN, fan_in=HIDDEN)
        w[p + "self_attn.v_proj.bias"] = normal(KV_HEADS * HEAD_DIM, fan_in=HIDDEN)
        w[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * HEAD_DIM, fan_in=HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN, fan_in=HIDDEN)
        w[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN, fan_in=HIDDEN)
        w[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE, fan_in=INTERMEDIATE)
        w[p + "input_layernorm.weight"] = ones.copy()
        w[p + "post_attention_layernorm.weight"] = ones.copy()
    w["model.norm.weight"] = ones.copy()
    w["lm_head.weight"] = normal(vocab, HIDDEN, fan_in=HIDDEN)
    return w


def dump_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


@contextmanager
def staged_dir(out: Path, who: str) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to fill; on success it becomes ``out`` in one rename.

    A build that dies half-way leaves nothing at ``out``, so the toolchain's cache never holds
    a partial model. Raises SystemExit when ``out`` exists and is not empty.
    """
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{who}: {out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        # mkdtemp makes the directory 0700 and safetensors writes 0600; the model is shared.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build(out: Path) -> Path:
    """Write the model to ``out`` (which must not exist or be empty) and return it."""
    out = Path(out).resolve()
    with staged_dir(out, "tinymodel") as tmp:
        tok = train_tokenizer()
        (tmp / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
        for name, data in tokenizer_files(tok).items():
            dump_json(tmp / name, data)
        dump_json(tmp / "config.json", model_config(tok))
        dump_json(tmp / "generation_config.json", generation_config(tok))
        save_file(weights(tok.get_vocab_size()), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m tinymodel.build OUTDIR")
    print(f"tinymodel: built {build(Path(argv[0]))}")


if __name__ == "__main__":
    main(sys.argv[1:])
