"""The Trigger metaserver: per-request unguessable tokens, one callback each, released once."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import AsyncClient

from serving.pipeline.topologies import metaserver as metaserver_module
from serving.pipeline.topologies.metaserver import CALLBACK_PATH, CallbackRefused, CallbackState, MetaServer

BASE = "http://127.0.0.1:8000"


def body(engine_request_id: str = "generate-tokens-r1-decode", **extra: object) -> dict[str, object]:
    return {"request_id": engine_request_id, "remote_host": "127.0.0.1", "remote_port": 9, **extra}


async def test_it_hands_each_request_its_own_url_naming_this_process() -> None:
    ms = MetaServer(BASE + "/")
    a = ms.register("r1", engine_request_id="generate-tokens-r1-decode")
    b = ms.register("r2", engine_request_id="generate-tokens-r2-decode")
    assert a.url.startswith(BASE + CALLBACK_PATH + ms.owner + ".")
    assert a.token != b.token
    # 256 random bits after the owner part.
    assert len(a.token.split(".", 1)[1]) >= 43
    assert ms.pending == 2
    a.release()
    b.release()
    assert ms.pending == 0


async def test_it_delivers_one_callback_to_the_waiting_request() -> None:
    ms = MetaServer(BASE)
    with ms.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        waiter = asyncio.create_task(reg.wait(5.0))
        # vLLM may suffix its internal id; the prefix must be the id we sent.
        assert ms.deliver(reg.token, body("generate-tokens-r1-decode-1a2b")) is reg
        assert (await waiter)["request_id"] == "generate-tokens-r1-decode-1a2b"
        assert reg.state is CallbackState.DELIVERED
    assert ms.pending == 0 and ms.delivered == 1


@pytest.mark.parametrize(
    ("token", "status"),
    [
        pytest.param(lambda reg, ms: ms.owner + ".forged-secret", 404, id="forged"),
        pytest.param(lambda reg, ms: reg.token + "x", 404, id="tampered"),
        pytest.param(lambda reg, ms: "0123456789ab." + reg.token.split(".", 1)[1], 421, id="other-process"),
        pytest.param(lambda reg, ms: "", 421, id="empty"),
    ],
)
async def test_it_refuses_forged_tokens(token: object, status: int) -> None:
    ms = MetaServer(BASE)
    with ms.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        with pytest.raises(CallbackRefused) as info:
            ms.deliver(token(reg, ms), body())  # type: ignore[operator]
        assert info.value.status == status
        assert reg.state is CallbackState.WAITING
    assert ms.pending == 0 and ms.refused == 1


async def test_it_refuses_a_replayed_callback() -> None:
    ms = MetaServer(BASE)
    with ms.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        ms.deliver(reg.token, body())
        with pytest.raises(CallbackRefused) as info:
            ms.deliver(reg.token, body())
        assert info.value.status == 409
    # Once the request ended the token is unknown: a late replay is a 404, like a forgery.
    with pytest.raises(CallbackRefused) as info:
        ms.deliver(reg.token, body())
    assert info.value.status == 404
    assert ms.delivered == 1 and ms.refused == 2


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(["not", "an", "object"], id="not-object"),
        pytest.param({"remote_host": "127.0.0.1"}, id="no-request-id"),
        pytest.param(body("generate-tokens-someone-else"), id="other-request"),
    ],
)
async def test_it_refuses_a_callback_about_another_request(payload: object) -> None:
    ms = MetaServer(BASE)
    with ms.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        with pytest.raises(CallbackRefused) as info:
            ms.deliver(reg.token, payload)
        assert info.value.status == 400
        # A bad body does not use the registration up: the genuine callback still gets through.
        ms.deliver(reg.token, body())
    assert ms.pending == 0


async def test_it_releases_exactly_once_and_wakes_no_one_after() -> None:
    ms = MetaServer(BASE)
    reg = ms.register("r1", engine_request_id="generate-tokens-r1-decode")
    waiter = asyncio.create_task(reg.wait(5.0))
    await asyncio.sleep(0)
    reg.release()
    reg.release()
    ms.release(reg)
    assert ms.pending == 0 and reg.state is CallbackState.RELEASED
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_it_times_out_waiting_without_losing_the_registration() -> None:
    ms = MetaServer(BASE)
    with ms.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        with pytest.raises(TimeoutError):
            await reg.wait(0.01)
        # The shielded future survives the timeout: a callback after it is still delivered.
        ms.deliver(reg.token, body())
        assert (await reg.wait(1.0))["remote_port"] == 9
    assert ms.pending == 0


async def test_it_delivers_from_another_thread() -> None:
    ms = MetaServer(BASE)
    with ms.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        thread = threading.Thread(target=ms.deliver, args=(reg.token, body()))
        thread.start()
        assert (await reg.wait(5.0))["request_id"] == "generate-tokens-r1-decode"
        thread.join()
    assert ms.pending == 0


# -- the Django view --------------------------------------------------------------------


@pytest.fixture
def metaserver(monkeypatch: pytest.MonkeyPatch) -> Iterator[MetaServer]:
    ms = MetaServer("http://testserver")
    monkeypatch.setattr(metaserver_module, "_process", ms)
    yield ms
    assert ms.pending == 0


async def test_the_view_accepts_the_callback_once(metaserver: MetaServer) -> None:
    client = AsyncClient()
    with metaserver.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        path = reg.url.removeprefix("http://testserver")
        first = await client.post(path, body(), content_type="application/json")
        assert first.status_code == 200, first.content
        assert first.json() == {"status": "accepted"}
        assert (await reg.wait(1.0))["remote_host"] == "127.0.0.1"
        replay = await client.post(path, body(), content_type="application/json")
        assert replay.status_code == 409
        assert replay.json()["error"]["code"] == 409


async def test_the_view_refuses_forged_and_malformed_callbacks(metaserver: MetaServer) -> None:
    client = AsyncClient()
    with metaserver.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        forged = await client.post(f"{CALLBACK_PATH}{metaserver.owner}.guess", body(), content_type="application/json")
        assert forged.status_code == 404
        path = reg.url.removeprefix("http://testserver")
        assert (await client.post(path, b"{", content_type="application/json")).status_code == 400
        assert (await client.get(path)).status_code == 405
        assert reg.state is CallbackState.WAITING


async def test_the_view_checks_the_token_before_it_parses_the_body(
    metaserver: MetaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[bytes] = []
    real_loads = json.loads

    def loads(raw: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(raw)
        return real_loads(raw, *args, **kwargs)

    monkeypatch.setattr("serving.views_internal.json.loads", loads)
    client = AsyncClient()
    with metaserver.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        forged = await client.post(f"{CALLBACK_PATH}{metaserver.owner}.guess", b"[" * 10000, content_type="application/json")
        other = await client.post(f"{CALLBACK_PATH}someone-else.x", b"{", content_type="application/json")
        assert (forged.status_code, other.status_code) == (404, 421)
        assert parsed == []  # neither body was parsed
        assert metaserver.refused == 2
        ok = await client.post(reg.url.removeprefix("http://testserver"), body(), content_type="application/json")
        assert ok.status_code == 200 and len(parsed) == 1
        assert reg.state is CallbackState.DELIVERED
