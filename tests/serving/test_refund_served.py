"""A tokens-per-minute charge comes back when the client leaves before its answer began, through
the real server (Daphne and uvicorn) over a socket.

The coordinator runs as ``make run`` starts it, over the fake upstreams on 127.0.0.1
(``served.py``). The global token budget fits one long stream alone, so a second request is charged
after render and then waits for admission; its client hangs up there. The key's limit fits one
charge, not two: a third request is answered only if the hung-up one was refunded.
"""

from __future__ import annotations

import hashlib
import json
import socket
import sqlite3
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.serving.served import Fleet, fake_fleet

TOKENS = 250  # the long stream: 5 s at its pace, longer than the steps that need it, short for teardown
TOKEN_MS = 20.0
PROMPT_TOKENS = 10  # what the fake render makes of the chat below
LIMITED_TOKENS = 20  # max_tokens of the limited key's requests: a charge of 30
TPM = 50  # one charge fits, two do not
BUDGET = PROMPT_TOKENS + TOKENS + 10  # the long stream alone fits; it and a limited request (30) do not
WAIT_S = 30.0  # an upper bound for a state to be reached, never a timing assertion
FREE_KEY = "sk-free-" + "f3a9c1e7" * 5
LIMITED_KEY = "sk-limited-" + "b7d2e4a6" * 5


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fake_fleet(tmp_path_factory.mktemp("refund"), tokens=TOKENS, token_ms=TOKEN_MS) as f:
        db = Path(f.cfg.database_url.removeprefix("sqlite:///"))
        with sqlite3.connect(db) as conn:  # two client keys: one unlimited, one limited
            for name, key, tpm in (("free", FREE_KEY, None), ("limited", LIMITED_KEY, TPM)):
                conn.execute(
                    "INSERT INTO fleet_apikey (name, prefix, key_hash, scope, tokens_per_minute, allow_priority,"
                    " revoked, created) VALUES (?, ?, ?, 'client', ?, 0, 0, datetime('now'))",
                    (name, key[:8], hashlib.sha256(key.encode()).hexdigest(), tpm),
                )
        yield f


def request(key: str, max_tokens: int, stream: bool) -> bytes:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
                       "stream": stream}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


def waiting(base_url: str) -> float:
    """The coordinator's admission queue (``motor_admission_waiting``)."""
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("motor_admission_waiting "):
            return float(line.split()[1])
    raise AssertionError("no motor_admission_waiting in /metrics")


def until(predicate: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("server", ["daphne", "uvicorn"])
def test_a_client_that_leaves_while_its_charged_request_waits_gets_the_tokens_back(fleet: Fleet, server: str) -> None:
    with fleet.coordinator(server, env={"MOTOR_GLOBAL_TOKEN_BUDGET": str(BUDGET)}) as (cfg, _pid):
        host, port = "127.0.0.1", cfg.coordinator_port
        long_stream = socket.create_connection((host, port))
        hung_up = socket.create_connection((host, port))
        try:
            long_stream.sendall(request(FREE_KEY, TOKENS, stream=True))
            assert long_stream.recv(64).startswith(b"HTTP/1.1 200")  # it holds the budget now
            hung_up.sendall(request(LIMITED_KEY, LIMITED_TOKENS, stream=False))
            until(lambda: waiting(cfg.coordinator_url) == 1, "the limited request charged and waiting")
            hung_up.close()  # the client leaves before any answer
            until(lambda: waiting(cfg.coordinator_url) == 0, "the hung-up request gone from the queue")
        finally:
            hung_up.close()
            long_stream.close()  # the budget is free again
        answered = httpx.post(
            cfg.coordinator_url + "/v1/chat/completions", timeout=60,
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": LIMITED_TOKENS},
            headers={"Authorization": f"Bearer {LIMITED_KEY}"},
        )
        # Charged 30 of 50 a minute: without the refund this is 60 > 50, a 429.
        assert answered.status_code == 200, answered.text
        again = httpx.post(
            cfg.coordinator_url + "/v1/chat/completions", timeout=60,
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": LIMITED_TOKENS},
            headers={"Authorization": f"Bearer {LIMITED_KEY}"},
        )
        assert again.status_code == 429  # an answered request keeps its charge
