"""vllm-ascend launch arguments from an instance's record, and the P/D seed's DFX rules on them.

The expected ``--kv-transfer-config`` follows vllm-ascend 0.23.0.post1: connector names from
``vllm_ascend/distributed/kv_transfer/__init__.py`` (pull is registered as ``MooncakeConnectorV1``),
the ``kv_connector_extra_config`` sizes asserted by ``MooncakeConnectorWorker._get_prefill_decode_size``
(``kv_p2p/mooncake_connector.py``), and the shape of ``docs/source/tutorials/features/
pd_disaggregation_mooncake_multi_node.md`` (see ``docs/ascend-connectors.md``).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import json
from typing import Any

import pytest
from django.apps import apps
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client

from catalog.models import ServedModel
from fleet import services
from fleet.ascend import AscendConfigError, EngineRecord, launch_config, launch_problems
from fleet.models import EngineInstance, InstanceEvent


def rec(name: str, role: str, **kw: Any) -> EngineRecord:
    fields: dict[str, Any] = dict(
        name=name, role=role, served_model_id=1, served_model_name="ds", model_path="/models/ds", hardware="A3",
        kv_connector="MooncakeConnector", kv_transfer="", host=f"{name}.npu", http_port=8000, kv_port=36000,
        tp=1, dp=1, max_model_len=4096,
    )
    fields.update(kw)
    record = EngineRecord(**fields)
    ports = {record.http_port: "HTTP"}
    if record.kv_port is not None:
        ports.update({record.kv_port + k: "KV handshake" for k in range(record.dp * record.tp)})
    return dataclasses.replace(record, ports=kw.get("ports", ports))


def test_it_builds_the_pull_pair_as_vllm_ascend_expects() -> None:
    p, d = rec("p1", "prefill", tp=8, dp=2), rec("d1", "decode", tp=1, dp=32)
    launch = launch_config(p, [d])
    assert launch.kv_transfer_config == {
        "kv_connector": "MooncakeConnectorV1",  # vllm-ascend's name for its pull MooncakeConnector
        "kv_role": "kv_producer",
        "kv_port": "36000",
        "kv_connector_extra_config": {"prefill": {"dp_size": 2, "tp_size": 8}, "decode": {"dp_size": 32, "tp_size": 1}},
    }
    assert launch.argv[:3] == ["vllm", "serve", "/models/ds"]
    flags = dict(zip(launch.argv[3::2], launch.argv[4::2], strict=False))
    assert flags["--port"] == "8000" and flags["--tensor-parallel-size"] == "8" and flags["--data-parallel-size"] == "2"
    assert flags["--served-model-name"] == "ds" and flags["--max-model-len"] == "4096"
    assert "--tokens-only" in launch.argv
    assert json.loads(launch.argv[launch.argv.index("--kv-transfer-config") + 1]) == launch.kv_transfer_config
    assert launch.env == {}  # HCCL_IF_IP takes an address; p1.npu is a name
    decode = launch_config(d, [p]).kv_transfer_config
    assert decode is not None and decode["kv_role"] == "kv_consumer"
    assert decode["kv_connector_extra_config"] == launch.kv_transfer_config["kv_connector_extra_config"]


def test_it_builds_the_push_pair_with_the_layerwise_connector() -> None:
    p = rec("p1", "prefill", kv_connector="MooncakeLayerwiseConnector")
    d = rec("d1", "decode", kv_connector="MooncakeLayerwiseConnector", kv_port=36200)
    config = launch_config(d, [p]).kv_transfer_config
    assert config is not None
    assert (config["kv_connector"], config["kv_role"], config["kv_port"]) == ("MooncakeLayerwiseConnector", "kv_consumer", "36200")


def test_a_union_engine_gets_no_kv_transfer_config() -> None:
    launch = launch_config(rec("u1", "union", kv_connector="", kv_port=None), [])
    assert launch.kv_transfer_config is None and "--kv-transfer-config" not in launch.argv


def test_the_command_line_is_shell_quoted() -> None:
    line = launch_config(rec("p1", "prefill", host="192.0.0.1"), [rec("d1", "decode")]).command_line()
    assert line.startswith("HCCL_IF_IP=192.0.0.1 vllm serve /models/ds ")
    assert "'{\"kv_connector\":\"MooncakeConnectorV1\"" in line


@pytest.mark.parametrize(
    ("record", "fleet", "problem"),
    [
        (rec("p", "prefill", hardware="cpu"), [rec("d", "decode", hardware="cpu")], "not an Ascend engine (hardware generation cpu)"),
        (rec("p", "prefill", kv_connector="NixlConnector"), [rec("d", "decode")], "unsupported KV connector 'NixlConnector'"),
        (rec("p", "prefill", kv_connector=""), [rec("d", "decode")], "unsupported KV connector 'none'"),
        (rec("p", "prefill", kv_transfer="push"), [rec("d", "decode")], "MooncakeConnector is a pull connector, not push"),
        (rec("p", "prefill"), [rec("d", "decode", kv_connector="MooncakeLayerwiseConnector")], "P and D must use one connector"),
        (rec("p", "prefill", kv_port=None), [rec("d", "decode")], "needs a KV port"),
        (rec("p", "prefill"), [], "no decode engine of the same served model"),
        (rec("p", "prefill"), [rec("d", "decode", served_model_id=2)], "no decode engine"),
        (rec("p", "prefill", hardware="A2"), [rec("d", "decode", hardware="A3")], "'p' is A2, 'd' is A3"),
        (rec("p", "prefill", tp=2), [rec("d", "decode", tp=4)], "P_tp >= D_tp and P_tp % D_tp == 0"),
        (rec("p", "prefill", tp=6), [rec("d", "decode", tp=4)], "P 'p' has tp=6, D 'd' has tp=4"),
        (rec("p", "prefill"), [rec("p2", "prefill", tp=2), rec("d", "decode")], "every prefill engine of a served model must have the same TP"),
        # Ports: the same host binds the HTTP port twice, or one engine's KV range covers another's.
        (rec("p", "prefill", host="n1"), [rec("d", "decode", host="n1", kv_port=36100)], "port conflict on n1: 'p' binds 8000 (HTTP)"),
        (rec("p", "prefill", host="n1", tp=4), [rec("d", "decode", host="n1", http_port=8001, kv_port=36002)], "binds 36002 (KV handshake)"),
        (rec("u", "union", host="n1", http_port=36000, kv_connector="", kv_port=None), [rec("d", "decode", host="n1", http_port=1)], "binds 36000 (HTTP), and so does 'd' (KV handshake)"),
    ],
)
def test_it_applies_the_dfx_rules_by_table(record: EngineRecord, fleet: list[EngineRecord], problem: str) -> None:
    problems = launch_problems(record, fleet)
    assert any(problem in text for text in problems), problems
    with pytest.raises(AscendConfigError) as exc:
        launch_config(record, fleet)
    assert exc.value.problems == problems


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (4, 2), (8, 1), (8, 8)])
def test_it_accepts_p_tp_that_is_a_multiple_of_d_tp(p_tp: int, d_tp: int) -> None:
    assert launch_problems(rec("p", "prefill", tp=p_tp), [rec("d", "decode", tp=d_tp)]) == []


def test_the_same_ports_on_two_hosts_do_not_conflict() -> None:
    assert launch_problems(rec("p", "prefill", host="n1"), [rec("d", "decode", host="n2")]) == []


# -- the database side: records, migration, services, admin, command, API ---------------------


@pytest.fixture
def ascend_pair(served_model: ServedModel) -> tuple[EngineInstance, EngineInstance]:
    common = dict(actor="t", served_model_id=served_model.id, hardware_kind="A3", kv_connector="MooncakeConnector")
    p = services.instance_create(name="p1", url="http://10.0.0.1:8100", role="prefill", kv_port=36000, tp=2, **common)
    d = services.instance_create(name="d1", url="http://10.0.0.2:8200", role="decode", kv_port=36200, **common)
    return p, d


def test_an_instance_record_becomes_its_launch(ascend_pair: tuple[EngineInstance, EngineInstance]) -> None:
    p, _ = ascend_pair
    launch = services.instance_ascend_launch(instance=p)
    assert launch.argv[2] == "/models/tiny" and "--port" in launch.argv and launch.argv[launch.argv.index("--port") + 1] == "8100"
    assert launch.kv_transfer_config is not None
    assert launch.kv_transfer_config["kv_connector_extra_config"] == {"prefill": {"dp_size": 1, "tp_size": 2}, "decode": {"dp_size": 1, "tp_size": 1}}
    assert p.bound_ports() == {8100: "HTTP", 36000: "KV handshake", 36001: "KV handshake"}


def test_a_kv_port_range_taken_on_the_host_is_refused(ascend_pair: tuple[EngineInstance, EngineInstance], served_model: ServedModel) -> None:
    with pytest.raises(services.InvalidError, match="port conflict on 10.0.0.1: 'p2' binds 36001"):
        services.instance_create(
            actor="t", name="p2", url="http://10.0.0.1:8101", role="prefill", served_model_id=served_model.id,
            hardware_kind="A3", kv_connector="MooncakeConnector", kv_port=36001, tp=2,
        )
    assert not EngineInstance.objects.filter(name="p2").exists()


def test_a_kv_port_range_past_65535_is_refused_at_once(ascend_pair: tuple[EngineInstance, EngineInstance], served_model: ServedModel) -> None:
    # The schema allows TP and DP up to 2**31 - 1 each: the range check must not walk their product
    # (the REST API's fuzz found a PATCH that held its request thread for minutes).
    p, _ = ascend_pair
    with pytest.raises(services.InvalidError, match="needs KV handshake ports up to 4611686014132456608, past 65535"):
        services.instance_update(instance_id=p.id, actor="t", tp=2**31 - 1, dp=2**31 - 1)
    with pytest.raises(services.InvalidError, match="up to 65536, past 65535"):
        services.instance_update(instance_id=p.id, actor="t", kv_port=65535, tp=2, dp=1)
    p.refresh_from_db()
    assert (p.kv_port, p.tp, p.dp) == (36000, 2, 1)
    p.kv_port, p.tp, p.dp = 65530, 2**31 - 1, 2**31 - 1
    assert sorted(p.bound_ports()) == [8100, 65530, 65531, 65532, 65533, 65534, 65535]


def test_a_pair_across_generations_is_refused_with_the_reason(ascend_pair: tuple[EngineInstance, EngineInstance], served_model: ServedModel) -> None:
    with pytest.raises(services.InvalidError, match="same hardware generation: 'd2' is A2, 'p1' is A3"):
        services.instance_create(
            actor="t", name="d2", url="http://10.0.0.3:8200", role="decode", served_model_id=served_model.id,
            hardware_kind="A2", kv_connector="MooncakeConnector", kv_port=36200,
        )


def test_the_migration_maps_free_text_hardware_to_a_generation(served_model: ServedModel) -> None:
    migration = importlib.import_module("fleet.migrations.0004_hardware_generation")
    rows = {}
    for n, text in enumerate(["cpu", "CUDA", "npu", "910C", "Ascend-A2", "tpu-v5"]):
        rows[text] = services.instance_create(actor="t", name=f"e{n}", url=f"http://e{n}.test:1", served_model_id=served_model.id)
        EngineInstance.objects.filter(id=rows[text].id).update(hardware_kind=text)  # as 0003 allowed: free text
    migration.forwards(apps, None)
    got = {text: EngineInstance.objects.get(id=i.id).hardware_kind for text, i in rows.items()}
    assert got == {"cpu": "cpu", "CUDA": "cuda", "npu": "A2", "910C": "A3", "Ascend-A2": "A2", "tpu-v5": "cpu"}
    # A guess is written down for the operator; a change of case alone is not.
    guessed = dict(InstanceEvent.objects.filter(kind="hardware").values_list("old", "new"))
    assert guessed == {"npu": "A2", "910C": "A3", "Ascend-A2": "A2", "tpu-v5": "cpu"}


def test_the_command_prints_the_launch_and_fails_on_a_broken_record(ascend_pair: tuple[EngineInstance, EngineInstance]) -> None:
    out = io.StringIO()
    call_command("ascend_args", stdout=out)
    text = out.getvalue()
    assert "# d1 (decode, Ascend A3" in text and "# p1 (prefill" in text
    assert '"kv_connector": "MooncakeConnectorV1"' in text and "HCCL_IF_IP=10.0.0.1 vllm serve /models/tiny" in text
    EngineInstance.objects.filter(name="d1").update(tp=4)  # written around the services: P_tp 2 < D_tp 4
    out = io.StringIO()
    with pytest.raises(CommandError, match="2 instance\\(s\\) cannot be launched"):
        call_command("ascend_args", "p1", "d1", stdout=out)
    assert "cannot launch: unequal TP" in out.getvalue()
    with pytest.raises(CommandError, match="No engine instance named nope"):
        call_command("ascend_args", "nope")


def test_the_admin_shows_the_launch_readonly(client: Client, ascend_pair: tuple[EngineInstance, EngineInstance]) -> None:
    client.force_login(User.objects.create(username="admin", is_staff=True, is_superuser=True))
    page = client.get(f"/admin/fleet/engineinstance/{ascend_pair[0].id}/change/").content.decode()
    assert "Vllm-ascend command" in page and "MooncakeConnectorV1" in page and 'name="ascend_launch"' not in page


def test_the_api_gives_the_launch_or_every_problem(client: Client, ascend_pair: tuple[EngineInstance, EngineInstance]) -> None:
    _, key = services.api_key_create(name="ops", scope="admin")
    auth = {"HTTP_AUTHORIZATION": f"Bearer {key}"}
    body = client.get(f"/api/instances/{ascend_pair[1].id}/ascend-launch", **auth).json()
    assert body["kv_transfer_config"]["kv_role"] == "kv_consumer" and body["command_line"].startswith("HCCL_IF_IP=10.0.0.2 ")
    EngineInstance.objects.filter(name="p1").update(hardware_kind="cpu")
    response = client.get(f"/api/instances/{ascend_pair[1].id}/ascend-launch", **auth)
    assert response.status_code == 422 and "'d1' is A3, 'p1' is cpu" in response.json()["detail"]
    refused = client.post("/api/instances", {"name": "x", "url": "http://x:1", "served_model_id": ascend_pair[0].served_model_id,
                                             "hardware_kind": "npu"}, content_type="application/json", **auth)
    assert refused.status_code == 422
