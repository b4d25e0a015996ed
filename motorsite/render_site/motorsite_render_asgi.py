"""An ASGI middleware for the render sidecar: derender calls skip the per-request HTTP metrics.

Loaded by vLLM itself through its own ``--middleware`` option (``motorsite.tiers.RENDER_MIDDLEWARE``;
``render_sidecar_command`` puts this directory on the sidecar's ``PYTHONPATH``, as
``docker/Dockerfile.vllm`` and the compose and k8s specs do). Stdlib only: it runs in the render
environment, which has no motorsite.

Why: a streamed answer costs the sidecar one derender call per chunk, and every call went through
prometheus-fastapi-instrumentator's middleware, which vLLM 0.33.0 mounts unconditionally (no option
turns it off): a second walk of the route table, a timer, four metric updates, about 0.1 ms of
the sidecar's ~0.6 ms of CPU per call (``bench/sidecar_options.py``). What is given up: the
sidecar's ``http_requests_total`` and latency series for the two derender paths. The coordinator
times each prompt's first derender call and the time per output token (docs/metrics.md), which
the later calls are part of; render, ``/health`` and everything else are still counted here.

How: vLLM adds the instrumentator first, then CORS, then each ``--middleware``, and Starlette puts
the last added outermost, so this layer sits directly above CORS and the instrumentator. A
``POST`` to a derender path without an ``Origin`` header (CORS would let it through untouched)
goes straight to the first layer below them; nothing else changes, and the wire protocol is
vLLM's. Only a run of CORS and instrumentator layers directly below is skipped, and only when it
holds the instrumentator: any other layer there (an API key check, request ids) ends the run,
so it still sees every call. With a chain of another shape nothing is skipped.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

DERENDER_PATHS = frozenset({"/v1/chat/completions/derender", "/v1/completions/derender"})
# The layers a derender call may skip, by their classes' qualified names (nothing imported).
METRICS_LAYER = "prometheus_fastapi_instrumentator.middleware.PrometheusInstrumentatorMiddleware"
SKIPPABLE = frozenset({METRICS_LAYER, "starlette.middleware.cors.CORSMiddleware"})

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def _name(layer: object) -> str:
    cls = type(layer)
    return f"{cls.__module__}.{cls.__qualname__}"


def below_metrics(app: ASGIApp) -> ASGIApp:
    """The first layer under the run of skippable layers starting at ``app``, if that run holds
    the metrics layer; ``app`` itself otherwise."""
    node, skipped = app, set()
    while _name(node) in SKIPPABLE and hasattr(node, "app"):
        skipped.add(_name(node))
        node = node.app
    return node if METRICS_LAYER in skipped else app


class DerenderFastPath:
    """``--middleware motorsite_render_asgi.DerenderFastPath``: see the module docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        # Found on the first derender call: the layers below are built before any request.
        self._inner: ASGIApp | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] in DERENDER_PATHS
            and scope["method"] == "POST"
            and not any(name == b"origin" for name, _ in scope["headers"])
        ):
            if self._inner is None:
                self._inner = below_metrics(self.app)
            await self._inner(scope, receive, send)
            return
        await self.app(scope, receive, send)
