"""Union: one instance prefills and decodes."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

from serving.pipeline.engine.leg import GenerateContext
from serving.pipeline.placement.scheduler import Placement
from serving.pipeline.topologies.pd import OpenedStream


async def run_union(ctx: GenerateContext, placement: Placement, engine_request: dict[str, Any]) -> dict[str, Any]:
    """One non-streaming leg on the placed instance."""
    return await ctx.leg(placement.instances[0], engine_request, phase="union")


async def open_union(
    ctx: GenerateContext, placement: Placement, engine_request: dict[str, Any], stack: AsyncExitStack
) -> OpenedStream:
    """One streaming leg on the placed instance; its holds and stream go on ``stack``."""
    instance = placement.instances[0]
    events = await ctx.stream_leg(instance, engine_request, phase="union", tokens=ctx.tokens, stack=stack)
    return instance, engine_request["request_id"], events
