"""One shared upstream client per event loop, with explicit timeouts.

The client is ``http11.Http11Client`` (the sidecar and the engines are our own uvicorn servers;
see that module for why not httpx). Its connections are bound to the loop they were opened on;
Daphne runs one loop per process, tests run one per test, so the client is kept per loop and
closed with it. Callers accept an ``httpx.AsyncClient`` as well (``Upstream``): the tests hand
them ``httpx.MockTransport`` clients.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import Union

import httpx

from serving.pipeline.http11 import MAX_REPLY_BYTES, Http11Client

Upstream = Union[Http11Client, httpx.AsyncClient]


@dataclass(frozen=True, slots=True)
class HttpSettings:
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 60.0  # per SSE event for streams, whole reply otherwise
    idle_per_upstream: int = 64  # keep-alive connections kept open to each sidecar or engine
    max_reply_bytes: int = MAX_REPLY_BYTES  # the largest reply read whole


_clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Http11Client]" = weakref.WeakKeyDictionary()
_settings = HttpSettings()


def configure(settings: HttpSettings) -> None:
    global _settings
    _settings = settings


def shared_client() -> Upstream:
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None or client.is_closed:
        s = _settings
        client = Http11Client(
            httpx.Timeout(s.read_timeout_s, connect=s.connect_timeout_s),
            idle_per_origin=s.idle_per_upstream,
            max_reply_bytes=s.max_reply_bytes,
        )
        _clients[loop] = client
    return client
