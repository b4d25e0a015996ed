"""Union: one instance prefills and decodes."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

from serving.pipeline.engine.leg import GenerateContext, Opened
from serving.pipeline.placement.scheduler import Placement


async def open_union(
    ctx: GenerateContext, placement: Placement, engine_request: dict[str, Any], stack: AsyncExitStack
) -> Opened:
    """One leg on the placed instance, in the attempt's mode; a stream's holds go on ``stack``."""
    return await ctx.open_leg(placement.instances[0], engine_request, phase="union", stack=stack)
