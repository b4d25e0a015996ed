"""The served model's own tokenizer and chat template, for when the render sidecar cannot be used.

Built from the model directory (``tokenizer.json``, ``tokenizer_config.json`` or
``chat_template.jinja``, ``config.json``; ``generation_config.json``'s sampling defaults) with
transformers' tokenizer (as render builds it) and a sandboxed ``jinja2`` environment configured as Hugging Face's ``apply_chat_template`` configures
it, so the prompt ids equal render's (generation-config eos ids are not added: render leaves that to
the engine's input processor too) for the requests the fallback accepts (plain text chats and
completions; see ``serving.pipeline.render.tokenization.local_unsupported``).

Loading reads files and builds a BPE model (tens of milliseconds to seconds), so it happens once
per model directory, on the first real fallback, never at start.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer


class LocalTokenizerUnavailable(Exception):
    """The model directory has no usable tokenizer or chat template."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise LocalTokenizerUnavailable(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_tokenizer(root: Path) -> Any:
    """The fast tokenizer that transformers (render's library) builds for ``root``.

    Not ``Tokenizer.from_file("tokenizer.json")``: transformers picks a tokenizer class from the
    model's config, and the class may replace the file's pre-tokenizer (Qwen2's splits digits one
    by one), so the file on its own can give other ids than render for the same text.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise LocalTokenizerUnavailable(f"transformers is not installed: {exc}") from exc
    try:
        hf = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as exc:  # OSError, ValueError, or whatever a broken file makes the loader raise
        raise LocalTokenizerUnavailable(f"no usable tokenizer in {root}: {exc}") from exc
    if not isinstance(getattr(hf, "backend_tokenizer", None), Tokenizer):
        raise LocalTokenizerUnavailable(f"{root} has no fast tokenizer (tokenizer.json)")
    return hf


# The generation-config keys vLLM turns into default sampling parameters
# (``ModelConfig.get_diff_sampling_param``, vLLM 0.33.0); ``max_new_tokens`` becomes ``max_tokens``.
GENERATION_DEFAULT_KEYS = (
    "repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p", "min_p",
    "max_new_tokens", "skip_special_tokens",
)


def generation_defaults(root: Path) -> dict[str, Any]:
    """The sampling defaults render applies for the model at ``root``, as vLLM's default
    ``--generation-config auto`` reads them.

    vLLM loads ``GenerationConfig.from_pretrained`` (else ``from_model_config`` of config.json)
    and keeps ``to_diff_dict()``: only values that differ from transformers' own defaults, so a
    file's ``top_k: 50`` (transformers' default) is no default at all. The same transformers
    does the same here, so the fallback's sampling parameters are render's.
    """
    try:
        from transformers import AutoConfig, GenerationConfig
    except ImportError as exc:
        raise LocalTokenizerUnavailable(f"transformers is not installed: {exc}") from exc
    try:
        config = GenerationConfig.from_pretrained(str(root), local_files_only=True)
    except OSError:  # no generation_config.json: vLLM derives one from config.json
        try:
            config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(root), local_files_only=True))
        except (OSError, ValueError):
            return {}
    except ValueError as exc:  # a file transformers rejects: render could not have loaded it either
        raise LocalTokenizerUnavailable(f"unusable generation config in {root}: {exc}") from exc
    diff = config.to_diff_dict()
    out = {key: diff[key] for key in GENERATION_DEFAULT_KEYS if diff.get(key) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: how many prompt tokens seed the detokenizer.
_SEED_OFFSET = 5


class LocalTokenizer:
    """Chat template + tokenizer of one model directory; thread-safe and immutable once built."""

    def __init__(self, model_path: str) -> None:
        root = Path(model_path)
        self._hf = _hf_tokenizer(root)
        self._tokenizer: Tokenizer = self._hf.backend_tokenizer
        config = _read_json(root / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: Hugging Face picks "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = root / "chat_template.jinja"
        if not isinstance(template, str) and jinja_file.exists():
            template = jinja_file.read_text()
        self._template_source = template if isinstance(template, str) else None
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self._tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self._env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        # The same helpers transformers gives chat templates.
        self._env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
        )
        self._env.globals["raise_exception"] = _raise_exception
        self._env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._compiled: jinja2.Template | None = None
        self._lock = threading.Lock()
        # What render fills in where the request is silent (temperature, top_p, max_tokens, ...).
        self.generation_defaults = generation_defaults(root)

    @property
    def hf(self) -> Any:
        """The transformers tokenizer render builds (the coordinator's stream derender reads it)."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        if self._template_source is None:
            raise LocalTokenizerUnavailable("the model has no chat template")
        with self._lock:
            if self._compiled is None:
                self._compiled = self._env.from_string(self._template_source)
        return self._compiled.render(
            messages=messages, bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs
        )

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def decode_output(self, prompt_ids: list[int], ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """The text vLLM's derender makes of the output ``ids`` of ``prompt_ids``.

        Not ``decode``: derender runs vLLM's incremental detokenizer (``detokenize_incrementally``
        in vllm/tokenizers/detokenizer_utils.py, 0.33.0), seeded with the prompt's last tokens, and
        that never emits text ending in U+FFFD, so a byte-fallback character the output leaves
        unfinished is dropped where a one-shot decode ends in "\ufffd". This is the same loop.
        """
        hf = self._hf
        vocab = len(hf)

        def tokens(some: list[int]) -> list[str]:
            return [t or "" for t in hf.convert_ids_to_tokens(some, skip_special_tokens=skip_special_tokens)]

        # convert_prompt_ids_to_tokens: the tail, with INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET (5) + 2.
        seen = tokens(prompt_ids[-_SEED_OFFSET - 2:])
        read_offset = len(seen)
        prefix_offset = max(read_offset - _SEED_OFFSET, 0)
        text: list[str] = []
        for token_id in ids:
            new = tokens([token_id]) if 0 <= token_id < vocab else [""]
            seen += new
            prefix_text = hf.convert_tokens_to_string(seen[prefix_offset:read_offset])
            new_text = hf.convert_tokens_to_string(seen[prefix_offset:])
            if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
                continue  # maybe an unfinished multi-byte character: wait for more
            text.append(new_text[len(prefix_text):])
            prefix_offset, read_offset = read_offset, len(seen)
        return "".join(text)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


_cache: dict[str, LocalTokenizer] = {}
_cache_lock = threading.Lock()


def local_tokenizer(model_path: str) -> LocalTokenizer:
    """The cached tokenizer of ``model_path``, built on first use (call it off the event loop)."""
    with _cache_lock:
        tok = _cache.get(model_path)
        if tok is None:
            tok = _cache[model_path] = LocalTokenizer(model_path)
        return tok


def loaded(model_path: str) -> bool:
    """Whether the fallback for ``model_path`` has been built (tests: proves the lazy load)."""
    return model_path in _cache
