"""A stream whose client stops reading for a while and then reads gets what a reading client gets,
through the real server (Daphne and uvicorn) over a socket.

While the client reads nothing the stream is held back in the coordinator (``motorsite.send_flow``):
its engine connections paused with what they buffered joined (``http11_wire.py``), each prompt's
derender state kept as JSON bytes (``derender/payload.py``), the relay ledger at 2 bytes an id
(``derender/session.py``). None of that may change a byte of what the client is then sent. Two
prompts, so the fan-in of per-prompt sessions is held back too; coalescing off, so that each engine
event is one frame and the two streams compare frame by frame, per choice (how two prompts' frames
interleave is the engines' timing, for any two clients).
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any, Iterator

import pytest

from motorsite import stack
from tests.serving.served import API_KEY, Fleet, fake_fleet
from tests.serving.test_silent_client import read_to_end, wait_blocked

TOKENS = 300  # per prompt
PROMPTS = 2
# Bytes of text added to every derendered chunk (bench/fake_upstream_server.py): the answer is then
# far more than the kernel's buffers take (Linux autotunes a loopback send buffer to megabytes).
PAD = 16 * 1024
WAIT_S = 30.0  # an upper bound for a state to be reached, never a timing assertion


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fake_fleet(tmp_path_factory.mktemp("held"), tokens=TOKENS, pad_bytes=PAD, coalesce=False) as f:
        yield f


def send_request(port: int) -> socket.socket:
    body = json.dumps({"model": "tiny", "prompt": [f"p{i}" for i in range(PROMPTS)], "stream": True,
                       "max_tokens": TOKENS, "stream_options": {"include_usage": True}}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"connection: close\r\nauthorization: Bearer " + API_KEY.encode() + b"\r\ncontent-length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    return sock


def frames(raw: bytes) -> list[Any]:
    """The response's SSE frames in order, each chunk without what names the request (its id, when it
    was created); the status line and headers are checked, not compared (they carry the request id)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    if b"transfer-encoding: chunked" in head.lower():
        body = unchunk(body)
    out: list[Any] = []
    for event in body.decode().split("\n\n"):
        if not event:
            continue
        assert event.startswith("data: "), event[:80]
        data = event[len("data: "):]
        if data == "[DONE]":
            out.append(data)
            continue
        chunk = json.loads(data)
        chunk.pop("id"), chunk.pop("created")
        out.append(chunk)
    return out


def per_choice(stream: list[Any]) -> dict[Any, list[Any]]:
    """Each choice's frames in order; the frames of no choice (usage, ``[DONE]``) under None."""
    out: dict[Any, list[Any]] = {}
    for f in stream:
        choices = f.get("choices") if isinstance(f, dict) else None
        out.setdefault(choices[0]["index"] if choices else None, []).append(f)
    return out


def unchunk(body: bytes) -> bytes:
    out, rest = [], body
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return b"".join(out)
        out.append(rest[:size])
        rest = rest[size + 2:]


@pytest.mark.parametrize("server", stack.SERVERS)
def test_a_client_that_pauses_reading_then_reads_gets_the_same_stream_as_one_that_reads_at_once(
    fleet: Fleet, server: str,
) -> None:
    with fleet.coordinator(server, {"MOTOR_CLIENT_STALL_S": "3600"}) as (cfg, _):
        reader = send_request(cfg.coordinator_port)
        try:
            at_once, ended = read_to_end(reader)
        finally:
            reader.close()
        assert ended == "eof"

        before = fleet.stats()
        paused = send_request(cfg.coordinator_port)
        try:
            calls = wait_blocked(fleet) - before["derender_calls"]
            # Held back: the coordinator stopped with most of the answer still to derender.
            assert calls < PROMPTS * TOKENS
            later, ended = read_to_end(paused)
        finally:
            paused.close()
        assert ended == "eof"

    expected = frames(at_once)
    assert expected[-1] == "[DONE]" and len(expected) >= PROMPTS * TOKENS + 2  # every token, usage, [DONE]
    assert per_choice(frames(later)) == per_choice(expected)
    deadline = time.monotonic() + WAIT_S
    while fleet.stats()["open_streams"]:
        assert time.monotonic() < deadline, "an engine stream was left open"
        time.sleep(0.05)
