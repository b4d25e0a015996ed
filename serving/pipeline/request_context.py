"""What one /v1 request carries down the pipeline, passed explicitly (no context variables).

The edge builds it once the key, the body and the model are known (``serving/edge/openai_api.py``):
the key's policy and rate-limit charge, the request's phase recorder (``Phases``, which also
holds its trace) and the W3C trace headers every upstream call of it carries (``trace``).
``ServingPipeline`` takes it with the body and gives it to every step that needs one of its parts; a bare request id stands for a context with the defaults (an
unauthenticated caller's: no extras, no limit), which is what tests and tools pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from serving.pipeline.flow_control.rate_limit import KeyCharge, KeyLimit
from serving.pipeline.phases import NO_PHASES, Phases
from serving.pipeline.request_checks import NO_EXTRAS, KeyPolicy
from serving.pipeline.tracing import NO_TRACE


@dataclass(frozen=True, slots=True)
class KeyGrant:
    """What a client key brings to a request (``keys.authenticate``): its policy beyond the
    plain API and its tokens-per-minute limit (None: unlimited)."""

    policy: KeyPolicy = NO_EXTRAS
    limit: KeyLimit | None = None

    def for_model(self, model: str) -> KeyGrant:
        """The grant with the limit's window scoped to ``model`` (``KeyLimit.for_model``)."""
        return KeyGrant(self.policy, self.limit.for_model(model)) if self.limit is not None else self


NO_GRANT = KeyGrant()


@dataclass(frozen=True, slots=True)
class RequestContext:
    """One request's identity and what its caller may do; immutable but for the charge's state."""

    request_id: str
    phases: Phases = NO_PHASES  # the request's recorder: histograms and (when tracing) its spans
    policy: KeyPolicy = NO_EXTRAS
    charge: KeyCharge = field(default_factory=lambda: KeyCharge(None))  # charged once per request
    # The W3C headers every render, derender, generate and native call of the request carries
    # (``tracing.with_trace``): the root span's when tracing, else the client's own.
    trace: Mapping[str, str] = field(default_factory=lambda: NO_TRACE)

    @classmethod
    def of(cls, request: RequestContext | str, phases: Phases = NO_PHASES) -> RequestContext:
        """``request`` itself, or the default context of a bare request id."""
        return request if isinstance(request, RequestContext) else cls(request, phases)

    @classmethod
    def granted(
        cls, request_id: str, grant: KeyGrant, phases: Phases = NO_PHASES, trace: Mapping[str, str] = NO_TRACE
    ) -> RequestContext:
        """The context of a request whose key brought ``grant`` (already scoped to its model)."""
        return cls(request_id, phases, grant.policy, KeyCharge(grant.limit), trace)
