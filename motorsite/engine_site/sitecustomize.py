"""What every vLLM engine process needs before vLLM runs, loaded by ``site`` at interpreter start.

``motorsite.tiers.vllm_engine_command`` makes this directory the ``PYTHONPATH`` of every engine it
builds (``make run``, the test fixtures, the benchmarks; ``docker/Dockerfile.vllm`` copies it and
``docker/compose.yaml`` sets the same variable), so it runs in the engine's API server and again
in every interpreter vLLM starts from it (the engine core is a ``spawn``-ed multiprocessing
child, and a spawned interpreter imports ``site`` like any other). In order:

1. AMX: on a CPU with AMX tile data, ask Linux for permission (``motorsite_cpu``); without it the
   engine core dies with SIGILL on the first forward pass. Every process asks for itself, since
   exec clears the permission. The top process logs exactly one line saying what it found
   (``MOTOR_ENGINE_AMX`` carries its outcome to the children, which stay quiet when they got the
   same).
2. ``faulthandler``: a fatal signal in any engine process (SIGILL, SIGSEGV, SIGBUS, SIGFPE,
   SIGABRT) writes "Fatal Python error: <signal>" and every thread's traceback to the engine log
   before the process dies of that same signal. Enabled after the AMX request, because Linux
   refuses AMX to a process whose signal stacks are too small for its larger signal frame.
3. Subprocess fates: when a multiprocessing child of this process (vLLM's engine core) ends
   with a signal or a non-zero code, one line ``motorsite: subprocess NAME (pid N) killed by
   SIGNAL`` goes to the log. vLLM's API server notices the death, logs only "engine core exited
   unexpectedly" and then exits with code 0; the supervisor reads this line to say what really
   happened (``motorsite.processes.describe_exit``). A SIGKILL leaves no other trace.
4. Two fixes for NIXL engines on a small CPU box, each acting only when its environment
   variable is set (``motorsite.tiers.nixl_env``; vllm-on-cpu.md, "Prefill / decode on CPU"):

- ``MOTOR_NIXL_PTHR_DELAY_US``: the ``nixl`` Python agent hard-codes ``pthrDelay = 0`` and vLLM
  turns the progress thread on, so every NIXL engine busy-polls a whole core even when idle (two
  of them starve a 2-core machine). We wrap the binding's agent constructor so the config it is
  given carries this delay instead: about 1000 us brings idle use to ~1.5 % of a core with KV
  transfers still at a few ms. Idle thread priority instead caused lock inversion.
- ``MOTOR_CPU_CORES`` (e.g. ``"1"`` or ``"0,1"``): vLLM's NIXL CPU path calls
  ``os.sched_setaffinity(0, [last core of the NUMA node])`` "to reserve a core for KV transfer",
  overriding the ``taskset`` the engine was started under; on 2 cores both engines then share
  core 1. We keep every affinity change of this process inside that set, so the worker thread and
  the NIXL threads it spawns (which inherit its mask) stay on the engine's own core.

5. vLLM's cache (``VLLM_CACHE_ROOT``), unless the environment names one: ``<vLLM's default>/engine``.
   vLLM caches each model class's inspection (``modelinfos/<module>-<class>.json``, keyed by the
   model file's hash) to skip a subprocess that imports torch and vLLM to inspect it again. The
   render sidecar (vLLM 0.33) reads and writes the same file, with the same hash (qwen2.py is the
   same in both), but its record has fields 0.32 lacks and lacks one 0.32 has: each failed to load
   the other's, inspected in that subprocess (20-60 s on a busy 2-core machine) and overwrote it,
   so nearly every start of either tier paid it.

Nothing here imports ``nixl`` (or torch) early: vLLM sets ``UCX_RCACHE_MAX_UNRELEASED`` only if
``nixl`` is not imported yet, so the agent fix waits on an import hook for the binding module.
"""

from __future__ import annotations

import faulthandler
import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any, Iterable, Sequence

import motorsite_cpu

# Set by the engine's top process to what it got (an AmxState value); every interpreter started
# below it inherits the variable and stays quiet when it got the same.
_AMX_REPORTED = "MOTOR_ENGINE_AMX"

# The wheels that can back ``nixl`` (its __init__ picks one by CUDA version); each has ``_api``.
_API_MODULES = {"nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api"}


def _patch_api(module: ModuleType, delay_us: int) -> None:
    real = module.nixlBind

    class _Bindings:
        """The binding module, but ``nixlAgent`` gets the configured progress-thread delay."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def nixlAgent(name: str, config: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - the binding's name
            config.pthrDelay = delay_us
            return real.nixlAgent(name, config, *args, **kwargs)

    module.nixlBind = _Bindings()  # type: ignore[attr-defined]


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, delay_us: int) -> None:
        self._inner = inner
        self._delay_us = delay_us

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _patch_api(module, self._delay_us)


class _NixlFinder(importlib.abc.MetaPathFinder):
    def __init__(self, delay_us: int) -> None:
        self._delay_us = delay_us

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _API_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, self._delay_us)
        return spec


def _install_pthr_delay() -> None:
    raw = os.environ.get("MOTOR_NIXL_PTHR_DELAY_US", "")
    if raw:
        sys.meta_path.insert(0, _NixlFinder(int(raw)))


def _install_core_clamp() -> None:
    raw = os.environ.get("MOTOR_CPU_CORES", "")
    if not raw or not hasattr(os, "sched_setaffinity"):
        return
    allowed = frozenset(int(c) for c in raw.split(","))
    real = os.sched_setaffinity

    def sched_setaffinity(pid: int, mask: Iterable[int], /) -> None:
        wanted = set(mask) & allowed
        # A request outside our cores (vLLM's "reserved KV core") gets our cores instead.
        real(pid, wanted or allowed)

    os.sched_setaffinity = sched_setaffinity


def _request_amx() -> None:
    result = motorsite_cpu.request_amx_permission()
    # One line per engine: the top process reports; a child speaks only if it got something else
    # than its parent (a refusal there is what kills the engine core).
    reported = os.environ.get(_AMX_REPORTED, "")
    if reported != result.state.value and sys.stderr is not None:
        print(result.message, file=sys.stderr, flush=True)
    if not reported:
        os.environ[_AMX_REPORTED] = result.state.value
        # Engines that do not come through motorsite.tiers (docker/compose.yaml) get its
        # preflight here: a line at start rather than only a SIGILL inside a kernel later.
        unsupported = motorsite_cpu.unsupported_cpu_reason()
        if unsupported and sys.stderr is not None:
            print(f"motorsite: {unsupported}", file=sys.stderr, flush=True)


def _enable_faulthandler() -> None:
    if sys.stderr is not None and not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)


def _report_subprocess_fates() -> None:
    # popen_fork.Popen is the base of the spawn and forkserver Popens too; its poll() is where
    # every Process.exitcode / join() / sentinel check learns the child's status.
    import multiprocessing.popen_fork as popen_fork
    import signal

    cls = popen_fork.Popen
    real_init, real_poll = cls.__init__, cls.poll

    def __init__(self: Any, process_obj: Any) -> None:  # noqa: N807 - wrapping the dunder
        self._motor_name = str(getattr(process_obj, "name", "?")).replace(" ", "_")
        real_init(self, process_obj)

    def poll(self: Any, flag: int = os.WNOHANG) -> int | None:
        before = self.returncode
        code: int | None = real_poll(self, flag)
        if before is None and code is not None and code != 0 and sys.stderr is not None:
            if code < 0:
                try:
                    fate = f"killed by {signal.Signals(-code).name}"
                except ValueError:
                    fate = f"killed by signal {-code}"
            else:
                fate = f"exited with code {code}"
            name = getattr(self, "_motor_name", "?")
            print(f"motorsite: subprocess {name} (pid {self.pid}) {fate}", file=sys.stderr, flush=True)
        return code

    cls.__init__, cls.poll = __init__, poll  # type: ignore[method-assign]


def _own_vllm_cache() -> None:
    if not os.environ.get("VLLM_CACHE_ROOT"):
        default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm")
        os.environ["VLLM_CACHE_ROOT"] = os.path.join(default, "engine")


_request_amx()
_own_vllm_cache()
_enable_faulthandler()
_report_subprocess_fates()
_install_pthr_delay()
_install_core_clamp()
