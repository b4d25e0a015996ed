"""The Trigger metaserver: per-request unguessable tokens, one callback each, released once, and a
callback that reaches another replica routed to its owner (signed token, the owner's address from
the directory, one hop)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from django.test import AsyncClient

from serving.pipeline.topologies import metaserver as metaserver_module
from serving.pipeline.topologies.metaserver import (
    CALLBACK_PATH,
    FORWARDED_HEADER,
    CallbackElsewhere,
    CallbackRefused,
    CallbackState,
    MetaServer,
)
from tests.serving.loopback import LoopbackClient

BASE = "http://127.0.0.1:8000"
OTHER = "http://127.0.0.1:8001"
KEY = b"k" * 32


def body(engine_request_id: str = "generate-tokens-r1-decode", **extra: object) -> dict[str, object]:
    return {"request_id": engine_request_id, "remote_host": "127.0.0.1", "remote_port": 9, **extra}


async def test_it_hands_each_request_its_own_url_naming_this_process() -> None:
    ms = MetaServer(BASE + "/")
    a = ms.register("r1", engine_request_id="generate-tokens-r1-decode")
    b = ms.register("r2", engine_request_id="generate-tokens-r2-decode")
    assert a.url.startswith(BASE + CALLBACK_PATH + ms.owner + ".")
    assert a.token != b.token
    # <owner>.<256 random bits>.<MAC>: no address in it.
    owner, secret, mac = a.token.split(".")
    assert owner == ms.owner and len(secret) >= 43 and len(mac) == 43
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
        # Another owner with our route, secret and MAC: the MAC no longer matches.
        pytest.param(lambda reg, ms: "0123456789ab." + reg.token.split(".", 1)[1], 404, id="other-owner-unsigned"),
        pytest.param(lambda reg, ms: "", 404, id="empty"),
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


# -- routing between replicas ------------------------------------------------------------


class Directory:
    """The control plane's directory as the metaserver sees it, in memory (``fleet.replicas`` in production)."""

    def __init__(self) -> None:
        self.addresses: dict[str, str] = {}
        self.lookups = 0

    async def advertise(self, owner: str, url: str) -> None:
        self.addresses = {o: u for o, u in self.addresses.items() if u != url}  # a restart at one address
        self.addresses[owner] = url

    async def address_of(self, owner: str) -> str | None:
        self.lookups += 1
        return self.addresses.get(owner)


async def replicas(key_b: bytes = KEY) -> tuple[MetaServer, MetaServer]:
    directory = Directory()
    a, b = MetaServer(BASE, key=KEY, directory=directory), MetaServer(OTHER, key=key_b, directory=directory)
    await a.advertise()
    await b.advertise()
    return a, b


class Recorder:
    """An owner's HTTP side: every request it receives, answered as ``answer`` says."""

    def __init__(self, answer: Any = None) -> None:
        self.seen: list[httpx.Request] = []
        self.answer = answer or (lambda request: httpx.Response(200, json={"status": "accepted"}))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        return self.answer(request)  # type: ignore[no-any-return]

    def client(self) -> LoopbackClient:
        return LoopbackClient(self)  # the production client; the owner on 127.0.0.1


async def test_it_names_the_owner_of_another_replicas_token() -> None:
    a, b = await replicas()
    with a.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        with pytest.raises(CallbackElsewhere) as info:
            b.check(reg.token)
        assert info.value.status == 421 and info.value.owner == a.owner
        # Routing is no refusal: nothing counted, and the owner still takes the callback.
        assert b.refused == 0
        a.deliver(reg.token, body())
    assert a.pending == b.pending == 0


async def test_it_routes_to_the_address_the_owner_advertised_not_the_base_url() -> None:
    # The base URL names a load balancer; what another replica posts to is the owner's own address.
    directory = Directory()
    a = MetaServer("http://lb.example", owner_url=BASE, key=KEY, directory=directory)
    b = MetaServer("http://lb.example", owner_url=OTHER, key=KEY, directory=directory)
    owner = Recorder()
    with a.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        assert reg.url.startswith("http://lb.example" + CALLBACK_PATH)
        await a.advertise()  # what the Trigger opener does before it registers
        with pytest.raises(CallbackElsewhere) as info:
            b.check(reg.token)
        async with owner.client() as client:
            await b.forward(info.value, reg.token, b"{}", client)
    assert [str(r.url) for r in owner.seen] == [BASE + CALLBACK_PATH + reg.token]


async def test_it_advertises_once_a_while_not_per_request() -> None:
    directory = Directory()
    ms = MetaServer(BASE, directory=directory)
    calls: list[str] = []
    real = directory.advertise

    async def counting(owner: str, url: str) -> None:
        calls.append(owner)
        await real(owner, url)

    directory.advertise = counting  # type: ignore[method-assign]
    for _ in range(3):
        await ms.advertise()
    assert calls == [ms.owner] and directory.addresses == {ms.owner: BASE}


async def test_a_directory_that_fails_never_fails_the_request() -> None:
    directory = Directory()
    attempts: list[str] = []

    async def down(owner: str, url: str) -> None:
        attempts.append(owner)
        raise ConnectionError("database is away")

    directory.advertise = down  # type: ignore[method-assign]
    ms = MetaServer(BASE, directory=directory)
    await ms.advertise()
    await ms.advertise()  # within the retry interval: no second attempt
    assert attempts == [ms.owner]
    with ms.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        ms.deliver(reg.token, body())  # its own callbacks still arrive


async def test_a_correctly_signed_token_of_an_owner_nobody_advertised_is_never_forwarded() -> None:
    # Signed with the shared key (leaked, or a replica's own): the owner id is all it can name,
    # and an owner the directory does not know has no address to post to.
    a, b = await replicas()
    unsigned = "0123456789ab.secret"
    token = f"{unsigned}.{a._mac(unsigned)}"
    with pytest.raises(CallbackElsewhere) as info:
        b.check(token)
    nobody = Recorder()
    async with nobody.client() as client:
        with pytest.raises(CallbackRefused) as refused:
            await b.forward(info.value, token, b"{}", client)
    assert refused.value.status == 404 and nobody.seen == [] and b.refused == 1
    assert b.forward_results == {}


@pytest.mark.parametrize(
    ("forge", "why"),
    [
        # main's token format, naming an address of the forger's choosing: not even parsed as a token.
        pytest.param(lambda t: ".".join([t[0], "aHR0cDovL2V2aWw", t[1], t[2]]), "route", id="rerouted"),
        pytest.param(lambda t: ".".join([t[0], "guess", t[2]]), "secret", id="secret"),
        pytest.param(lambda t: ".".join([t[0], t[1], "A" * 43]), "mac", id="mac"),
        # Malformed MACs: refused as unknown, never a TypeError (compare_digest and non-ASCII str).
        pytest.param(lambda t: ".".join([t[0], t[1], "é" * 43]), "non-ascii mac", id="non-ascii"),
        pytest.param(lambda t: ".".join([t[0], t[1], "\udcff"]), "lone surrogate", id="surrogate"),
        pytest.param(lambda t: ".".join([t[0], t[1], t[2][:-1]]), "short mac", id="short"),
        pytest.param(lambda t: ".".join([t[0], t[1], t[2] + "AAAA"]), "long mac", id="long"),
        pytest.param(lambda t: ".".join([t[0], t[1], "!!!!"]), "not base64", id="not-base64"),
        pytest.param(lambda t: ".".join([t[0], t[1], ""]), "no mac", id="empty"),
    ],
)
async def test_it_never_forwards_a_forged_token(forge: Any, why: str) -> None:
    a, b = await replicas()
    with a.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        with pytest.raises(CallbackRefused) as info:
            b.check(forge(reg.token.split(".")))
        assert not isinstance(info.value, CallbackElsewhere), why
        assert info.value.status == 404 and b.refused == 1


async def test_it_cannot_route_without_the_shared_key() -> None:
    a, b = await replicas(key_b=b"x" * 32)
    with a.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        with pytest.raises(CallbackRefused) as info:
            b.deliver(reg.token, body())
        assert not isinstance(info.value, CallbackElsewhere) and info.value.status == 404


async def test_it_forwards_a_callback_at_most_once() -> None:
    a, b = await replicas()
    with a.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        # A forwarded callback that lands on a non-owner (a stale entry) is not passed on again.
        with pytest.raises(CallbackRefused) as info:
            b.check(reg.token, forwarded=True)
        assert not isinstance(info.value, CallbackElsewhere) and info.value.status == 404


async def test_it_refuses_a_token_of_the_process_that_ran_here_before() -> None:
    a, other = await replicas()
    with a.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        restarted = MetaServer(BASE, key=KEY, directory=a.directory)  # same address and key, new process
        await restarted.advertise()  # takes the address over from the process before it
        for replica in (restarted, other):
            with pytest.raises(CallbackElsewhere) as info:
                replica.check(reg.token)
            nobody = Recorder()
            async with nobody.client() as client:
                with pytest.raises(CallbackRefused) as refused:
                    await replica.forward(info.value, reg.token, b"{}", client)
            assert refused.value.status == 404 and nobody.seen == []


async def test_it_answers_503_while_the_directory_cannot_be_read() -> None:
    a, b = await replicas()

    async def down(owner: str) -> str | None:
        raise ConnectionError("database is away")

    b.directory.address_of = down  # type: ignore[union-attr, method-assign]
    with a.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        with pytest.raises(CallbackElsewhere) as info:
            b.check(reg.token)
        nobody = Recorder()
        async with nobody.client() as client:
            with pytest.raises(CallbackRefused) as refused:
                await b.forward(info.value, reg.token, b"{}", client)
    assert refused.value.status == 503 and nobody.seen == []


async def test_it_forwards_the_body_unchanged_and_returns_the_owners_answer() -> None:
    a, b = await replicas()

    def answer(request: httpx.Request) -> httpx.Response:
        token = request.url.path.removeprefix(CALLBACK_PATH)
        reg = a.deliver(token, json.loads(request.content), forwarded=request.headers.get(FORWARDED_HEADER) == "1")
        return httpx.Response(200, json={"status": "accepted", "request": reg.request_id})

    owner = Recorder(answer)
    with a.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        raw = json.dumps(body(remote_cached_tokens=3)).encode()
        with pytest.raises(CallbackElsewhere) as info:
            b.check(reg.token)
        async with owner.client() as client:
            answer_ = await b.forward(info.value, reg.token, raw, client)
        assert answer_.status_code == 200 and answer_.json()["request"] == "r1"
        assert str(owner.seen[0].url) == reg.url  # the owner's own address
        assert owner.seen[0].content == raw and owner.seen[0].headers[FORWARDED_HEADER] == "1"
        assert (await reg.wait(1.0))["remote_cached_tokens"] == 3
    assert (a.delivered, b.forwarded, b.refused) == (1, 1, 0)
    assert b.forward_results == {"accepted": 1}  # motor_trigger_callbacks_total{result}


async def test_it_answers_502_when_the_owner_is_unreachable() -> None:
    a, b = await replicas()

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with a.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        with pytest.raises(CallbackElsewhere) as info:
            b.check(reg.token)
        async with LoopbackClient(down) as client:  # the owner resets the connection
            with pytest.raises(CallbackRefused) as refused:
                await b.forward(info.value, reg.token, b"{}", client)
        assert refused.value.status == 502 and b.forwarded == 0 and b.refused == 1
        assert b.forward_results == {"unreachable": 1}


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
        other = await client.post(f"{CALLBACK_PATH}someone-else.x.y", b"{", content_type="application/json")
        assert (forged.status_code, other.status_code) == (404, 404)
        assert parsed == []  # neither body was parsed
        assert metaserver.refused == 2
        ok = await client.post(reg.url.removeprefix("http://testserver"), body(), content_type="application/json")
        assert ok.status_code == 200 and len(parsed) == 1
        assert reg.state is CallbackState.DELIVERED


async def test_the_view_forwards_another_replicas_callback_to_its_owner(
    metaserver: MetaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The view under test is replica B (``metaserver``); the owner A answers through a mock
    # transport that hands the forwarded request to A's registry.
    directory = Directory()
    b = MetaServer("http://testserver", key=KEY, directory=directory)
    monkeypatch.setattr(metaserver_module, "_process", b)
    a = MetaServer(OTHER, key=KEY, directory=directory)
    await a.advertise()
    forwarded: list[httpx.Request] = []

    def owner(request: httpx.Request) -> httpx.Response:
        forwarded.append(request)
        try:
            a.deliver(request.url.path.removeprefix(CALLBACK_PATH), json.loads(request.content), forwarded=True)
        except CallbackRefused as exc:  # what A's own view answers
            return httpx.Response(exc.status, json={"error": {"message": exc.message, "code": exc.status}})
        return httpx.Response(200, json={"status": "accepted"})

    mock = LoopbackClient(owner)  # the production client; the owner on 127.0.0.1
    monkeypatch.setattr("serving.views_internal.http.shared_client", lambda: mock)
    client = AsyncClient()
    with a.register("r1", engine_request_id="generate-tokens-r1-decode") as reg:
        path = reg.url.removeprefix(OTHER)
        answer = await client.post(path, body(), content_type="application/json")
        assert answer.status_code == 200 and answer.json() == {"status": "accepted"}
        assert str(forwarded[0].url) == reg.url
        assert (await reg.wait(1.0))["remote_host"] == "127.0.0.1"
        # A forwarded callback reaching a non-owner is refused, not forwarded again.
        again = await client.post(path, body(), content_type="application/json", headers={FORWARDED_HEADER: "1"})
        assert again.status_code == 404 and len(forwarded) == 1
        # A replay reaches B again and is forwarded; the owner refuses it (409), and B counts that.
        replay = await client.post(path, body(), content_type="application/json")
        assert replay.status_code == 409 and len(forwarded) == 2
    await mock.aclose()
    assert b.forward_results == {"accepted": 1, "refused": 1}
    assert a.pending == b.pending == 0
