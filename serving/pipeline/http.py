"""One shared ``httpx.AsyncClient`` per event loop, with explicit limits and timeouts.

A client is bound to the loop it was first used on; Daphne runs one loop per process, tests
run one per test, so the client is kept per loop and closed with it.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class HttpSettings:
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 60.0  # per chunk for streams, whole reply otherwise
    max_connections: int = 512


_clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient]" = weakref.WeakKeyDictionary()
_settings = HttpSettings()


def configure(settings: HttpSettings) -> None:
    global _settings
    _settings = settings


def shared_client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None or client.is_closed:
        s = _settings
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(s.read_timeout_s, connect=s.connect_timeout_s, pool=s.connect_timeout_s),
            limits=httpx.Limits(max_connections=s.max_connections, max_keepalive_connections=s.max_connections),
            # Engines and the sidecar are on our own network; never pick up a proxy from the environment.
            trust_env=False,
        )
        _clients[loop] = client
    return client
