"""What an engine can do, as its capability probe recorded it: pure functions, no I/O.

``fleet.engine_probes`` records a dict per engine (``EngineInstance.capabilities``)::

    {"version": "0.32.0", "token_in": true,
     "routes": {"generate": true, "native": ["chat", "completions", "messages", "responses"]},
     "tokenizer_loaded": true, "lora": {"enabled": true}}

``routes`` is None when the engine served no OpenAPI document, and ``tokenizer_loaded`` None when
its ``/tokenize`` gave no verdict: unknown fields leave the operator's record standing. The rule
(``engine_flags``) is the render pool's: what the probe found can only take away what the
operator's ``cap_*`` fields grant, never add to it, so an operator can still keep a capable
engine off a path, and an engine not probed yet is taken at the operator's word.

Which LoRA adapters an engine holds is not in this record: ``EngineInstance.lora_adapters`` (the
LoRA probe's, read every probe interval since vLLM loads and unloads adapters at runtime) is the
one list, and what the admin, the API and the dashboard say of LoRA is derived from it here
(``instance_traffic``), as placement's ``InstanceView.lora_adapters`` is in the snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from catalog.render_versions import parse_version

if TYPE_CHECKING:
    from fleet.models import EngineInstance

# The RFC's Token-In floor: below vLLM 0.23 an engine has no /inference/v1/generate to speak of.
ENGINE_TOKEN_IN_MIN = (0, 23, 0)
GENERATE_ROUTE = "/inference/v1/generate"
# The engine's own APIs by the pipeline's request kind (serving.pipeline.engine.native.NATIVE_PATHS).
NATIVE_ROUTES = {
    "chat": "/v1/chat/completions", "completions": "/v1/completions",
    "messages": "/v1/messages", "responses": "/v1/responses",
}


def token_in(version: str) -> bool:
    """Whether an engine reporting ``version`` is at the Token-In floor (0.23); unparsable: no."""
    v = parse_version(version)
    return v is not None and v >= ENGINE_TOKEN_IN_MIN


def routes_from_openapi(paths: set[str]) -> dict[str, Any]:
    """The routes that matter to placement, out of the paths of an engine's OpenAPI document."""
    return {
        "generate": GENERATE_ROUTE in paths,
        "native": [kind for kind, path in NATIVE_ROUTES.items() if path in paths],
    }


@dataclass(frozen=True, slots=True)
class EngineFlags:
    """What placement may use of one engine (``InstanceView``'s capability fields)."""

    token_generate: bool
    native_openai: bool
    tokenizer: bool
    native_routes: frozenset[str] | None  # None: not probed, every native route taken as served


def engine_flags(
    capabilities: dict[str, Any] | None, *, token_generate: bool, native_openai: bool, tokenizer: bool
) -> EngineFlags:
    """The operator's ``cap_*`` fields less what the probe found missing (module docstring)."""
    caps = capabilities or {}
    routes = caps.get("routes")
    native = routes.get("native") if isinstance(routes, dict) else None
    native_routes = frozenset(str(k) for k in native) if isinstance(native, list) else None
    loaded = caps.get("tokenizer_loaded") is not False
    return EngineFlags(
        # ``token_in`` already folds in the generate route when the document listed routes.
        token_generate=token_generate and caps.get("token_in") is not False,
        # An engine's own API turns text into ids itself: without a tokenizer it serves nothing.
        native_openai=native_openai and loaded and native_routes != frozenset(),
        tokenizer=tokenizer and loaded,
        native_routes=native_routes,
    )


def lora_line(capabilities: dict[str, Any] | None, lora_adapters: list[str] | None) -> str:
    """What the engine does with LoRA: the adapters it holds (the LoRA probe's record), else
    whether its capability probe found LoRA enabled; empty when neither says anything."""
    if lora_adapters:
        return "LoRA " + ", ".join(sorted(lora_adapters))
    lora = (capabilities or {}).get("lora")
    return "LoRA enabled, no adapter loaded" if isinstance(lora, dict) and lora.get("enabled") else ""


def instance_traffic(instance: EngineInstance) -> str:
    """``engine_traffic`` of an engine's row, with the adapters it holds: the admin's, the API's
    and the dashboard's one line."""
    line = engine_traffic(instance.capabilities, token_generate=instance.cap_token_generate,
                          native_openai=instance.cap_native_openai, tokenizer=instance.cap_tokenizer)
    lora = lora_line(instance.capabilities, instance.lora_adapters)
    return f"{line}; {lora}" if lora else line


def engine_traffic(capabilities: dict[str, Any] | None, *, token_generate: bool, native_openai: bool,
                   tokenizer: bool) -> str:
    """One line for the admin: which paths the engine takes, and why not the others."""
    caps = capabilities or {}
    if not caps:
        return "not probed yet: the record's capabilities stand"
    flags = engine_flags(caps, token_generate=token_generate, native_openai=native_openai, tokenizer=tokenizer)
    version = str(caps.get("version") or "?")
    parts = []
    if flags.token_generate:
        parts.append("token-only" + (" (tokenizer loaded)" if flags.tokenizer else ""))
    elif token_generate:
        routes = caps.get("routes")
        no_route = isinstance(routes, dict) and not routes.get("generate")
        parts.append("no token-only: " + (f"{GENERATE_ROUTE} not served" if no_route and token_in(version)
                                          else f"vLLM {version} is older than 0.23"))
    if flags.native_openai:
        served = sorted(flags.native_routes) if flags.native_routes is not None else list(NATIVE_ROUTES)
        parts.append("native " + ", ".join(served))
    elif native_openai:
        parts.append("no native: " + ("tokens-only (no tokenizer loaded)" if caps.get("tokenizer_loaded") is False
                                      else "no OpenAI route served"))
    return "; ".join(parts) or "nothing: the record grants no path"
