"""The topology registry: each topology's runner (non-streaming) and opener (streaming).

Built once by the composition root (``serving/runtime.py``) or by a test, and handed to the
pipeline; nothing registers itself by being imported.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from serving.pipeline.engine.leg import GenerateContext
from serving.pipeline.placement.scheduler import Placement
from serving.pipeline.topologies import handoff, trigger, union
from serving.pipeline.topologies.hybrid import Topology, pd_ineligible
from serving.pipeline.topologies.pd import OpenedStream

# (the attempt's context, its placement, the budgeted engine request) -> D's (or union's) response.
TopologyRunner = Callable[[GenerateContext, Placement, dict[str, Any]], Awaitable[dict[str, Any]]]
# (..., the attempt's stack) -> (streaming instance, its leg's engine request id, its events); the
# prefill side is over (or released) when it returns, the stream's holds are on the stack.
StreamOpener = Callable[[GenerateContext, Placement, dict[str, Any], AsyncExitStack], Awaitable[OpenedStream]]


def _runners() -> dict[str, TopologyRunner]:
    return {Topology.UNION.value: union.run_union, Topology.HANDOFF.value: handoff.handoff,
            Topology.TRIGGER.value: trigger.trigger}


def _openers() -> dict[str, StreamOpener]:
    return {Topology.UNION.value: union.open_union, Topology.HANDOFF.value: handoff.handoff_stream,
            Topology.TRIGGER.value: trigger.trigger_stream}


@dataclass(frozen=True)
class TopologyRegistry:
    """Runners and openers by topology name, and why a request must stay on one instance."""

    runners: Mapping[str, TopologyRunner] = field(default_factory=_runners)
    openers: Mapping[str, StreamOpener] = field(default_factory=_openers)
    # Why an engine request must stay on one instance ("" when P/D can serve it exactly).
    pd_ineligible: Callable[[Mapping[str, Any]], str] = pd_ineligible
