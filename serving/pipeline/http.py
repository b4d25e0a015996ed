"""One shared upstream client per event loop, with explicit timeouts.

The client is ``http11.Http11Client`` (the sidecar and the engines are our own uvicorn servers;
see that module for why not httpx). Its connections are bound to the loop they were opened on;
Daphne runs one loop per process, tests run one per test, so the client is kept per loop and
closed with it. The callers take an ``Http11Client`` only: the component tests drive this same
client over 127.0.0.1 (``tests/serving/loopback.py``). httpx stays for ``httpx.Timeout`` and the
exception classes the client raises (``http11.py`` says why).
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass

import httpx

from serving.pipeline.http11 import MAX_REPLY_BYTES, Http11Client


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


def shared_client() -> Http11Client:
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
