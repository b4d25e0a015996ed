"""Relay of a single-prompt stream after an engine failure: the retry plan.

What the client already saw is final, so the next attempt continues from it instead of starting
over (RFC 流式 replay 与重调度): its prompt is the original prompt ids plus the committed semantic
output ids, its budget is what is left of the client's, and it is already final ids (no render).
With ``n > 1`` every unfinished choice has its own committed ids, so each continues in an engine
request of its own (``choice``): ``n`` 1, that choice's replay ids and remaining budget.
The plan is pure data; the pipeline places it like any other prompt (same scheduler, same topology
rules, the obfuscation boundary re-obfuscates its ids on the way out).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from serving.pipeline.engine.requests import attempt_request_id, relay_request, resolved_max_tokens


@dataclass(frozen=True, slots=True)
class RetryRequestPlan:
    """The engine request of relay attempt ``attempt`` of one prompt."""

    base_request: Mapping[str, Any]  # render's GenerateRequest of the prompt (semantic ids)
    prompt_ids: tuple[int, ...]  # the original prompt: derender and usage keep using these
    committed_ids: tuple[int, ...]  # semantic output ids the client has seen
    attempt: int  # the engine attempt number; names the engine request
    # The client's choice index this plan continues when the request has n > 1 (None: n == 1).
    choice: int | None = None

    @classmethod
    def build(
        cls, base_request: Mapping[str, Any], prompt_ids: Sequence[int], committed_ids: Sequence[int], *,
        attempt: int, choice: int | None = None,
    ) -> RetryRequestPlan:
        return cls(base_request, tuple(prompt_ids), tuple(committed_ids), attempt, choice)

    @property
    def replay_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.committed_ids]

    @property
    def remaining_tokens(self) -> int:
        """Output budget left: the client's ``max_tokens`` minus what it already received."""
        return resolved_max_tokens(self.base_request) - len(self.committed_ids)

    @property
    def request_id(self) -> str:
        """Each attempt, and each choice's continuation, has an id of its own (an abort names one)."""
        rid = attempt_request_id(str(self.base_request["request_id"]), self.attempt)
        return rid if self.choice is None else f"{rid}-c{self.choice}"

    def request(self) -> dict[str, Any]:
        """The GenerateRequest to place: replay ids, reduced budget, this attempt's own id.

        Raises ``ValueError`` when no budget is left (the caller ends the stream instead).
        """
        remaining = self.remaining_tokens
        if remaining < 1:
            raise ValueError("no output budget left to relay")
        return relay_request(
            self.base_request, token_ids=self.replay_ids, committed=len(self.committed_ids), max_tokens=remaining,
            request_id=self.request_id, one_choice=self.choice is not None,
        )
