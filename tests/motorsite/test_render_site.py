"""The render site's middleware (``motorsite/render_site``): which layers a derender call skips.

Plain ASGI layers stand in for vLLM's (classes named as Starlette's CORS and the instrumentator's
middleware are): what reaches each layer is recorded. The real sidecar is in
``tests/integration/test_sidecar_options_real.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from motorsite import tiers
from motorsite.render_site import motorsite_render_asgi as site

Seen = list[str]


class Layer:
    def __init__(self, app: Any, seen: Seen) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.seen.append(type(self).__name__)
        await self.app(scope, receive, send)


def named(module: str, name: str) -> type[Layer]:
    return type(name, (Layer,), {"__module__": module, "__qualname__": name})


CORS = named("starlette.middleware.cors", "CORSMiddleware")
METRICS = named("prometheus_fastapi_instrumentator.middleware", "PrometheusInstrumentatorMiddleware")
AUTH = named("vllm.entrypoints.serve.middleware.authenticate", "AuthenticationMiddleware")


def chain(*layers: type[Layer]) -> tuple[site.DerenderFastPath, Seen]:
    """``DerenderFastPath`` over ``layers`` (outermost first) over an endpoint."""
    seen: Seen = []

    async def endpoint(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append("endpoint")

    app: Any = endpoint
    for layer in reversed(layers):
        app = layer(app, seen)
    return site.DerenderFastPath(app), seen


def call(app: site.DerenderFastPath, path: str, *, method: str = "POST", origin: bool = False) -> None:
    headers = [(b"content-type", b"application/json")] + ([(b"origin", b"http://example.test")] if origin else [])
    asyncio.run(app({"type": "http", "path": path, "method": method, "headers": headers}, None, None))


@pytest.mark.parametrize("path", sorted(site.DERENDER_PATHS))
def test_a_derender_call_skips_cors_and_the_http_metrics(path: str) -> None:
    app, seen = chain(CORS, METRICS)
    call(app, path)
    assert seen == ["endpoint"]


@pytest.mark.parametrize(("path", "method", "origin"), [
    ("/v1/chat/completions/render", "POST", False),
    ("/health", "GET", False),
    ("/v1/chat/completions/derender", "GET", False),
    ("/v1/chat/completions/derender", "POST", True),  # a browser's: CORS must see it
])
def test_every_other_call_goes_through_every_layer(path: str, method: str, origin: bool) -> None:
    app, seen = chain(CORS, METRICS)
    call(app, path, method=method, origin=origin)
    assert seen == ["CORSMiddleware", "PrometheusInstrumentatorMiddleware", "endpoint"]


def test_a_layer_it_does_not_know_ends_the_skip_so_an_api_key_check_still_sees_every_call() -> None:
    app, seen = chain(AUTH, CORS, METRICS)
    call(app, "/v1/chat/completions/derender")
    assert seen == ["AuthenticationMiddleware", "CORSMiddleware", "PrometheusInstrumentatorMiddleware", "endpoint"]


def test_without_the_metrics_layer_below_nothing_is_skipped() -> None:
    app, seen = chain(CORS)
    call(app, "/v1/chat/completions/derender")
    assert seen == ["CORSMiddleware", "endpoint"]


def test_the_sidecar_command_loads_it_from_the_render_site() -> None:
    argv, env = tiers.render_sidecar_command(python="python", model_dir="/m", served_model_name="tiny", port=1, workers=1)
    assert argv[argv.index("--middleware") + 1] == "motorsite_render_asgi.DerenderFastPath"
    module, name = tiers.RENDER_MIDDLEWARE.rsplit(".", 1)
    assert (tiers.RENDER_SITE_DIR / f"{module}.py").is_file() and name == site.DerenderFastPath.__name__
    assert env["PYTHONPATH"] == str(tiers.RENDER_SITE_DIR)
