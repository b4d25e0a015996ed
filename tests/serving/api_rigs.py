"""What test_messages_api.py and test_responses_api.py share: the fleet of two union engines
that also serve their own OpenAI API (so the native path exists), a sidecar's answer when it
lacks an API's render route, and an SSE body read as ``(event name, data)`` pairs."""

from __future__ import annotations

import json
from typing import Any

from tests.serving.router_fakes import engine, respond

FLEET = (engine("e1", native_openai=True), engine("e2", native_openai=True))
NO_ROUTE = respond(404, {"detail": "Not Found"})  # a sidecar older than vLLM 0.33


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            assert name.startswith("event: ") and data.startswith("data: ")
            out.append((name[7:], json.loads(data[6:])))
    return out
