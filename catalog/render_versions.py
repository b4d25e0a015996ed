"""What a render sidecar's vLLM version lets it do: the RFC's version floors.

Pure functions of the version string a probe recorded. The catalog owns them because the render
config carries that version (its admin shows where the floors send traffic); the probes
(``fleet.probes``) and the snapshot builder (``serving.snapshots``) read them too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``"0.33.0"``, ``"0.32.0+cpu"``, ``"0.27.1rc1"``, ``"0.11.1.dev3+g0abc"`` -> (major, minor, patch)."""
    m = _VERSION.match(text or "")
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


# From the RFC's version requirements: render token-in needs 0.23, the complete non-streaming
# render/derender 0.24, streaming derender 0.27.
TOKEN_IN_MIN = (0, 23, 0)
DERENDER_MIN = (0, 24, 0)
STREAMING_DERENDER_MIN = (0, 27, 0)


@dataclass(frozen=True, slots=True)
class RenderCapabilities:
    token_in: bool
    derender: bool
    streaming_derender: bool


def render_capabilities(version: str) -> RenderCapabilities:
    """What a sidecar reporting ``version`` can do; an unparsable version can do nothing."""
    v = parse_version(version)
    if v is None:
        return RenderCapabilities(False, False, False)
    return RenderCapabilities(v >= TOKEN_IN_MIN, v >= DERENDER_MIN, v >= STREAMING_DERENDER_MIN)


def probed_capabilities(version: str) -> RenderCapabilities:
    """What the data plane may use of a sidecar whose probe recorded ``version``: everything while
    nothing is recorded yet (a fresh deployment, or a probe that got no version answer: the
    deployment's own word stands until a probe says otherwise), else ``render_capabilities``."""
    if not version:
        return RenderCapabilities(True, True, True)
    return render_capabilities(version)


def render_traffic(version: str) -> str:
    """Which path the version floors leave a sidecar reporting ``version`` (the admin shows it)."""
    caps = probed_capabilities(version)
    if not caps.token_in:
        return f"native: sidecar vLLM {version} is older than 0.23 (no token-in render)"
    if not caps.derender:
        return f"native: sidecar vLLM {version} is older than 0.24 (no derender)"
    if not caps.streaming_derender:
        return f"token-only; streams native: sidecar vLLM {version} is older than 0.27 (no streaming derender)"
    return "token-only" if version else "token-only (version not probed yet)"


def member_traffic(version: str, capabilities: dict[str, object] | None) -> str:
    """``render_traffic`` for one pool member, with what its probe found it serves: a route its
    OpenAPI document lacks is a request class it does not take, whatever its version."""
    base = render_traffic(version)
    routes = (capabilities or {}).get("routes")
    if not isinstance(routes, dict):
        return base
    missing = [f"render {k}" for k in ("chat", "completions", "messages", "responses") if k not in (routes.get("render") or [])]
    missing += [f"derender {k}" for k in ("chat", "completions") if k not in (routes.get("derender") or [])]
    return f"{base}; does not serve {', '.join(missing)}" if missing else base


def pool_traffic(versions: list[str]) -> str:
    """``render_traffic`` for a pool whose members' probes recorded ``versions``: the path choice
    reads what some member can do, and a mixed pool serves each call on a member that can."""
    if len(versions) <= 1:
        return render_traffic(versions[0] if versions else "")
    caps = [probed_capabilities(v) for v in versions]
    if not any(c.token_in for c in caps):
        return "native: no sidecar of the pool is 0.23 or newer (no token-in render)"
    if not any(c.derender for c in caps):
        return "native: no sidecar of the pool is 0.24 or newer (no derender)"
    streams = sum(c.streaming_derender for c in caps)
    if not streams:
        return "token-only; streams native: no sidecar of the pool is 0.27 or newer (no streaming derender)"
    if streams < len(caps):
        return f"token-only; streams derendered by {streams} of {len(caps)} sidecars (the others are older than 0.27)"
    return "token-only"
