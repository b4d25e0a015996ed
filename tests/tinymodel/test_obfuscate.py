"""The obfuscated model copy: permuted vocabulary rows, physical special-token ids, no tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from serving.pipeline.obfuscation.mapping import TokenMapping
from tinymodel.obfuscate import main, obfuscate

KEY = b"tinymodel-obfuscate-test-key"
VOCAB = 64


def _model(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    save_file(
        {
            "model.embed_tokens.weight": rng.standard_normal((VOCAB, 4)).astype(np.float32),
            "lm_head.weight": rng.standard_normal((VOCAB, 4)).astype(np.float32),
            "model.norm.weight": np.ones(4, dtype=np.float32),
        },
        str(src / "model.safetensors"),
    )
    (src / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 2, "hidden_size": 4}))
    (src / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 0}))
    (src / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {"0": {"content": "<|endoftext|>"}, "2": {"content": "<|im_end|>"}},
        "chat_template": "{{ messages }}", "eos_token": "<|im_end|>",
    }))
    (src / "tokenizer.json").write_text("{}")
    (src / "special_tokens_map.json").write_text('{"eos_token": "<|im_end|>"}')
    return src


def test_it_permutes_vocabulary_rows_and_maps_special_ids(tmp_path: Path) -> None:
    src = _model(tmp_path)
    out = obfuscate(src, tmp_path / "obf", KEY)
    m = TokenMapping.from_key(KEY, VOCAB)
    before, after = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        # Physical id forward[s] embeds and scores exactly as semantic id s did.
        assert np.array_equal(after[name][m.forward], before[name])
        assert not np.array_equal(after[name], before[name])
    assert np.array_equal(after["model.norm.weight"], before["model.norm.weight"])
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["hidden_size"]) == (m.physical(0), m.physical(2), 4)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": m.physical(0), "eos_token_id": [m.physical(2), m.physical(0)], "pad_token_id": m.physical(0)}
    tok = json.loads((out / "tokenizer_config.json").read_text())
    assert tok["added_tokens_decoder"] == {str(m.physical(0)): {"content": "<|endoftext|>"}, str(m.physical(2)): {"content": "<|im_end|>"}}
    assert "chat_template" not in tok
    # No tokenizer beside obfuscated weights: it would encode text into ids the model does not use.
    assert not (out / "tokenizer.json").exists()
    assert json.loads((out / "obfuscation.json").read_text()) == {"key_id": m.key_id, "vocab_size": VOCAB}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_it_refuses_a_non_empty_target_and_a_missing_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _model(tmp_path)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(SystemExit, match="not empty"):
        obfuscate(src, tmp_path / "busy", KEY)
    monkeypatch.delenv("MOTOR_OBF_KEY", raising=False)
    with pytest.raises(SystemExit, match="MOTOR_OBF_KEY"):
        main([str(src), str(tmp_path / "o")])
    monkeypatch.setenv("MOTOR_OBF_KEY", KEY.decode())
    main([str(src), str(tmp_path / "o")])
    assert (tmp_path / "o" / "model.safetensors").exists()


def test_the_toolchain_builds_the_obfuscated_tiny_model() -> None:
    obf, plain, key = (os.environ.get(n) for n in ("MOTOR_OBF_MODEL_DIR", "MOTOR_MODEL_DIR", "MOTOR_OBF_TEST_KEY"))
    if not (obf and plain and key):
        pytest.fail("MOTOR_OBF_MODEL_DIR/MOTOR_MODEL_DIR/MOTOR_OBF_TEST_KEY unset; run with `make test`", pytrace=False)
    vocab = json.loads((Path(plain) / "config.json").read_text())["vocab_size"]
    m = TokenMapping.from_key(key.encode(), vocab)
    gen_plain = json.loads((Path(plain) / "generation_config.json").read_text())
    gen_obf = json.loads((Path(obf) / "generation_config.json").read_text())
    assert gen_obf["eos_token_id"] == m.to_physical(gen_plain["eos_token_id"])
    a = load_file(str(Path(plain) / "model.safetensors"))["lm_head.weight"]
    b = load_file(str(Path(obf) / "model.safetensors"))["lm_head.weight"]
    assert np.array_equal(b[m.forward], a)
