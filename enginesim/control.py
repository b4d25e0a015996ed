"""The simulator's own test controls (``/sim/*``): scripts, faults, stats, cache and the
simulated KV transfer between prefill and decode instances. Unauthenticated: test-only."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from enginesim.bodies import parse, peer_json
from enginesim.engine import SimEngine
from enginesim.faults import Fault, FaultMode
from enginesim.protocol import FaultIn, ScriptIn
from enginesim.scripts import MatchMode, Script


class ControlHandlers:
    """The ``/sim/*`` routes bound to one engine."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    async def add_script(self, request: Request) -> Response:
        script_in = await parse(request, ScriptIn)
        script = Script(
            tuple(script_in.prompt_token_ids),
            tuple(script_in.output_token_ids),
            MatchMode(script_in.match),
        )
        # A new immutable book: running generations keep the one they started with.
        self.engine.scripts = self.engine.scripts.with_script(script)
        return JSONResponse({"scripts": len(self.engine.scripts.scripts)})

    async def clear_scripts(self, request: Request) -> Response:
        self.engine.scripts = type(self.engine.scripts)()
        return JSONResponse({"scripts": 0})

    async def arm_fault(self, request: Request) -> Response:
        fault_in = await parse(request, FaultIn)
        fault = Fault(FaultMode(fault_in.mode), tokens=fault_in.tokens, status=fault_in.status)
        self.engine.faults.arm(fault, fault_in.count)
        return JSONResponse({"remaining": self.engine.faults.remaining})

    async def clear_faults(self, request: Request) -> Response:
        self.engine.faults.clear()
        return JSONResponse({"remaining": 0})

    async def stats(self, request: Request) -> Response:
        engine = self.engine
        data = engine.stats.as_json(engine.running)
        data["cache"] = {
            "blocks": len(engine.cache),
            "capacity": engine.cache.capacity,
            "block_size": engine.cache.block_size,
            "hit_tokens": engine.cache.stats.hits,
            "queried_tokens": engine.cache.stats.queried_tokens,
        }
        data["prompt_tokens_by_source"] = dict(engine.stats.prompt_tokens_by_source)
        data["kv"] = {
            "role": engine.config.role.value,
            "connector": engine.config.kv_connector,
            "transfer": engine.config.kv_transfer,
            "engine_id": engine.kv.engine_id,
            "held": engine.kv.held,
            "waiting": engine.kv.waiting,
            "pulled": engine.kv.pulled,
            "pushed": engine.kv.pushed,
            "expired": engine.kv.expired,
        }
        return JSONResponse(data)

    async def clear_cache(self, request: Request) -> Response:
        self.engine.cache.clear()
        return JSONResponse({"blocks": 0})

    async def kv_pull(self, request: Request) -> Response:
        status, reason = self.engine.kv.release(await peer_json(request))
        return JSONResponse({"detail": reason}, status_code=status)

    async def kv_push(self, request: Request) -> Response:
        status, reason = self.engine.kv.accept_push(await peer_json(request))
        return JSONResponse({"detail": reason}, status_code=status)

    async def reset(self, request: Request) -> Response:
        stats = self.engine.stats
        # Live streams keep decrementing active_streams; carry the live count over.
        active = stats.active_streams
        self.engine.stats = type(stats)(active_streams=active)
        return JSONResponse(self.engine.stats.as_json(self.engine.running))
