"""Token-only engine simulator speaking vLLM 0.33.0's generate protocol (tests, demos)."""

from __future__ import annotations

from enginesim.app import create_app
from enginesim.config import EngineRole, SimConfig

__all__ = ["EngineRole", "SimConfig", "create_app"]
