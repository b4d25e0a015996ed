"""The immutable view of control data the data plane reads instead of the database.

Built from the database by ``serving.snapshots`` and swapped whole when control data changes,
so a request sees one consistent fleet from start to end and the hot path makes no queries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True, slots=True)
class ModelView:
    name: str
    model_path: str
    max_model_len: int


@dataclass(frozen=True, slots=True)
class RenderView:
    enable: bool
    base_url: str
    timeout_s: float  # per render/derender call and per streaming derender chunk


@dataclass(frozen=True, slots=True)
class InstanceView:
    id: int
    name: str
    url: str
    role: str  # union | prefill | decode
    model: str
    weight: int
    token_capacity: int
    max_model_len: int
    token_generate: bool
    native_openai: bool
    tokenizer: bool
    state: str  # active | draining | quarantined | disabled

    @property
    def takes_new_requests(self) -> bool:
        return self.state == "active"


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    version: int
    models: Mapping[str, ModelView]
    render: RenderView
    instances: tuple[InstanceView, ...] = field(default_factory=tuple)

    def union_instances(self, model: str) -> list[InstanceView]:
        """Instances that can serve ``model`` token-only on their own, in a stable order."""
        return [
            i
            for i in self.instances
            if i.model == model and i.role == "union" and i.token_generate and i.takes_new_requests
        ]
