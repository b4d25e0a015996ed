"""``revision_record``: a model directory's fingerprint becomes the served model's active revision."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from django.core.management import call_command

from catalog.fingerprints import fingerprint_model_dir
from catalog.models import ModelRevision, ServedModel
from catalog.services import revision_record
from motorsite.core import read_control_version


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A copy of the built model's small files (the weights do not enter the fingerprint)."""
    src = Path(os.environ["MOTOR_MODEL_DIR"])
    dst = tmp_path / "model"
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


@pytest.fixture
def served_model(db: None, model_dir: Path) -> ServedModel:
    return ServedModel.objects.create(name="tiny", model_path=str(model_dir))


def test_first_record_creates_an_active_revision(served_model: ServedModel, model_dir: Path) -> None:
    before = read_control_version()
    result = revision_record(served_model=served_model, model_dir=model_dir, actor="test")
    assert result.created
    served_model.refresh_from_db()
    assert served_model.active_revision == result.revision
    assert result.revision.fingerprint() == fingerprint_model_dir(model_dir)
    assert read_control_version() > before  # coordinators rebuild their snapshot


def test_unchanged_directory_adds_no_revision(served_model: ServedModel, model_dir: Path) -> None:
    first = revision_record(served_model=served_model, model_dir=model_dir, actor="test")
    version = read_control_version()
    again = revision_record(served_model=served_model, model_dir=model_dir, actor="test")
    assert not again.created
    assert again.revision == first.revision
    assert ModelRevision.objects.filter(served_model=served_model).count() == 1
    assert read_control_version() == version


def test_changed_chat_template_makes_a_new_active_revision(served_model: ServedModel, model_dir: Path) -> None:
    first = revision_record(served_model=served_model, model_dir=model_dir, actor="test")
    # Wherever the template lived, a .jinja file now wins (see catalog.fingerprints).
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }} changed", encoding="utf-8")
    second = revision_record(served_model=served_model, model_dir=model_dir, actor="test")
    assert second.created
    assert second.revision.chat_template_hash != first.revision.chat_template_hash
    assert second.revision.tokenizer_hash == first.revision.tokenizer_hash
    served_model.refresh_from_db()
    assert served_model.active_revision == second.revision
    assert ModelRevision.objects.filter(served_model=served_model).count() == 2


def test_parser_names_are_part_of_the_revision(served_model: ServedModel, model_dir: Path) -> None:
    first = revision_record(served_model=served_model, model_dir=model_dir, actor="test")
    second = revision_record(
        served_model=served_model, model_dir=model_dir, actor="test", reasoning_parser="qwen3", tool_parser="hermes"
    )
    assert second.created and second.revision != first.revision
    assert (second.revision.reasoning_parser, second.revision.tool_parser) == ("qwen3", "hermes")


def test_special_tokens_are_recorded(served_model: ServedModel, model_dir: Path) -> None:
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|endoftext|>", "bos_token": None}),
        encoding="utf-8",
    )
    result = revision_record(served_model=served_model, model_dir=model_dir, actor="test")
    assert result.revision.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def test_demo_fleet_gives_the_served_model_an_active_revision(db: None, model_dir: Path) -> None:
    args = ["demo_fleet", "--model-dir", str(model_dir), "--engine", "http://127.0.0.1:1", "--engine-kind", "sim"]
    call_command(*args, stdout=open(os.devnull, "w"))
    model = ServedModel.objects.get(name="tiny")
    assert model.active_revision is not None
    assert model.active_revision.fingerprint() == fingerprint_model_dir(model_dir)
    call_command(*args, stdout=open(os.devnull, "w"))  # a second `make run`: same files, same revision
    assert ModelRevision.objects.count() == 1
