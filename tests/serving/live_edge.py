"""The whole ASGI application (``motorsite.asgi``) behind a real server on a 127.0.0.1 socket, in
the test process: Daphne (the default server, as ``make run`` starts it) and uvicorn (the option).

Requests cross a real socket and the server's own HTTP parser, as a client's do; the upstreams
stay the in-process fakes (``serving.pipeline.http.shared_client`` monkeypatched), so a test reads
admission, load and the tokens-per-minute windows directly for its leak checks.

Daphne runs its Twisted reactor in one thread for the session (a reactor cannot start twice);
uvicorn runs on the test's own event loop, started and stopped per test.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

SERVERS = ("daphne", "uvicorn")


class DaphneThread:
    """Daphne serving the application on an ephemeral port of 127.0.0.1, in a daemon thread."""

    def __init__(self) -> None:
        from daphne.server import Server  # installs Twisted's asyncio reactor on import

        from motorsite.asgi import application

        self.server = Server(
            application, endpoints=["tcp:port=0:interface=127.0.0.1"], signal_handlers=False, verbosity=0,
        )
        self.thread = threading.Thread(target=self.server.run, name="daphne", daemon=True)

    def start(self) -> str:
        self.thread.start()
        listening = threading.Event()
        for _ in range(500):  # the listen completes on the reactor's first turns
            if self.server.listening_addresses:
                host, port = self.server.listening_addresses[0]
                return f"http://{host}:{port}"
            listening.wait(0.01)
        raise RuntimeError("Daphne did not start listening")

    def stop(self) -> None:
        from twisted.internet import reactor

        reactor.callFromThread(self.server.stop)  # type: ignore[attr-defined]
        self.thread.join(10)


@pytest.fixture(scope="session")
def _daphne() -> Iterator[str]:
    daphne = DaphneThread()
    url = daphne.start()
    yield url
    daphne.stop()


@asynccontextmanager
async def uvicorn_server() -> AsyncIterator[str]:
    """uvicorn on this event loop, on a socket of its own; stopped (connections closed) on exit."""
    import uvicorn

    from motorsite.asgi import application

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # lifespan off: Channels' router has no lifespan handler (as ``make run`` starts it).
    server = uvicorn.Server(uvicorn.Config(application, lifespan="off", log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if task.done():
                    task.result()  # a failed start raises here
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest.fixture(params=SERVERS)
async def served(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """The base URL of the application behind each real server in turn."""
    if request.param == "daphne":
        yield request.getfixturevalue("_daphne")
        return
    async with uvicorn_server() as url:
        yield url


def error_of(response: Any, status: int) -> dict[str, Any]:
    """The OpenAI error object of ``response``, checked for shape and ``status``; on
    ``/v1/messages`` Anthropic's (``type`` by status, no ``param``: vLLM 0.33's shape there),
    returned as an OpenAI one with ``param`` None."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    if response.request.url.path == "/v1/messages":
        assert body["type"] == "error" and set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}
        return {**body["error"], "param": None, "code": status}
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    return dict(body["error"])
