"""What the suite needs on this machine besides Python: Redis, PostgreSQL, Chromium, built tiers.

One probe per service, used by every test that needs one. A test whose prerequisite is missing
skips with ``pytest.skip``; under ``make test`` (``python3 -m toolchain exec -m pytest`` sets
``MOTOR_PREREQUISITES=required``) the root conftest turns every such skip into a failure, so a
green run means every test ran. ``MOTOR_PREREQUISITES=optional`` keeps the skips for a
developer without, say, PostgreSQL.
"""

from __future__ import annotations

import os
import socket

HOST = "127.0.0.1"
REDIS_PORT = 6379
POSTGRES_PORT = 5432


def required() -> bool:
    """Whether a missing prerequisite fails the run instead of skipping (``make test``, CI)."""
    return os.environ.get("MOTOR_PREREQUISITES", "optional") == "required"


def reachable(port: int, host: str = HOST) -> bool:
    """Whether something accepts a TCP connection on ``host:port`` within half a second."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def redis_answers(port: int = REDIS_PORT, host: str = HOST) -> bool:
    """Whether a Redis server answers PING on ``host:port`` (a listening port alone may be anything)."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def postgres_answers(port: int = POSTGRES_PORT, host: str = HOST) -> bool:
    """Whether PostgreSQL accepts connections on ``host:port`` (TCP only: psql does the rest)."""
    return reachable(port, host)
