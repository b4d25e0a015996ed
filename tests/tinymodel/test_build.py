"""Tests of the offline tiny model builder (tinymodel.build)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from tests.env_memo import files_digest, run_in_env
from tinymodel import CONTROL_TOKENS, EOS_TOKEN, MARKUP_TOKENS, PAD_TOKEN, SPECIAL_TOKENS
from tinymodel.build import build

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("tiny") / "model")


def _json(model_dir: Path, name: str) -> dict:
    return json.loads((model_dir / name).read_text())


def test_it_builds_byte_identical_twice(tmp_path: Path, model_dir: Path) -> None:
    other = build(tmp_path / "again")
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == sorted(p.name for p in other.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    for name in names:
        assert (model_dir / name).read_bytes() == (other / name).read_bytes(), name


def test_it_refuses_a_non_empty_outdir(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(SystemExit):
        build(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_it_gives_each_special_token_one_distinct_id(model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert None not in ids and len(set(ids)) == len(SPECIAL_TOKENS)
    for t, i in zip(SPECIAL_TOKENS, ids, strict=True):
        assert tok.encode(t).ids == [i]
    # Control tokens vanish with skip_special_tokens; tool/think markers must survive decoding
    # so the hermes and qwen3 parsers can see them.
    text = "<|im_start|>a<tool_call>b</tool_call><think>c</think><|im_end|>"
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == (
        "a<tool_call>b</tool_call><think>c</think>"
    )
    decoder = _json(model_dir, "tokenizer_config.json")["added_tokens_decoder"]
    assert {v["content"] for v in decoder.values() if v["special"]} == set(CONTROL_TOKENS)
    assert {v["content"] for v in decoder.values() if not v["special"]} == set(MARKUP_TOKENS)


def test_it_round_trips_text_byte_level(model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "def f(x):\n    return x  # héllo ✓ 你好\n"
    assert tok.decode(tok.encode(text).ids) == text


def test_it_keeps_config_consistent_with_tokenizer(model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = _json(model_dir, "config.json")
    gen = _json(model_dir, "generation_config.json")
    tok_config = _json(model_dir, "tokenizer_config.json")
    eos, pad = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)

    assert config["vocab_size"] == tok.get_vocab_size() == 4096
    assert config["eos_token_id"] == eos and gen["eos_token_id"][0] == eos
    assert gen["pad_token_id"] == pad
    assert tok_config["eos_token"] == EOS_TOKEN and tok_config["pad_token"] == PAD_TOKEN
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["architectures"] == ["Qwen2ForCausalLM"] and not config["tie_word_embeddings"]
    # The vLLM CPU attention kernel dies on unsupported head sizes (16 does not work).
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert head_dim == config["head_dim"] and head_dim in (32, 64, 80, 96, 112, 128)
    # No sampling defaults: they would leak into every render.
    assert not {"temperature", "top_p", "top_k", "repetition_penalty"} & set(gen)


def test_it_writes_weights_matching_the_config(model_dir: Path) -> None:
    config = _json(model_dir, "config.json")
    w = load_file(str(model_dir / "model.safetensors"))
    hidden, vocab, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    assert w["model.embed_tokens.weight"].shape == (vocab, hidden)
    assert w["lm_head.weight"].shape == (vocab, hidden)
    assert not np.allclose(w["lm_head.weight"], w["model.embed_tokens.weight"])
    assert w["model.norm.weight"].shape == (hidden,)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        assert w[p + "self_attn.q_proj.weight"].shape == (hidden, hidden)
        assert w[p + "self_attn.q_proj.bias"].shape == (hidden,)
        assert w[p + "self_attn.k_proj.weight"].shape == (kv, hidden)
        assert w[p + "self_attn.v_proj.bias"].shape == (kv,)
        assert w[p + "self_attn.o_proj.weight"].shape == (hidden, hidden)
        assert w[p + "mlp.gate_proj.weight"].shape == (inter, hidden)
        assert w[p + "mlp.down_proj.weight"].shape == (hidden, inter)
        assert w[p + "post_attention_layernorm.weight"].shape == (hidden,)
    assert len(w) == 2 + 1 + 12 * config["num_hidden_layers"]


EXPECTED_PROMPT = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with"
    " the user query.\n\nYou are provided with function signatures within <tools></tools> XML"
    ' tags:\n<tools>\n{"type": "function", "function": {"name": "get_weather", "parameters":'
    ' {"type": "object"}}}\n</tools>\n\nFor each function call, return a json object with'
    " function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    "\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\nsunny\n"
    "</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nIt is 18C.<|im_end|>\n"
    "<|im_start|>assistant\n"
)

RENDER_SCRIPT = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
messages = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "<think>hm</think>\\nIt is 18C."},
]
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
plain = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=False)
no_think = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
sys.stdout.write(json.dumps([text, plain, no_think]))
"""


def test_it_renders_the_chat_template_with_tools(model_dir: Path) -> None:
    # jinja2 is not in the app environment; render with transformers from the render sidecar's
    # environment (the same template engine vLLM uses) when that environment is built.
    sys.path.insert(0, str(ROOT))
    try:
        import toolchain
    finally:
        sys.path.remove(str(ROOT))
    if not toolchain.is_ready("render"):
        pytest.skip("render environment not built (python3 -m toolchain ensure render)")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    # Kept with the render environment (``env_memo``), keyed by the model's files: importing
    # transformers is most of this, and it renders the same files the same way every time.
    out = run_in_env(toolchain.python("render"), RENDER_SCRIPT, str(model_dir), data=files_digest(model_dir),
                     env=env, timeout=60)
    text, plain, no_think = json.loads(out)
    assert text == EXPECTED_PROMPT
    assert plain == "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    assert no_think == plain + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
