"""The P/D engines: their commands and stack specs, the demo fleet rows, and the sitecustomize that
keeps NIXL engines from starving a small machine (run in the engine environment with the real wheels)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from motorsite import stack, tiers

PROBE = r"""
import os, sys
assert "nixl" not in sys.modules  # nothing imported early: vLLM still sets UCX_RCACHE_MAX_UNRELEASED
import nixl._api as api

class Captured(Exception):
    pass

def capture(name, config):
    raise Captured(config.pthrDelay)

# Behind the wrapper sits the real binding module; catch the config it would be given.
api.nixlBind.__class__.__getattr__  # the wrapper is in place
real = sys.modules[api.nixl_agent.__module__.rsplit(".", 1)[0] + "._bindings"]
real.nixlAgent = capture
try:
    api.nixl_agent("probe", api.nixl_agent_config(backends=[]))
except Captured as exc:
    print("pthrDelay", exc.args[0])
os.sched_setaffinity(0, {os.cpu_count() - 1})  # vLLM's "reserve the last core"
print("affinity", sorted(os.sched_getaffinity(0)))
"""


def _engine_python() -> str:
    python = os.environ.get("MOTOR_ENGINE_PYTHON")
    if not python:
        pytest.skip("MOTOR_ENGINE_PYTHON is not set; run the suite with `make test`")
    return python


def test_it_gives_the_nixl_agent_a_progress_thread_delay_and_keeps_the_engine_on_its_core() -> None:
    env = {**os.environ, **tiers.nixl_env(5555, core=0), "PYTHONPATH": str(tiers.ENGINE_SITE_DIR)}
    out = subprocess.run(
        [_engine_python(), "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert f"pthrDelay {tiers.NIXL_PTHR_DELAY_US}" in out
    assert "affinity [0]" in out


def test_it_is_inert_without_its_variables() -> None:
    env = {**os.environ, "PYTHONPATH": str(tiers.ENGINE_SITE_DIR)}
    env.pop("MOTOR_NIXL_PTHR_DELAY_US", None)
    env.pop("MOTOR_CPU_CORES", None)
    code = "import os; print(os.sched_setaffinity.__module__ if hasattr(os.sched_setaffinity, '__module__') else 'builtin')"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() in ("posix", "builtin", "None")


def test_the_nixl_engine_command_sets_the_connector_and_its_environment() -> None:
    argv, env = tiers.vllm_engine_command(
        python="py", model_dir="/m", served_model_name="tiny", port=1, mode="tokens-only", core=1,
        kv_role="kv_consumer", nixl_port=5601,
    )
    assert argv[:3] == ["taskset", "-c", "1"]
    assert '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}' in argv
    assert env["UCX_TLS"] == "tcp,self,sm" and env["UCX_NET_DEVICES"] == "lo"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    assert env["PYTHONPATH"] == str(tiers.ENGINE_SITE_DIR) and env["MOTOR_CPU_CORES"] == "1"
    with pytest.raises(ValueError):
        tiers.vllm_engine_command(
            python="py", model_dir="/m", served_model_name="tiny", port=1, mode="tokens-only", core=1, kv_role="kv_both"
        )
    with pytest.raises(ValueError):
        tiers.vllm_engine_command(
            python="py", model_dir="/m", served_model_name="tiny", port=1, mode="tokens-only", core=1, kv_role="kv_producer"
        )


def _config(**changes: object) -> stack.StackConfig:
    base = stack.StackConfig(model_dir="/m", render_python="rp", engine_python="ep", app_python="ap")
    return replace(base, **changes)  # type: ignore[arg-type]


def test_make_runs_default_fleet_has_a_prefill_and_a_decode_engine_beside_the_union_ones() -> None:
    names = [s.name for s in stack.build_specs(_config(celery=False))]
    assert names == ["render", "engine-1", "engine-2", "prefill-1", "decode-1", "coordinator"]


def test_the_pd_specs_pin_each_engine_and_bind_its_side_channel() -> None:
    prefill, decode = stack.pd_engine_specs(_config(prefill_ports=(9001,), decode_ports=(9002,), nixl_ports=(9101, 9102)))
    assert prefill.argv[:3] == ["taskset", "-c", "0"] and "--tokens-only" in prefill.argv
    assert '"kv_role": "kv_producer"' in " ".join(prefill.argv) and '"kv_role": "kv_consumer"' in " ".join(decode.argv)
    assert prefill.ports == [("127.0.0.1", 9001), ("127.0.0.1", 9101)]
    assert decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "9102"
    assert decode.env["MOTOR_CPU_CORES"] == str(1 % (os.cpu_count() or 1))
    assert stack.pd_engine_specs(_config(prefill_ports=(), decode_ports=())) == []
    with pytest.raises(ValueError):
        stack.pd_engine_specs(_config(nixl_ports=(1,)))


def test_the_simulated_pd_engines_take_their_roles() -> None:
    prefill, decode = stack.pd_engine_specs(_config(engines="sim"))
    assert prefill.argv[prefill.argv.index("--role") + 1] == "prefill"
    assert decode.argv[decode.argv.index("--role") + 1] == "decode"
    assert decode.argv[decode.argv.index("--kv-transfer") + 1] == "pull"


def test_the_coordinator_knows_its_own_metaserver_address() -> None:
    cfg = _config(coordinator_port=8123)
    assert stack.coordinator_env(cfg)["MOTOR_METASERVER_BASE_URL"] == "http://127.0.0.1:8123"


@pytest.mark.django_db
def test_the_demo_fleet_registers_the_pd_engines() -> None:
    from django.core.management import call_command

    from serving.snapshots import build_snapshot

    call_command(
        "demo_fleet", "--model-dir", "/m", "--engine", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2",
        "--decode", "http://127.0.0.1:3", stdout=io.StringIO(),
    )
    views = {i.name: i for i in build_snapshot().instances}
    assert sorted(views) == ["decode-1", "prefill-1", "union-1"]
    assert (views["prefill-1"].role, views["prefill-1"].kv_connector, views["prefill-1"].kv_transfer) == (
        "prefill", "NixlConnector", "pull"
    )
    assert views["decode-1"].role == "decode" and not views["decode-1"].native_openai
    assert views["union-1"].kv_transfer == "" and views["union-1"].native_openai


def test_scale_out_pd_engines_serve_their_own_api_and_the_demo_fleet_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # The native path's P/D pairs (issue 33): scale-out P/D engines load a tokenizer and serve
    # their own OpenAI API, and the fleet records it, so the native path can place on them.
    cfg = _config(prefill_ports=(9001,), decode_ports=(9002,), nixl_ports=(9101, 9102), pd_mode="scale-out")
    prefill, decode = stack.pd_engine_specs(cfg)
    assert "--enable-scale-out" in prefill.argv and "--tokens-only" not in decode.argv
    seen: list[list[str]] = []
    monkeypatch.setattr(stack.subprocess, "run", lambda argv, **_kw: seen.append(list(argv)))
    stack.prepare_database(cfg)
    assert "--pd-native" in seen[-1]


@pytest.mark.django_db
def test_the_demo_fleet_records_scale_out_pd_engines_as_native() -> None:
    from django.core.management import call_command

    from serving.snapshots import build_snapshot

    call_command(
        "demo_fleet", "--model-dir", "/m", "--prefill", "http://127.0.0.1:2", "--decode", "http://127.0.0.1:3",
        "--pd-native", stdout=io.StringIO(),
    )
    views = {i.name: i for i in build_snapshot().instances}
    assert all(v.native_openai and v.tokenizer and v.kv_transfer == "pull" for v in views.values())
