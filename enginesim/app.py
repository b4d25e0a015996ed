"""Starlette app of the simulator: vLLM's token-only endpoints plus ``/sim/*`` controls.

Also the engine's own OpenAI API (``enginesim.openai_api``): chat, completions, Responses and
Anthropic Messages, with ``kv_transfer_params`` for the P/D roles as vLLM takes them.

Control API (test-only, unauthenticated):

- ``POST /sim/script`` ``{"prompt_token_ids", "output_token_ids", "match": "exact"|"suffix"}``
  registers scripted output (see ``enginesim.scripts``); ``DELETE /sim/script`` drops all.
- ``POST /sim/faults`` ``{"mode", "tokens", "status", "count"}`` arms a fault for the next
  ``count`` generate requests (see ``enginesim.faults``); ``DELETE /sim/faults`` disarms.
- ``GET /sim/stats``; ``POST /sim/reset`` clears the stats (not scripts or faults).
- ``DELETE /sim/cache`` empties the prefix cache (publishes ``AllBlocksCleared``).
- ``POST /sim/kv/pull`` and ``POST /sim/kv/push``: the simulated KV transfer between
  prefill and decode instances (see ``enginesim.pd`` for the contract).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from enginesim.config import SimConfig
from enginesim.control import ControlHandlers
from enginesim.engine import SimEngine
from enginesim.errors import SimError
from enginesim.generate import GenerateHandlers
from enginesim.openai_api import OpenAIHandlers
from enginesim.probes import ProbeHandlers
from enginesim.streaming import RawSendApp


async def _sim_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SimError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    # FastAPI's shape for router misses ({"detail": "Not Found"}), which vLLM keeps.
    assert isinstance(exc, HTTPException)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


@asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    yield
    # The KV peer client and the event socket belong to the engine; close them with it.
    await app.state.engine.aclose()


def openapi_document(routes: list[Route], version: str) -> dict[str, object]:
    """The paths part of the OpenAPI document FastAPI serves for vLLM: every route the engine
    serves (what a coordinator's capability probe reads), without the simulator's controls."""
    paths = {
        r.path: {m.lower(): {} for m in sorted(r.methods or ()) if m != "HEAD"}
        for r in routes if not r.path.startswith("/sim/")
    }
    return {"openapi": "3.1.0", "info": {"title": "enginesim", "version": version}, "paths": paths}


def create_app(config: SimConfig | None = None) -> Starlette:
    """A simulator app for ``config``; ``app.state.engine`` is its :class:`SimEngine`."""
    engine = SimEngine(config or SimConfig())
    g, p, c = GenerateHandlers(engine), ProbeHandlers(engine), ControlHandlers(engine)
    o = OpenAIHandlers(g)
    routes = [
        # The engine's own OpenAI API (a tokenizer-loaded vLLM's), over a toy tokenizer: see openai_api.
        Route("/v1/chat/completions", o.chat, methods=["POST"]),
        Route("/v1/completions", o.completions, methods=["POST"]),
        Route("/v1/responses", o.responses, methods=["POST"]),
        Route("/v1/messages", o.messages, methods=["POST"]),
        Route("/tokenize", o.tokenize, methods=["POST"]),
        Route("/inference/v1/generate", g.generate, methods=["POST"]),
        Route("/inference/v1/abort_requests", g.abort_requests, methods=["POST"]),
        # The legacy unauthenticated route of --tokens-only servers.
        Route("/abort_requests", g.abort_requests, methods=["POST"]),
        Route("/health", p.health, methods=["GET"]),
        Route("/ping", p.health, methods=["GET", "POST"]),
        Route("/version", p.version, methods=["GET"]),
        Route("/load", p.load, methods=["GET"]),
        Route("/v1/models", p.models, methods=["GET"]),
        Route("/metrics", p.metrics, methods=["GET"]),
        Route("/sim/script", c.add_script, methods=["POST"]),
        Route("/sim/script", c.clear_scripts, methods=["DELETE"]),
        Route("/sim/faults", c.arm_fault, methods=["POST"]),
        Route("/sim/faults", c.clear_faults, methods=["DELETE"]),
        Route("/sim/stats", c.stats, methods=["GET"]),
        Route("/sim/reset", c.reset, methods=["POST"]),
        Route("/sim/cache", c.clear_cache, methods=["DELETE"]),
        Route("/sim/kv/pull", c.kv_pull, methods=["POST"]),
        Route("/sim/kv/push", c.kv_push, methods=["POST"]),
    ]
    routes = [r for r in routes if r.path not in engine.config.omitted_routes]
    spec = openapi_document(routes, engine.config.version)
    routes.append(Route("/openapi.json", lambda request: JSONResponse(spec), methods=["GET"]))
    app = RawSendApp(
        routes=routes,
        exception_handlers={SimError: _sim_error, HTTPException: _http_error},
        lifespan=_lifespan,
    )
    app.state.engine = engine
    return app
