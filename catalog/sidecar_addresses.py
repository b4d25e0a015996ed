"""A render sidecar's address: ``host`` and ``port`` over TCP, or ``unix:/path/to.sock``.

A sidecar on the coordinator's own machine may listen on a unix socket (``vllm launch render
--uds PATH``, as ``make run`` starts it). Its address goes in the same ``host`` field as a host
name, written ``unix:`` and an absolute path, the way nginx (``server unix:/path``), gunicorn
(``--bind unix:PATH``) and vLLM's own start-up line write one; it has no port (stored as 0).
Not ``http+unix://%2Fpath``: that is the URL the data plane is given (``base_url``, the
convention of requests-unixsocket and docker-py, so a base URL plus a route is still one URL),
and nobody should have to percent-encode a path by hand.
"""

from __future__ import annotations

from urllib.parse import quote

UNIX_PREFIX = "unix:"
# Linux's sun_path holds 108 bytes, the closing NUL included.
UNIX_PATH_MAX = 107
# The data plane's URL scheme for a unix socket (serving.pipeline.http11.UNIX_SCHEME).
UNIX_SCHEME = "http+unix"


def is_unix(host: str) -> bool:
    return host.startswith(UNIX_PREFIX)


def address_error(host: str, port: int | None) -> tuple[str, str] | None:
    """Why ``host`` and ``port`` are not a sidecar's address: the field at fault ("host" or "port")
    and a sentence; None when they are one. ``port`` None or 0 means none was given.
    """
    if host.startswith((f"{UNIX_SCHEME}:", "http:", "https:")):
        return "host", f"{host[:60]!r} is a URL; give a host name and a port, or a unix socket as unix:/path/to.sock"
    if not is_unix(host):
        if not port:
            return "port", f"a TCP address needs a port (1-65535) beside host {host[:60]!r}"
        return None
    path = host[len(UNIX_PREFIX):]
    if not path.startswith("/"):
        return "host", f"a unix socket's path must be absolute: unix:/path/to.sock, not {host[:60]!r}"
    if any(c < " " or c == "\x7f" for c in path):
        return "host", "a unix socket's path may not hold control characters"
    if (size := len(path.encode())) > UNIX_PATH_MAX:
        return "host", f"a unix socket's path is at most {UNIX_PATH_MAX} bytes (Linux's sun_path); this one is {size}"
    if port:
        return "port", f"a unix socket has no port: leave port out for {host[:60]!r}"
    return None


def base_url(host: str, port: int) -> str:
    """The URL the data plane calls the sidecar at: ``http://host:port`` or ``http+unix://%2Fpath``."""
    if is_unix(host):
        return f"{UNIX_SCHEME}://{quote(host[len(UNIX_PREFIX):], safe='')}"
    return f"http://{host}:{port}"


def address(host: str, port: int) -> str:
    """How an operator writes it: ``host:port`` or ``unix:/path/to.sock``."""
    return host if is_unix(host) else f"{host}:{port}"
