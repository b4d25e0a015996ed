"""vllm-ascend launch arguments for an engine instance, and the P/D seed's DFX rules applied to them.

Pure: no database, no I/O. ``fleet.services.instance_ascend_launch`` builds the records from the
fleet and calls ``launch_config``; the admin and ``manage.py ascend_args`` show the result.

What is produced follows vllm-ascend 0.23.0.post1 (``docs/ascend-connectors.md``):

- ``--kv-transfer-config`` names ``MooncakeConnectorV1`` for pull (vllm-ascend registers its
  pull connector under that name; plain ``MooncakeConnector`` is upstream vLLM's, another
  protocol) and ``MooncakeLayerwiseConnector`` for push, ``kv_role`` ``kv_producer`` on P and
  ``kv_consumer`` on D, ``kv_port`` from the record, and ``kv_connector_extra_config`` with the
  group's prefill and decode TP/DP sizes (the pull worker asserts all four are present).
- The DFX rules of the seed (``pd-disaggregation-vllm-ascend.txt``): a supported connector type,
  P and D of one pull/push kind, no port bound twice on one host across the fleet, and
  ``P_tp >= D_tp`` with ``P_tp % D_tp == 0``; plus the seed's limit that P and D are of one
  hardware generation.

``AscendConfigError`` carries every problem found, not only the first, so an operator fixes a
record in one pass.
"""

from __future__ import annotations

import ipaddress
import json
import shlex
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

ASCEND_GENERATIONS = frozenset({"A2", "A3", "A5", "310P"})
# motorsite's connector value -> the name vllm-ascend registers (vllm_ascend/distributed/kv_transfer/__init__.py).
ASCEND_CONNECTORS = {
    "MooncakeConnector": "MooncakeConnectorV1",  # pull: D reads P's blocks (Handoff)
    "MooncakeLayerwiseConnector": "MooncakeLayerwiseConnector",  # push: P writes D's blocks layer by layer (Trigger)
}
TRANSFER_OF = {"MooncakeConnector": "pull", "MooncakeLayerwiseConnector": "push"}
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


class AscendConfigError(ValueError):
    """The record cannot be launched as given; ``problems`` says every reason."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True)
class EngineRecord:
    """What launch arguments are made from: one engine instance as the database holds it."""

    name: str
    role: str  # union | prefill | decode
    served_model_id: int
    served_model_name: str
    model_path: str
    hardware: str
    kv_connector: str
    kv_transfer: str
    host: str
    http_port: int
    kv_port: int | None
    tp: int = 1
    dp: int = 1
    ep: int = 1
    max_model_len: int | None = None
    tokens_only: bool = True
    # Every port the engine binds on ``host``, with what it is for (``EngineInstance.bound_ports``).
    ports: dict[int, str] = field(default_factory=dict)

    @property
    def transfer(self) -> str:
        return self.kv_transfer or TRANSFER_OF.get(self.kv_connector, "pull")


@dataclass(frozen=True)
class AscendLaunch:
    """The command an operator runs on the engine's host: ``argv``, ``env`` on top of the host's."""

    argv: list[str]
    env: dict[str, str]
    kv_transfer_config: dict[str, Any] | None

    def command_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.argv)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def tp_ratio_problem(p_name: str, p_tp: int, d_name: str, d_tp: int) -> str | None:
    """The seed's asymmetric-TP rule: P_tp >= D_tp and P_tp % D_tp == 0, else why not."""
    if p_tp >= d_tp and p_tp % d_tp == 0:
        return None
    return (
        f"unequal TP is accepted only when P's TP is a larger multiple of D's (P_tp >= D_tp and "
        f"P_tp % D_tp == 0): P {p_name!r} has tp={p_tp}, D {d_name!r} has tp={d_tp}"
    )


def port_conflicts(record: EngineRecord, fleet: Iterable[EngineRecord]) -> list[str]:
    """Ports ``record`` binds that another engine on the same host binds too."""
    problems = []
    for other in fleet:
        if other.name == record.name or other.host != record.host:
            continue
        for port in sorted(set(record.ports) & set(other.ports)):
            problems.append(
                f"port conflict on {record.host}: {record.name!r} binds {port} ({record.ports[port]}), "
                f"and so does {other.name!r} ({other.ports[port]})"
            )
    return problems


def _group_sizes(role: str, members: Sequence[EngineRecord]) -> tuple[dict[str, int] | None, list[str]]:
    """The one TP/DP every ``role`` engine of a group shares (the extra config has one per role)."""
    sizes = {(m.tp, m.dp) for m in members}
    if not members:
        return None, []
    if len(sizes) > 1:
        listed = ", ".join(f"{m.name!r} tp={m.tp} dp={m.dp}" for m in members)
        return None, [f"every {role} engine of a served model must have the same TP and DP (the "
                      f"connector's extra config has one size per role): {listed}"]
    tp, dp = sizes.pop()
    return {"dp_size": dp, "tp_size": tp}, []


def launch_problems(record: EngineRecord, fleet: Sequence[EngineRecord]) -> list[str]:
    """Every reason ``record`` cannot be launched on vllm-ascend, given the rest of the ``fleet``."""
    problems: list[str] = []
    if record.hardware not in ASCEND_GENERATIONS:
        problems.append(
            f"{record.name!r} is not an Ascend engine (hardware generation {record.hardware}): "
            f"vllm-ascend runs on {', '.join(sorted(ASCEND_GENERATIONS))}"
        )
    problems += port_conflicts(record, fleet)
    if record.role == "union":
        return problems
    if record.kv_connector not in ASCEND_CONNECTORS:
        problems.append(
            f"{record.name!r}: unsupported KV connector {record.kv_connector or 'none'!r} for vllm-ascend P/D; "
            f"use MooncakeConnector (pull) or MooncakeLayerwiseConnector (push)"
        )
    elif record.transfer != TRANSFER_OF[record.kv_connector]:
        problems.append(
            f"{record.name!r}: {record.kv_connector} is a {TRANSFER_OF[record.kv_connector]} connector, "
            f"not {record.transfer}"
        )
    if record.kv_port is None:
        problems.append(f"{record.name!r}: a P/D engine needs a KV port (the connector's kv_port)")
    group = [
        r for r in fleet
        if r.served_model_id == record.served_model_id and r.role in KV_ROLES and r.name != record.name
    ] + [record]
    prefills = [r for r in group if r.role == "prefill"]
    decodes = [r for r in group if r.role == "decode"]
    peers = decodes if record.role == "prefill" else prefills
    if not peers:
        problems.append(
            f"{record.name!r}: no {'decode' if record.role == 'prefill' else 'prefill'} engine of the same "
            f"served model to pair with (the connector needs both sides' TP and DP)"
        )
    for peer in peers:
        if peer.hardware != record.hardware:
            problems.append(
                f"P and D must be of one hardware generation (vllm-ascend does not support heterogeneous "
                f"P and D, e.g. P on A2 and D on A3): {record.name!r} is {record.hardware}, "
                f"{peer.name!r} is {peer.hardware}"
            )
        if peer.kv_connector != record.kv_connector or peer.transfer != record.transfer:
            problems.append(
                f"P and D must use one connector: {record.name!r} uses {record.kv_connector or 'none'} "
                f"({record.transfer}), {peer.name!r} uses {peer.kv_connector or 'none'} ({peer.transfer})"
            )
    for p in prefills:
        for d in decodes:
            if record in (p, d):
                ratio = tp_ratio_problem(p.name, p.tp, d.name, d.tp)
                if ratio:
                    problems.append(ratio)
    for role, members in (("prefill", prefills), ("decode", decodes)):
        problems += _group_sizes(role, members)[1]
    return problems


def launch_config(record: EngineRecord, fleet: Sequence[EngineRecord]) -> AscendLaunch:
    """The vllm-ascend command for ``record``; raises ``AscendConfigError`` with every DFX problem."""
    problems = launch_problems(record, fleet)
    if problems:
        raise AscendConfigError(problems)
    argv = [
        "vllm", "serve", record.model_path,
        "--host", "0.0.0.0",
        "--port", str(record.http_port),
        # The coordinator sends the served name as "model"; the engine must answer to it.
        "--served-model-name", record.served_model_name,
        "--tensor-parallel-size", str(record.tp),
        "--data-parallel-size", str(record.dp),
    ]
    if record.ep > 1:
        argv.append("--enable-expert-parallel")
    if record.max_model_len:
        argv += ["--max-model-len", str(record.max_model_len)]
    if record.tokens_only:
        # motorsite sends token ids to /inference/v1/generate; no tokenizer needed on the engine.
        argv.append("--tokens-only")
    # HCCL picks the interface whose address this is for KV traffic (the vllm-ascend tutorials);
    # it takes an IP only, so a record that names its host by name leaves it to the host's setup.
    env = {"HCCL_IF_IP": record.host} if _is_ip(record.host) else {}
    config: dict[str, Any] | None = None
    if record.role in KV_ROLES:
        group = [r for r in fleet if r.served_model_id == record.served_model_id and r.name != record.name] + [record]
        prefill, _ = _group_sizes("prefill", [r for r in group if r.role == "prefill"])
        decode, _ = _group_sizes("decode", [r for r in group if r.role == "decode"])
        config = {
            "kv_connector": ASCEND_CONNECTORS[record.kv_connector],
            "kv_role": KV_ROLES[record.role],
            # vllm-ascend's tutorials pass it as a string; KVTransferConfig coerces either.
            "kv_port": str(record.kv_port),
            "kv_connector_extra_config": {"prefill": prefill, "decode": decode},
        }
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    return AscendLaunch(argv=argv, env=env, kv_transfer_config=config)
