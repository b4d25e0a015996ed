"""A streaming client that reads nothing, through the real server (Daphne and uvicorn) over a socket.

The coordinator runs as ``make run`` starts it, over the fake upstreams served on 127.0.0.1
(``served.py``). Each derendered chunk is padded to ``PAD`` bytes, so the frames the coordinator
has produced for a stream are counted by the fake derender: what is neither in the kernel's socket
buffers (the server's send queue, the client's receive queue, read from the kernel) nor read by
the client is held in the coordinator process. The global token budget fits the silent stream
alone, so a second client is admitted only once the silent one has let go of its lease.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from motorsite import stack
from motorsite.send_flow import WRITE_BUFFER_BYTES
from tests.serving.served import API_KEY, ROOT, Fleet, coordinator_log, fake_fleet
from tests.still import wait_still

TOKENS = 1000  # each engine stream's length: far more than the kernel's buffers take, padded
PAD = 16 * 1024  # bytes of text added to every derendered chunk (bench/fake_upstream_server.py)
PROMPT_TOKENS = 10  # what the fake render makes of the chat below
STALL_S = 5  # long enough to measure the blocked stream before it is cut
# The server's write buffer (1 KiB under both servers: motorsite.send_flow), plus the frame that
# crossed it and the one being derendered when the producer stopped.
HELD_BOUND = WRITE_BUFFER_BYTES + 2 * (PAD + 1024)
POLL_S = 0.25
STILL_POLLS = 4  # the stream is blocked: no derender call over this many polls
WAIT_S = 30.0  # an upper bound for a state to be reached, never a timing assertion


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fake_fleet(tmp_path_factory.mktemp("silent"), tokens=TOKENS, pad_bytes=PAD, coalesce=False) as f:
        yield f


@pytest.fixture(scope="module")
def patient(fleet: Fleet) -> Iterator[Callable[[str], stack.StackConfig]]:
    """A coordinator per server with a stall deadline that never comes (``MOTOR_CLIENT_STALL_S``
    3600), started on first use and kept for the module: what the hang-up and the reading client
    tests need, each starting from a coordinator with nothing in flight (``wait_idle``)."""
    with contextlib.ExitStack() as running:
        started: dict[str, stack.StackConfig] = {}

        def coordinator(server: str) -> stack.StackConfig:
            if server not in started:
                started[server] = running.enter_context(
                    fleet.coordinator(server, {"MOTOR_CLIENT_STALL_S": "3600"}))[0]
            return started[server]

        yield coordinator


def log_since(cfg: stack.StackConfig, offset: int) -> str:
    """What the coordinator of ``cfg`` logged past ``offset`` bytes: one test's part of a shared log."""
    with coordinator_log(cfg).open("rb") as log:
        log.seek(offset)
        return log.read().decode()


def chat(max_tokens: int, stream: bool) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream,
                       "max_tokens": max_tokens}).encode()


def silent_post(port: int, path: str, body: bytes) -> socket.socket:
    """A client that POSTs ``body`` to ``path`` and then reads nothing (a 4 KiB receive buffer).
    Also bench/slow_reader.py's and test_held_stream_objects.py's silent clients."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        b"POST " + path.encode() + b" HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + API_KEY.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
        + b"\r\n\r\n" + body
    )
    return sock


def open_silent(port: int) -> socket.socket:
    """A client that sends a streaming chat and then reads nothing."""
    return silent_post(port, "/v1/chat/completions", chat(TOKENS, stream=True))


def kernel_queued(server_port: int, client: socket.socket) -> int:
    """Bytes in the kernel between the coordinator and ``client``: its socket's send queue and the client's receive queue."""
    client_port = client.getsockname()[1]
    send_queue = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = (int(a.rsplit(":", 1)[1], 16) for a in fields[1:3])
        if (local, remote) == (server_port, client_port):
            send_queue = int(fields[4].split(":")[0], 16)
    assert send_queue is not None, "the server's side of the connection is gone: measured too late"
    received = struct.unpack("i", fcntl.ioctl(client, termios.FIONREAD, b"\0" * 4))[0]
    return send_queue + received


def wait_blocked(fleet: Fleet) -> int:
    """Poll until the coordinator has stopped derendering; returns the derender calls made so far."""
    calls: int = wait_still(lambda: fleet.stats()["derender_calls"], polls=STILL_POLLS, poll_s=POLL_S, wait_s=WAIT_S,
                            never="the stream never stopped")
    return calls


def read_to_end(sock: socket.socket) -> tuple[bytes, str]:
    """What the client can still read, and how the connection ended (``eof`` or ``reset``)."""
    sock.settimeout(WAIT_S)  # a connection the server never drops fails here
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        return data, "reset"
    return data, "eof"


def wait_idle(fleet: Fleet, cfg: stack.StackConfig) -> dict[str, Any]:
    """Wait until no engine stream is open and the coordinator holds no admitted tokens; returns the fakes' stats."""
    deadline = time.monotonic() + WAIT_S
    while True:
        stats = fleet.stats()
        metrics = httpx.get(cfg.coordinator_url + "/metrics").text
        assert "# TYPE motor_engine_in_flight_tokens gauge" in metrics
        inflight = [line for line in metrics.splitlines()
                    if line.startswith("motor_engine_in_flight_tokens{") and float(line.split()[-1]) != 0]
        if stats["open_streams"] == 0 and not inflight:
            return stats
        assert time.monotonic() < deadline, (stats["open_streams"], inflight)
        time.sleep(0.05)


@pytest.mark.parametrize("server", stack.SERVERS)
def test_a_client_that_reads_nothing_is_held_back_then_cut_and_others_are_served(fleet: Fleet, server: str) -> None:
    env = {
        "MOTOR_CLIENT_STALL_S": str(STALL_S),
        # Room for the silent stream alone: the second client waits for its lease (503 past 20 s).
        "MOTOR_GLOBAL_TOKEN_BUDGET": str(PROMPT_TOKENS + TOKENS),
        "MOTOR_ADMISSION_WAIT_MS": "20000",
    }
    with fleet.coordinator(server, env) as (cfg, _):
        before = fleet.stats()
        silent = open_silent(cfg.coordinator_port)
        try:
            calls = wait_blocked(fleet) - before["derender_calls"]
            queued = kernel_queued(cfg.coordinator_port, silent)
            # Every frame is at least PAD bytes: what the coordinator produced and the kernel does
            # not hold is in the coordinator (the client has read nothing).
            held = calls * PAD - queued
            assert calls < TOKENS  # the engine stream was held back, not read to its end
            assert held <= HELD_BOUND, (calls, queued, held)

            # Meanwhile, and once the silent stream is cut, another client is served.
            auth = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
            other = httpx.post(cfg.coordinator_url + "/v1/chat/completions", content=chat(4, stream=False),
                               headers=auth, timeout=WAIT_S + 20)
            assert other.status_code == 200, other.text
            assert other.json()["choices"][0]["message"]["content"]

            stats = wait_idle(fleet, cfg)
            aborted = stats["aborted"][len(before["aborted"]):]
            assert len(aborted) == 1 and aborted[0].startswith("generate-tokens-chatcmpl-")  # the engine saw it

            data, ended = read_to_end(silent)
            assert b"data: [DONE]" not in data  # cut, not finished
            assert ended in ("eof", "reset")
        finally:
            silent.close()
        log = coordinator_log(cfg).read_text()
        assert log.count("outcome=client_stalled") == 1


@pytest.mark.parametrize("server", stack.SERVERS)
def test_a_reading_client_gets_whole_streams_one_after_another_on_one_connection(
    fleet: Fleet, patient: Callable[[str], stack.StackConfig], server: str
) -> None:
    """The flow registered on each response is let go when it ends: the next request on the same
    keep-alive connection registers its own (Twisted refuses a second producer). First on its
    coordinator (``patient``): a stream cut by the hang-up test could log its end late."""
    auth = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    cfg = patient(server)
    wait_idle(fleet, cfg)
    offset = coordinator_log(cfg).stat().st_size
    with httpx.Client(base_url=cfg.coordinator_url, headers=auth, timeout=WAIT_S) as client:
        for _ in range(2):
            with client.stream("POST", "/v1/chat/completions", content=chat(TOKENS, stream=True)) as response:
                assert response.status_code == 200
                body = b"".join(response.iter_raw())
            assert body.endswith(b"data: [DONE]\n\n")
            assert body.count(b"data: {") >= TOKENS  # every token, each frame PAD bytes and more
        assert client.get("/healthz").status_code == 200  # Django's side too, on the same connection
    log = log_since(cfg, offset)
    assert "Producer was not unregistered" not in log and "Traceback" not in log
    if server == "daphne":  # its access log names the client's address and port: one connection
        clients = [line.split()[0] for line in log.splitlines() if '"POST /v1/chat/completions"' in line]
        assert len(clients) == 2 and len(set(clients)) == 1, clients


@pytest.mark.parametrize("server", stack.SERVERS)
def test_a_client_that_hangs_up_while_its_stream_is_held_back_frees_it_at_once(
    fleet: Fleet, patient: Callable[[str], stack.StackConfig], server: str
) -> None:
    """The send waiting for the client to read returns when the connection is lost (Twisted stops
    the producer), so the disconnect cancels the request long before the stall deadline."""
    cfg = patient(server)
    wait_idle(fleet, cfg)
    offset = coordinator_log(cfg).stat().st_size
    before = fleet.stats()
    silent = open_silent(cfg.coordinator_port)
    try:
        calls = wait_blocked(fleet) - before["derender_calls"]
        assert calls < TOKENS
    finally:
        silent.close()
    stats = wait_idle(fleet, cfg)
    aborted = stats["aborted"][len(before["aborted"]):]
    assert len(aborted) == 1 and aborted[0].startswith("generate-tokens-chatcmpl-")
    assert "outcome=client_stalled" not in log_since(cfg, offset)


@pytest.mark.parametrize(("value", "error"), [("0", "must be at least 1"), ("soon", "must be an integer")])
def test_a_bad_stall_deadline_stops_the_start(tmp_path: Path, value: str, error: str) -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "motorsite.settings", "MOTOR_VAR_DIR": str(tmp_path),
           "MOTOR_CLIENT_STALL_S": value}
    started = subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    assert started.returncode != 0
    assert f"MOTOR_CLIENT_STALL_S {error}" in started.stderr
