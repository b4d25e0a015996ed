"""Live config: the request path makes no query per request, and an API edit reaches traffic
within one poll interval (time is driven through ``snapshots.clock``, never slept)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.db import OperationalError
from django.db.backends import utils as db_utils

from catalog.models import RenderConfig, ServedModel
from fleet import services
from fleet.models import EngineInstance
from serving import runtime, snapshots
from tests.serving.fakes import ENGINE_URLS, MODEL, FakeUpstreams
from tests.serving.loopback import LoopbackClient

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def clock(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    settings.MOTOR_API_KEYS = []
    settings.MOTOR_OPEN_ACCESS = True  # open unless a test closes it
    settings.MOTOR_SNAPSHOT_POLL_S = 0.25
    c = Clock()
    monkeypatch.setattr(snapshots, "clock", c)
    snapshots.invalidate()
    yield c
    snapshots.invalidate()
    assert runtime.load.snapshot() == {}


@pytest.fixture
def queries(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every SQL statement any thread runs (``django_assert_num_queries`` sees one connection only)."""
    seen: list[str] = []
    original: Callable[..., Any] = db_utils.CursorWrapper.execute

    def execute(self: Any, sql: str, params: Any = None) -> Any:
        seen.append(sql)
        return original(self, sql, params)

    monkeypatch.setattr(db_utils.CursorWrapper, "execute", execute)
    return seen


@pytest.fixture
def fleet(transactional_db: None) -> dict[str, EngineInstance]:
    model = ServedModel.objects.create(name=MODEL, model_path="/models/tiny", max_model_len=2048, vocab_size=151936)
    RenderConfig.objects.create(host="render.test", port=8100, timeout_ms=5000)
    return {
        name: services.instance_create(actor="t", name=name, url=url, served_model_id=model.id)
        for name, url in ENGINE_URLS.items()
    }


@pytest.fixture
def upstream(
    fleet: dict[str, EngineInstance], upstreams: FakeUpstreams, mock_client: LoopbackClient,
    monkeypatch: pytest.MonkeyPatch,
) -> FakeUpstreams:
    monkeypatch.setattr("serving.pipeline.http.shared_client", lambda: mock_client)
    return upstreams


async def chat(client: httpx.AsyncClient, **headers: str) -> Any:
    return await client.post("/v1/chat/completions", json=CHAT, headers=headers)


async def test_a_served_request_makes_zero_queries_after_warm_up(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, queries: list[str], django_assert_num_queries: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # django_assert_num_queries opens the test connection from this (async) context; allow it.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    assert (await chat(v1)).status_code == 200  # warm-up builds the snapshot
    queries.clear()
    with django_assert_num_queries(0):
        response = await chat(v1)
    assert response.status_code == 200
    assert queries == []  # no thread queried either


async def test_one_poll_interval_later_a_single_cheap_query_checks_the_version(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, queries: list[str], clock: Clock,
) -> None:
    await chat(v1)
    queries.clear()
    clock.now += 0.25
    assert (await chat(v1)).status_code == 200
    assert len(queries) == 1 and "fleet_controlversion" in queries[0]  # unchanged: no rebuild


async def test_after_a_drain_through_the_api_returns_requests_avoid_the_instance(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, fleet: dict[str, EngineInstance], clock: Clock,
) -> None:
    _, key = await sync_to_async(services.api_key_create)(name="ops", scope="admin")
    assert (await chat(v1)).status_code == 200
    assert [c.host for c in upstream.calls_of("generate")] == ["e1"]  # idle fleet: the first instance

    drained = await v1.post(f"/api/instances/{fleet['e1'].id}/drain", headers={"Authorization": f"Bearer {key}"})
    assert drained.status_code == 200 and drained.json()["state"] == "draining"
    clock.now += 0.25  # at most one poll interval later
    upstream.calls.clear()
    for _ in range(4):
        assert (await chat(v1)).status_code == 200
    assert {c.host for c in upstream.calls_of("generate")} == {"e2"}


async def test_client_keys_come_from_the_snapshot_hashed(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, settings: Any, clock: Clock,
) -> None:
    settings.MOTOR_OPEN_ACCESS = False
    settings.MOTOR_API_KEYS = ["sk-env"]  # ignored once a key record exists
    record, key = await sync_to_async(services.api_key_create)(name="app", scope="client", tokens_per_minute=600)
    snapshot = await snapshots.current_snapshot()
    assert key not in snapshot.client_keys and len(next(iter(snapshot.client_keys))) == 64
    assert next(iter(snapshot.client_keys.values())).tokens_per_minute == 600

    assert (await chat(v1, Authorization=f"Bearer {key}")).status_code == 200
    assert (await chat(v1, Authorization="Bearer sk-env")).status_code == 401
    _, admin = await sync_to_async(services.api_key_create)(name="ops", scope="admin")
    assert (await chat(v1, Authorization=f"Bearer {admin}")).status_code == 401  # admin keys are not for /v1

    await sync_to_async(services.api_key_revoke)(ids=[record.id])
    clock.now += 0.25
    # Revoking the last client key keeps /v1 closed; it does not fall back to the environment.
    assert (await chat(v1, Authorization=f"Bearer {key}")).status_code == 401
    assert (await chat(v1, Authorization="Bearer sk-env")).status_code == 401


async def test_without_key_records_the_environment_keys_apply(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, settings: Any,
) -> None:
    settings.MOTOR_OPEN_ACCESS = False
    settings.MOTOR_API_KEYS = ["sk-env"]
    assert (await chat(v1, Authorization="Bearer sk-env")).status_code == 200
    assert (await chat(v1)).status_code == 401


def test_the_snapshot_carries_breaker_health_and_render_fields(fleet: dict[str, EngineInstance]) -> None:
    e1 = fleet["e1"]
    services.breaker_force_open(instance_id=e1.id, actor="t", seconds=10)
    EngineInstance.objects.filter(id=e1.id).update(health="failing", kv_connector="NixlConnector", tp=2)
    RenderConfig.objects.update(streaming_derender=False, context_budget=True)
    snap = snapshots.build_snapshot()
    view = next(i for i in snap.instances if i.name == "e1")
    assert (view.breaker_state, view.breaker_epoch, view.healthy, view.kv_connector, view.tp) == ("open", 1, False, "NixlConnector", 2)
    assert snap.render.streaming_derender is False and snap.render.context_budget is True
    assert snap.version == services.read_control_version()


class DatabaseAway:
    """``read_control_version`` as it fails while the database is unreachable; counts the attempts."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        raise OperationalError("could not connect to server: Connection refused")


async def test_a_database_outage_keeps_the_last_snapshot_serving_and_logs_once(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, clock: Clock, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert (await chat(v1)).status_code == 200
    before = await snapshots.current_snapshot()
    away = DatabaseAway()
    monkeypatch.setattr(snapshots, "read_control_version", away)
    caplog.set_level(logging.WARNING, logger="serving.snapshots")
    upstream.calls.clear()
    for _ in range(3):  # three poll intervals of outage, a TTL rebuild due on the way
        clock.now += 0.25
        response = await chat(v1)
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
    clock.now += 0.1  # within the interval after a failed check: no retry on every request
    assert (await chat(v1)).status_code == 200
    assert away.calls == 3
    assert len(upstream.calls_of("generate")) == 4  # served from the last snapshot throughout
    assert await snapshots.current_snapshot() is before
    failed = [r for r in caplog.records if "snapshot poll failed" in r.getMessage()]
    assert len(failed) == 1 and "OperationalError" in failed[0].getMessage()

    monkeypatch.setattr(snapshots, "read_control_version", services.read_control_version)  # it is back
    clock.now += 0.25
    assert (await chat(v1)).status_code == 200
    assert [r.getMessage() for r in caplog.records if "recovered" in r.getMessage()] == [
        f"snapshot poll recovered version={before.version}"
    ]


async def test_without_any_snapshot_a_database_outage_is_a_503_not_a_500(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(snapshots, "read_control_version", DatabaseAway())
    response = await chat(v1)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and "connect" not in error["message"]
    assert upstream.calls == []


def test_the_snapshot_names_the_pull_connector_an_ascend_engine_runs(fleet: dict[str, EngineInstance]) -> None:
    # The record's "MooncakeConnector" is vllm-ascend's MooncakeConnectorV1 on Ascend (P returns
    # D's params) and upstream vLLM's MooncakeConnector elsewhere (the router supplies them).
    EngineInstance.objects.filter(name="e1").update(kv_connector="MooncakeConnector", hardware_kind="A3", kv_port=36000)
    EngineInstance.objects.filter(name="e2").update(kv_connector="MooncakeConnector", hardware_kind="cuda")
    views = {i.name: i for i in snapshots.build_snapshot().instances}
    assert (views["e1"].kv_connector, views["e1"].kv_port) == ("MooncakeConnectorV1", 36000)
    assert (views["e2"].kv_connector, views["e2"].kv_port) == ("MooncakeConnector", None)


async def test_without_any_snapshot_a_database_outage_makes_healthz_503_with_a_reason(
    v1: httpx.AsyncClient, upstream: FakeUpstreams, monkeypatch: pytest.MonkeyPatch,
) -> None:
    away = DatabaseAway()
    monkeypatch.setattr(snapshots, "read_control_version", away)
    response = await v1.get("/healthz")
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["status"] == "unavailable" and "configuration" in body["reason"]
    assert "connect" not in response.text  # the database error is logged, not returned
    assert away.calls == 1 and upstream.calls == []

    monkeypatch.setattr(snapshots, "read_control_version", services.read_control_version)  # it is back
    response = await v1.get("/healthz")
    assert response.status_code == 200 and response.json()["status"] == "ok"
