"""Model fingerprints, render config parsing (unknown keys are errors) and the import command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from catalog.fingerprints import fingerprint_model_dir
from catalog.models import RenderConfig
from catalog.services import parse_render_config, render_config_publish
from fleet import services as fleet_services
from motorsite.core import InvalidError


def write_model(d: Path, template: str, *, in_jinja: bool = False) -> Path:
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen2"}')
    (d / "tokenizer.json").write_text('{"version": "1.0"}')
    (d / "generation_config.json").write_text('{"eos_token_id": 2}')
    if in_jinja:
        (d / "chat_template.jinja").write_text(template)
        (d / "tokenizer_config.json").write_text("{}")
    else:
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return d


def test_it_fingerprints_the_files_that_decide_compatibility(tmp_path: Path) -> None:
    a = fingerprint_model_dir(write_model(tmp_path / "a", "{{ messages }}"))
    b = fingerprint_model_dir(write_model(tmp_path / "b", "{{ messages }}!"))
    moved = fingerprint_model_dir(write_model(tmp_path / "c", "{{ messages }}", in_jinja=True))
    assert set(a) == {"config", "tokenizer", "chat_template", "generation_config"}
    assert all(len(v) == 64 for v in a.values())
    assert a["chat_template"] != b["chat_template"] and a["tokenizer"] == b["tokenizer"]
    assert moved == a  # the same template text, wherever it lives


def test_missing_files_hash_to_empty(tmp_path: Path) -> None:
    assert fingerprint_model_dir(tmp_path) == {"config": "", "tokenizer": "", "chat_template": "", "generation_config": ""}


def test_it_parses_the_rfcs_render_config() -> None:
    rfc = {
        "render_config": {
            "enable": True, "image_name": "vllm-render-cpu:v0.28.0-arm64",
            "endpoint": {"host": "127.0.0.1", "port": 8100}, "timeout_ms": 5000, "renderer_num_workers": 4,
        }
    }
    assert parse_render_config(rfc) == {
        "enable": True, "image_name": "vllm-render-cpu:v0.28.0-arm64", "host": "127.0.0.1", "port": 8100,
        "timeout_ms": 5000, "renderer_num_workers": 4,
    }


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"enabled": False}, "Unknown key render_config.enabled"),  # a renamed key must not turn render off
        ({"endpoint": {"hots": "x"}}, "Unknown key render_config.endpoint.hots"),
        ({"timeout_ms": "5000"}, "render_config.timeout_ms must be int"),
        ({"endpoint": {"port": True}}, "render_config.endpoint.port must be int"),
        ({"renderer_num_workers": 0}, "must be positive"),
        ({"obfuscation": True}, "needs obfuscation_key_ref"),
        ([1], "must be a JSON object"),
    ],
)
def test_it_refuses_bad_render_configs_naming_the_key(data: object, message: str) -> None:
    with pytest.raises(InvalidError, match=message.replace(".", r"\.")):
        parse_render_config(data)


@pytest.mark.django_db
def test_publishing_flags_a_needed_restart_and_bumps_the_version() -> None:
    render_config_publish(changes={"host": "127.0.0.1"}, actor="t")
    before = fleet_services.read_control_version()
    result = render_config_publish(changes={"timeout_ms": 100}, actor="t")
    assert result.changed == ("timeout_ms",) and not result.restart_required
    result = render_config_publish(changes={"renderer_num_workers": 8}, actor="t")
    assert result.restart_required and RenderConfig.objects.get().restart_required
    assert fleet_services.read_control_version() == before + 2


@pytest.mark.django_db
def test_the_import_command(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"render_config": {"enable": False, "endpoint": {"port": 8111}}}))
    call_command("import_render_config", str(good))
    config = RenderConfig.objects.get()
    assert (config.enable, config.port) == (False, 8111)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"render_config": {"enabel": True}}))
    with pytest.raises(CommandError, match="Unknown key render_config.enabel"):
        call_command("import_render_config", str(bad))
    assert RenderConfig.objects.get().enable is False
