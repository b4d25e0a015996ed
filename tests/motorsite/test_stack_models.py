"""``make run`` with a second model: its processes beside the first model's, and its rows beside
the first model's in the database (``demo_fleet --only-this-model``)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
from django.core.management import CommandError, call_command

from catalog.models import RenderConfig, ServedModel
from fleet.models import EngineInstance
from motorsite import stack
from motorsite.launcher.management.commands.runstack import Command


def _config(**changes: object) -> stack.StackConfig:
    base = stack.StackConfig(model_dir="/m", render_python="rp", engine_python="ep", app_python="ap", celery=False)
    return replace(base, **changes)  # type: ignore[arg-type]


def test_a_second_model_gets_its_own_sidecar_and_engines_and_the_default_none() -> None:
    assert [s.name for s in stack.build_specs(_config())] == [
        "render", "engine-1", "engine-2", "prefill-1", "decode-1", "coordinator",
    ]
    second = stack.ExtraModel("tiny-b", "/mb", 8101, (8203,))
    specs = {s.name: s for s in stack.build_specs(_config(extra_models=(second,)))}
    render, engine = specs["render-tiny-b"], specs["engine-tiny-b-1"]
    assert render.ports == [("127.0.0.1", 8101)] and engine.ports == [("127.0.0.1", 8203)]
    assert render.argv[render.argv.index("--model") + 1] == "/mb"
    assert engine.argv[engine.argv.index("serve") + 1] == "/mb"
    for spec in (render, engine):
        assert spec.argv[spec.argv.index("--served-model-name") + 1] == "tiny-b"
    assert "--reasoning-parser" not in render.argv  # the second model has no tool or think markers
    assert render.log_path.name == "render-tiny-b.log"


def test_a_second_model_may_have_a_render_pool_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # The deployed forms (docker/compose.yaml, deploy/k8s) run each model's pool of two.
    second = stack.ExtraModel("tiny-b", "/mb", 8102, (8203,), render_member_ports=(8103,))
    specs = {s.name: s for s in stack.build_specs(_config(extra_models=(second,)))}
    member = specs["render-tiny-b-member-2"]
    assert member.ports == [("127.0.0.1", 8103)] and member.log_path.name == "render-tiny-b-member-2.log"
    assert member.argv[member.argv.index("--served-model-name") + 1] == "tiny-b"
    assert "render-member-2" not in specs  # the first model still has its one sidecar
    ran: list[list[str]] = []
    monkeypatch.setattr(stack.subprocess, "run", lambda argv, **kw: ran.append(list(argv)))
    stack.prepare_database(_config(extra_models=(second,)))
    [extra] = [argv for argv in ran if "--only-this-model" in argv]
    assert extra[extra.index("--render-port") + 1] == "8102" and extra[extra.index("--render-member-port") + 1] == "8103"


def _demo_fleet(*args: str) -> None:
    call_command("demo_fleet", "--engine-kind", "sim", *args, stdout=io.StringIO())


@pytest.mark.django_db
def test_demo_fleet_adds_a_second_model_beside_the_first_and_a_plain_run_retires_it() -> None:
    _demo_fleet("--model-dir", "/m", "--engine", "http://127.0.0.1:8201")
    _demo_fleet("--only-this-model", "--model-dir", "/mb", "--served-model-name", "tiny-b",
                "--render-port", "8101", "--engine", "http://127.0.0.1:8203")
    assert dict(EngineInstance.objects.values_list("name", "served_model__name")) == {
        "union-1": "tiny", "tiny-b-union-1": "tiny-b",
    }
    assert dict(RenderConfig.objects.values_list("name", "served_model__name")) == {"default": "tiny", "tiny-b": "tiny-b"}
    assert RenderConfig.objects.get(name="tiny-b").port == 8101

    _demo_fleet("--model-dir", "/m", "--engine", "http://127.0.0.1:8201")  # a run without the second model
    assert list(EngineInstance.objects.values_list("name", flat=True)) == ["union-1"]
    assert dict(ServedModel.objects.values_list("name", "state")) == {"tiny": "active", "tiny-b": "retired"}


def test_lora_loads_the_adapter_on_the_union_engines_named_and_the_default_loads_none() -> None:
    for spec in stack.build_specs(_config()):
        assert "--enable-lora" not in spec.argv
    adapter = stack.LoraAdapter("tiny-lora", "/adapters/lora", engine_ports=(8202,))
    specs = {s.name: s for s in stack.build_specs(_config(lora_adapters=(adapter,)))}
    engine = specs["engine-2"].argv
    assert "--enable-lora" in engine and engine[engine.index("--lora-modules") + 1] == "tiny-lora=/adapters/lora"
    assert engine[engine.index("--max-lora-rank") + 1] == "8"
    for name in ("engine-1", "prefill-1", "decode-1", "render"):
        assert "--enable-lora" not in specs[name].argv, name
    every = {s.name: s for s in stack.build_specs(_config(lora_adapters=(replace(adapter, engine_ports=()),)))}
    assert all("--enable-lora" in every[n].argv for n in ("engine-1", "engine-2"))


def test_make_run_takes_lora_from_motor_lora_and_refuses_it_with_simulated_engines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Command().create_parser("manage.py", "runstack").parse_args([]).lora is False
    monkeypatch.setenv("MOTOR_LORA", "1")
    assert Command().create_parser("manage.py", "runstack").parse_args([]).lora is True
    for name in ("MOTOR_MODEL_DIR", "MOTOR_RENDER_PYTHON", "MOTOR_ENGINE_PYTHON", "MOTOR_LORA_DIR"):
        monkeypatch.setenv(name, "/x")
    with pytest.raises(CommandError, match="MOTOR_LORA needs real engines"):
        call_command("runstack", "--engines", "sim")  # before anything starts or is written


def test_second_model_with_a_pool_of_two_takes_the_ports_after_the_first_pool() -> None:
    from motorsite.launcher.management.commands.runstack import _second_model

    opts = {"render_pool_size": 2, "render_port": 8100, "second_model_ports": ""}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOTOR_MODEL_B_DIR", "/mb")
        [second] = _second_model(opts)
    assert (second.render_port, second.render_member_ports, second.engine_ports) == (8102, (8103,), (8203,))
    cfg = _config(render_member_ports=(8101,), extra_models=(second,))
    ports = [port for spec in stack.build_specs(cfg) for _, port in spec.ports]
    assert len(ports) == len(set(ports))


def test_two_processes_given_one_port_stop_make_run_before_anything_starts() -> None:
    # The second model's sidecar on the first model's pool member's port (MOTOR_RENDER_POOL_SIZE=2
    # with the old fixed MOTOR_SECOND_MODEL_PORTS default of 8101).
    second = stack.ExtraModel("tiny-b", "/mb", 8101, (8203,))
    with pytest.raises(ValueError, match="render-tiny-b and render-member-2 are both given port 8101"):
        stack.build_specs(_config(render_member_ports=(8101,), extra_models=(second,)))
