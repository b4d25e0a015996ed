"""httpx calls to a server on a unix socket, addressed as the data plane addresses it.

A render sidecar on the coordinator's machine may listen on a unix socket (``vllm launch render
--uds PATH``); the data plane calls it at ``http+unix://`` and the socket's path percent-encoded
(``serving.pipeline.http11.unix_base_url``, ``catalog.sidecar_addresses.base_url``). httpx has no
such scheme: it takes the socket as its transport's ``uds`` and an ordinary ``http://`` URL, and
it lowercases a URL's host, so the path cannot ride in one. The probes and the supervisor's
readiness checks go through ``reach``, which gives them a client and a base URL either way.
Django-free and httpx-only, like ``motorsite.processes``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import quote, unquote, urlsplit

import httpx

UNIX_SCHEME = "http+unix"
# Linux's sun_path holds 108 bytes, the closing NUL included.
UNIX_PATH_MAX = 107


def base_url(path: str) -> str:
    """``http+unix://`` and ``path`` percent-encoded: the server on that unix socket."""
    return f"{UNIX_SCHEME}://{quote(path, safe='')}"


def socket_path(base_url: str) -> str | None:
    """The unix socket ``base_url`` names, or None for a TCP URL."""
    parts = urlsplit(base_url)
    return unquote(parts.netloc) if parts.scheme == UNIX_SCHEME else None


@contextmanager
def reach(client: httpx.Client, base_url: str) -> Iterator[tuple[httpx.Client, str]]:
    """``(client, base)`` to call ``base + path`` with: ``client`` and ``base_url`` for TCP; for a
    unix socket, a client of its own on that socket (the caller's timeout, no proxy from the
    environment) and ``http://localhost`` (the Host header uvicorn is sent)."""
    path = socket_path(base_url)
    if path is None:
        yield client, base_url.rstrip("/")
        return
    transport = httpx.HTTPTransport(uds=path)
    with httpx.Client(transport=transport, trust_env=False, timeout=client.timeout) as unix_client:
        yield unix_client, "http://localhost" + urlsplit(base_url).path.rstrip("/")


def socket_answers(path: str) -> bool:
    """Whether a server accepts connections on the unix socket at ``path`` (a file left by a dead
    one refuses them)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(path)
        except OSError:
            return False
    return True
