"""Model-directory reading and CLI flag precedence."""

from __future__ import annotations

import json
from pathlib import Path

from enginesim.__main__ import build_parser, config_from_args


def _model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    added = [
        {"id": 0, "content": "<|endoftext|>", "special": True},
        {"id": 2, "content": "<|im_end|>", "special": True},
        {"id": 3, "content": "<tool_call>", "special": False},
    ]
    vocab = {f"t{i}": i for i in range(4, 4000)}
    (tmp_path / "tokenizer.json").write_text(
        json.dumps({"added_tokens": added, "model": {"vocab": vocab}})
    )
    return tmp_path


def test_it_reads_vocab_eos_and_added_tokens_from_the_model_dir(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--model-dir", str(_model_dir(tmp_path))])
    config = config_from_args(args)
    assert config.vocab_size == 4096
    assert config.eos_token_ids == (2, 0)
    assert config.special_token_ids == {0, 2, 3}
    assert config.sampleable_limit == 4000  # the tokenizer is smaller than the config vocab
    assert config.root == str(tmp_path)


def test_it_lets_flags_override_the_model_dir(tmp_path: Path) -> None:
    argv = ["--model-dir", str(_model_dir(tmp_path)), "--vocab-size", "1000", "--eos-token-id", "7"]
    config = config_from_args(build_parser().parse_args(argv + ["--served-model-name", "a", "b"]))
    assert (config.vocab_size, config.eos_token_ids) == (1000, (7,))
    assert config.served_model_names == ("a", "b") and config.model_name == "a"
