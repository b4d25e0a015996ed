"""The engine boundary: the one place engine requests leave and engine answers arrive.

Without a mapping it is a no-op. With one (``RenderView.obfuscation`` on), every request is
passed through ``obfuscate_request`` right before it is sent and every response or event
through ``deobfuscate_response`` / ``deobfuscate_event`` right after it arrives, so the rest of
the pipeline only ever sees semantic ids.
"""

from __future__ import annotations

from typing import Any, Mapping

from serving.pipeline.errors import MotorError, UpstreamRequestError
from serving.pipeline.obfuscation.fields import (
    deobfuscate_event,
    deobfuscate_response,
    obfuscate_request,
    refuse_unsendable,
    scrub_error,
)
from serving.pipeline.obfuscation.mapping import TokenMapping
from serving.pipeline.snapshot import InstanceView


class EngineBoundary:
    """Semantic -> physical ids on the way out, physical -> semantic on the way in."""

    def __init__(self, mapping: TokenMapping | None = None) -> None:
        self.mapping = mapping

    def admit(self, request: Mapping[str, Any]) -> None:
        """Raise ``ObfuscationRefused`` now for a rendered request no engine may receive (media,
        stop strings, grammars): checked once after render, before it is admitted or placed."""
        if self.mapping is not None:
            refuse_unsendable(request)

    def outbound(self, request: dict[str, Any], instance: InstanceView) -> dict[str, Any]:
        return request if self.mapping is None else obfuscate_request(request, self.mapping)

    def inbound(self, response: dict[str, Any], instance: InstanceView) -> dict[str, Any]:
        return response if self.mapping is None else deobfuscate_response(response, self.mapping)

    def inbound_event(self, event: dict[str, Any], instance: InstanceView) -> dict[str, Any]:
        return event if self.mapping is None else deobfuscate_event(event, self.mapping)

    def client_error(self, exc: MotorError) -> MotorError:
        """The error the client may see: with a mapping, an engine's 4xx loses its message, which can
        quote physical ids (HTTP 4xx and in-band error events alike); everything else as it is."""
        if self.mapping is None or not isinstance(exc, UpstreamRequestError) or exc.source != "engine":
            return exc
        return UpstreamRequestError(exc.status, {"error": scrub_error(exc.body().get("error") or {})}, source=exc.source)
