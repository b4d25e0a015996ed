"""The topology registry: each topology's opener, the one attempt primitive of both modes.

An opener runs one attempt of one prompt and returns an ``Opened``: the established stream when
the attempt streams, the whole answer when it does not (``GenerateContext.stream``). Built once
by the composition root (``serving/runtime.py``) or by a test, and handed to the pipeline;
nothing registers itself by being imported.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from serving.pipeline.engine.leg import GenerateContext, Opened
from serving.pipeline.placement.scheduler import Placement
from serving.pipeline.topologies import handoff, trigger, union
from serving.pipeline.topologies.hybrid import Topology, pd_ineligible

# (the attempt's context, its placement, the budgeted engine request, the attempt's stack) ->
# the last leg's instance, id and output; the prefill side is over (or released) when it
# returns, a stream's holds are on the stack.
TopologyOpener = Callable[[GenerateContext, Placement, dict[str, Any], AsyncExitStack], Awaitable[Opened]]


def _openers() -> dict[str, TopologyOpener]:
    return {Topology.UNION.value: union.open_union, Topology.HANDOFF.value: handoff.handoff,
            Topology.TRIGGER.value: trigger.trigger}


@dataclass(frozen=True)
class TopologyRegistry:
    """Openers by topology name, and why a request must stay on one instance."""

    openers: Mapping[str, TopologyOpener] = field(default_factory=_openers)
    # Why an engine request must stay on one instance ("" when P/D can serve it exactly).
    pd_ineligible: Callable[[Mapping[str, Any]], str] = pd_ineligible
