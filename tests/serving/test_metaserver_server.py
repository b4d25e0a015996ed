"""A coordinator forwards a Trigger callback only to an address the control plane recorded, through the real server.

Finding: the callback token used to carry its owner's address, signed with a key derived from
``SECRET_KEY``; with the k8s Secret's public placeholder anyone could sign a token naming any
address, and a replica then POSTed the caller's body there and returned the answer. Here a
coordinator (Daphne as ``make run`` starts it, and the uvicorn option) runs with a ``SECRET_KEY``
the test knows, as a leaked key; a listener on 127.0.0.1 stands for the address an attacker
names. Tokens signed with that key, in the old format naming the listener and in the current one
naming an owner nobody advertised, are refused and the listener sees no connection; malformed
MACs are 404, never a 500. The positive control: once the listener's address is recorded for an
owner (as a coordinator process records its own), that owner's callback is forwarded there.
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import http.server
import json
import os
import select
import sqlite3
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from motorsite import stack
from motorsite.supervisor import Supervisor, free_port
from serving.pipeline.topologies.metaserver import CALLBACK_PATH, FORWARDED_HEADER

SECRET_KEY = "metaserver-test-" + uuid.uuid4().hex + uuid.uuid4().hex  # the "leaked" key
ROUTE_KEY = hmac.digest(SECRET_KEY.encode(), b"motorsite.metaserver.route", "sha256")


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def sign(unsigned: str) -> str:
    return f"{unsigned}.{b64(hmac.digest(ROUTE_KEY, unsigned.encode(), 'sha256'))}"


class Listener(http.server.ThreadingHTTPServer):
    """The address a forged token names: counts every connection, answers a callback with 200."""

    connections = 0

    def verify_request(self, request: object, client_address: object) -> bool:
        self.connections += 1
        return True

    def pending(self) -> bool:
        """Whether a connection is waiting to be accepted (the server connected and nobody took it yet)."""
        return bool(select.select([self.socket], [], [], 0)[0])


class Accept(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (the standard library's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        answer = json.dumps({"status": "accepted", "forwarded": self.headers.get(FORWARDED_HEADER)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: object) -> None:
        pass


@dataclass
class Coordinator:
    url: str
    db: Path

    def post(self, token: str) -> httpx.Response:
        body = {"request_id": "generate-tokens-x-decode", "remote_host": "127.0.0.1", "remote_port": 9}
        return httpx.post(self.url + CALLBACK_PATH + token, json=body, timeout=30)


def config(tmp: Path, server: str) -> stack.StackConfig:
    """A coordinator under ``server`` with the known ``SECRET_KEY``, its database and logs in ``tmp``."""
    return stack.StackConfig(
        model_dir="/m", render_python="", engine_python="", engines="sim", server=server,
        coordinator_port=free_port(), database_url=f"sqlite:///{tmp / 'db.sqlite3'}", log_dir=tmp, celery=False,
        restart=None, extra_env={"SECRET_KEY": SECRET_KEY, "MOTOR_VAR_DIR": str(tmp)},
    )


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated, empty database, migrated once: each server's coordinator starts on a copy of it."""
    cfg = config(tmp_path_factory.mktemp("metaserver-migrated"), "daphne")
    subprocess.run([cfg.app_python, str(stack.ROOT / "manage.py"), "migrate", "--noinput", "-v", "0"],
                   check=True, env={**os.environ, **stack.coordinator_env(cfg)}, cwd=stack.ROOT)
    return Path(cfg.database_url.removeprefix("sqlite:///"))


@pytest.fixture(scope="module", params=["daphne", "uvicorn"])
def coordinator(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, migrated: Path
) -> Iterator[Coordinator]:
    cfg = config(tmp_path_factory.mktemp(f"metaserver-{request.param}"), request.param)
    db = Path(cfg.database_url.removeprefix("sqlite:///"))
    with contextlib.closing(sqlite3.connect(migrated)) as source, contextlib.closing(sqlite3.connect(db)) as copy:
        source.backup(copy)  # whole, whatever the journal mode left beside the file
    with Supervisor([replace(stack.coordinator_spec(cfg), ready_timeout=60.0)]):
        yield Coordinator(cfg.coordinator_url, db)


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener(("127.0.0.1", 0), Accept)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def record(db: Path, owner: str, url: str) -> None:
    """A directory entry, as a coordinator process writes its own (fleet.replicas.advertise)."""
    now = datetime.now(timezone.utc).replace(tzinfo=None).isoformat(" ")
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO fleet_coordinatoraddress (owner, url, host, pid, seen) VALUES (?, ?, 'h', 1, ?)",
                     (owner, url, now))


def listener_url(listener: Listener) -> str:
    return f"http://127.0.0.1:{listener.server_address[1]}"


def test_a_signed_token_naming_an_address_sends_nothing_there(coordinator: Coordinator, listener: Listener) -> None:
    route = b64(listener_url(listener).encode())
    tokens = {
        # main's format, <owner>.<route>.<secret>.<mac>: its replica posted the body to the route.
        "address in the token": sign(f"0123456789ab.{route}.{'s' * 43}"),
        # The current format can only name an owner; nobody advertised this one.
        "unknown owner": sign(f"0123456789ab.{'s' * 43}"),
        "the route as the owner": sign(f"{route}.{'s' * 43}"),
    }
    for why, token in tokens.items():
        answer = coordinator.post(token)
        assert answer.status_code == 404, (why, answer.text)
        assert answer.json()["error"]["code"] == 404
    # The server answered only after any forward it made: a connection it opened would be waiting.
    assert listener.connections == 0 and not listener.pending()


@pytest.mark.parametrize(
    "mac",
    ["%C3%A9" * 43, "%F0%9F%94%91", "A" * 42, "A" * 44, "!!!!", "A" * 4000],
    ids=["non-ascii", "emoji", "short", "long", "not-base64", "huge"],
)
def test_a_malformed_mac_is_404_never_500(coordinator: Coordinator, listener: Listener, mac: str) -> None:
    # In both token shapes: main compared a four-part token's MAC as a str, and a non-ASCII one
    # raised TypeError there (a 500).
    route = b64(listener_url(listener).encode())
    for token in (f"0123456789ab.{'s' * 43}.{mac}", f"0123456789ab.{route}.{'s' * 43}.{mac}"):
        answer = coordinator.post(token)
        assert answer.status_code == 404, answer.text
    assert listener.connections == 0 and not listener.pending()


def test_a_recorded_owner_is_forwarded_to_its_recorded_address(coordinator: Coordinator, listener: Listener) -> None:
    # The control: the same server does forward, to the address the directory holds for the owner.
    owner = uuid.uuid4().hex[:12]
    record(coordinator.db, owner, listener_url(listener))
    answer = coordinator.post(sign(f"{owner}.{'s' * 43}"))
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"status": "accepted", "forwarded": "1"}
    assert listener.connections == 1
