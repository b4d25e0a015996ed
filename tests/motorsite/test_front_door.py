"""The front door (motorsite/front_door.py): no key, no body; a body over its cap is refused at
once; request headers have a deadline. Proven through the real server over a raw socket, under
Daphne (``make run``'s default) and uvicorn (``MOTOR_SERVER=uvicorn``), as ``motorsite.stack``
starts them.

"Not read" is measured on the server process itself: ``/proc/<pid>/io`` counts every byte it
reads (``rchar``: sockets and files) and writes (``wchar``: a spooled body's temporary file).
Each client below offers the server 8 MiB of body beyond what the refusal allows, from a thread,
so a server that read on would show it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx2
import orjson
import pytest

from motorsite import stack
from motorsite.supervisor import Supervisor, free_port

ROOT = Path(__file__).resolve().parents[2]
CLIENT_KEY = "sk-motor-front-door-test-client"
ADMIN_KEY = "mk-admin-front-door-test-admin"
V1_CAP = 256 * 1024
CONTROL_CAP = 64 * 1024
HEADER_TIMEOUT_S = 1.5
OFFERED = 8 * 1024 * 1024  # body bytes each refused client tries to send
# What a refusal may still take in: the rest of the read that brought the headers in, and what
# the server's read-ahead takes before the application is called (uvicorn: 64 KiB, then a pause).
READ_SLACK = 1024 * 1024
HUGE = 10**12


@dataclass(frozen=True)
class Server:
    name: str
    port: int
    pid: int

    def io(self) -> dict[str, int]:
        lines = Path(f"/proc/{self.pid}/io").read_text().split("\n")
        return {k: int(v) for k, v in (line.split(": ") for line in lines if line)}


def _manage(env: dict[str, str], *args: str) -> None:
    subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], check=True, env=env, cwd=ROOT)


@pytest.fixture(scope="module", params=["daphne", "uvicorn"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp(f"front-door-{request.param}")
    cfg = stack.StackConfig(
        model_dir=str(tmp / "no-model"),
        render_python=sys.executable,
        engine_python=sys.executable,
        server=request.param,
        coordinator_port=free_port(),
        database_url=f"sqlite:///{tmp / 'db.sqlite3'}",
        log_dir=tmp,
        celery_dir=tmp / "celery",
        extra_env={
            "MOTOR_VAR_DIR": str(tmp / "var"),
            "MOTOR_MAX_BODY_BYTES": str(V1_CAP),
            "MOTOR_CONTROL_MAX_BODY_BYTES": str(CONTROL_CAP),
            "MOTOR_HEADER_TIMEOUT_MS": str(int(HEADER_TIMEOUT_S * 1000)),
            # One snapshot for the module: no database read lands inside a measurement.
            "MOTOR_SNAPSHOT_POLL_MS": "3600000",
            "MOTOR_SNAPSHOT_TTL_MS": "3600000",
        },
        restart=None,
    )
    env = {**os.environ, **stack.coordinator_env(cfg)}
    # One interpreter migrates and writes the keys: a Django start each is seconds on a busy machine.
    _manage(
        env, "shell", "-c",
        "from django.core.management import call_command; call_command('migrate', interactive=False, verbosity=0);"
        "from fleet import services;"
        f"services.api_key_create(name='client', scope='client', key={CLIENT_KEY!r});"
        f"services.api_key_create(name='ops', scope='admin', key={ADMIN_KEY!r})",
    )
    with Supervisor([stack.coordinator_spec(cfg)]) as supervisor:
        yield Server(request.param, cfg.coordinator_port, supervisor.pids["coordinator"])


# -- a raw HTTP/1.1 client ------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    first_line: bytes


def _head(method: str, path: str, *headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_answer(sock: socket.socket) -> Answer:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection without an answer: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    first, *lines = head.split(b"\r\n")
    headers = {k.decode().lower(): v.decode().strip() for k, v in (line.split(b":", 1) for line in lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection in the middle of its answer"
        body += chunk
    return Answer(int(first.split()[1]), headers, body, first)


def _closed(sock: socket.socket) -> bool:
    """Whether the server ended the connection (FIN or reset) after its answer."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


@contextlib.contextmanager
def _offering(sock: socket.socket, chunked: bool) -> Iterator[None]:
    """Send up to OFFERED bytes of body from a thread while the test reads the answer."""
    piece = b"x" * 65536
    if chunked:
        piece = b"%x\r\n" % len(piece) + piece + b"\r\n"

    def pump() -> None:
        with contextlib.suppress(OSError):  # the server closing on us is the point
            for _ in range(OFFERED // 65536):
                sock.sendall(piece)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # already reset by the server
            sock.shutdown(socket.SHUT_RDWR)
        thread.join(timeout=30)


def _refused_unread(server: Server, head: bytes, *, chunked: bool = False) -> tuple[Answer, int, int]:
    """Send ``head`` and offer a body; the answer, and the bytes the server read and wrote meanwhile."""
    before = server.io()
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(head)
        with _offering(sock, chunked):
            answer = _read_answer(sock)
            assert answer.headers.get("connection") == "close"
            assert _closed(sock)
    after = server.io()
    return answer, after["rchar"] - before["rchar"], after["wchar"] - before["wchar"]


def _exchange(sock: socket.socket, raw: bytes) -> Answer:
    sock.sendall(raw)
    return _read_answer(sock)


# -- through the real server ----------------------------------------------------------------------


def test_it_lets_a_request_with_its_key_through_with_its_body(server: Server) -> None:
    """Also the module's first request: under Daphne its head is judged while the snapshot is
    built (the connection stops reading meanwhile), and its body arrived in the same read."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        body = b'{"model": "absent", "messages": [{"role": "user", "content": "hi"}]}'
        answer = _exchange(sock, _head(
            "POST", "/v1/chat/completions", f"Authorization: Bearer {CLIENT_KEY}",
            "Content-Type: application/json", f"Content-Length: {len(body)}",
        ) + body)
        # The edge parsed the body: it names a model the fleet does not serve.
        assert answer.status == 404, answer
        assert orjson.loads(answer.body)["error"]["param"] == "model"
        # The same connection again (its header deadline re-armed): the REST API parsed {} too.
        answer = _exchange(sock, _head(
            "POST", "/api/instances", f"Authorization: Bearer {ADMIN_KEY}",
            "Content-Type: application/json", "Content-Length: 2",
        ) + b"{}")
        assert answer.status == 422, answer
        # A chunked body under its cap is read and counted, not refused.
        chunked = b'{"model": "absent", "prompt": "hi"}'
        answer = _exchange(sock, _head(
            "POST", "/v1/completions", f"Authorization: Bearer {CLIENT_KEY}",
            "Content-Type: application/json", "Transfer-Encoding: chunked",
        ) + b"%x\r\n" % len(chunked) + chunked + b"\r\n0\r\n\r\n")
        assert answer.status == 404, answer


@pytest.mark.parametrize(
    ("path", "status", "shape"),
    [
        ("/v1/chat/completions", 401, "error"),
        ("/api/instances", 401, "detail"),
        ("/internal/metaserver/owner.route.secret.mac", 404, "error"),
    ],
)
def test_it_refuses_a_request_without_a_key_before_reading_its_body(server: Server, path: str, status: int, shape: str) -> None:
    head = _head(
        "POST", path, "Content-Type: application/json", f"Content-Length: {HUGE}",
        # A client that waits for "100 Continue" gets the refusal instead.
        "Expect: 100-continue",
    )
    answer, read, written = _refused_unread(server, head)
    assert answer.status == status and answer.first_line.split()[1] != b"100", answer
    assert shape in orjson.loads(answer.body)
    assert read < READ_SLACK and written < READ_SLACK, (read, written)


def test_a_client_key_on_the_rest_api_is_refused_before_its_body(server: Server) -> None:
    head = _head("POST", "/api/instances", f"Authorization: Bearer {CLIENT_KEY}", f"Content-Length: {HUGE}")
    answer, read, _ = _refused_unread(server, head)
    assert answer.status == 403 and "admin-scope" in orjson.loads(answer.body)["detail"]
    assert read < READ_SLACK


@pytest.mark.parametrize(
    ("path", "key"),
    [("/v1/chat/completions", CLIENT_KEY), ("/api/instances", ADMIN_KEY), ("/admin/login/", None)],
)
def test_it_refuses_a_declared_body_over_its_cap_at_once(server: Server, path: str, key: str | None) -> None:
    auth = [f"Authorization: Bearer {key}"] if key else []
    head = _head("POST", path, *auth, "Content-Type: application/json", f"Content-Length: {HUGE}")
    answer, read, written = _refused_unread(server, head)
    assert answer.status == 413, answer
    assert read < READ_SLACK and written < READ_SLACK, (read, written)


@pytest.mark.parametrize(("path", "key", "cap"), [("/v1/chat/completions", CLIENT_KEY, V1_CAP), ("/api/instances", ADMIN_KEY, CONTROL_CAP)])
def test_it_counts_a_chunked_body_and_refuses_it_past_its_cap(server: Server, path: str, key: str, cap: int) -> None:
    head = _head("POST", path, f"Authorization: Bearer {key}", "Content-Type: application/json", "Transfer-Encoding: chunked")
    answer, read, written = _refused_unread(server, head, chunked=True)
    assert answer.status == 413, answer
    assert read < cap + READ_SLACK and written < cap + READ_SLACK, (read, written)


def _cut_within(sock: socket.socket, drip: bytes, bound_s: float) -> tuple[bool, bytes]:
    """Send ``drip`` a byte at a time until the server ends the connection or ``bound_s`` passes."""
    sock.settimeout(0.1)
    got = b""
    deadline = time.monotonic() + bound_s
    i = 0
    while time.monotonic() < deadline:
        try:
            if drip:
                sock.sendall(drip[i % len(drip):i % len(drip) + 1])
                i += 1
            chunk = sock.recv(4096)
            if not chunk:
                return True, got
            got += chunk
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True, got
    return False, got


def test_it_cuts_a_client_that_trickles_its_headers(server: Server) -> None:
    # Twenty deadlines: the server had every chance; a server without a deadline never cuts it.
    bound = 20 * HEADER_TIMEOUT_S
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        cut, got = _cut_within(sock, b"X-Slow: still-coming\r\n", bound)
    assert cut, "a client trickling its headers kept its connection"
    assert got.startswith(b"HTTP/1.1 408 "), got
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        cut, got = _cut_within(sock, b"", bound)
    assert cut and got == b"", "a connection that never sent a request stayed open"


# -- /v1/messages: Anthropic's error shape, the anthropic client's x-api-key ------------------------


def _anthropic_error(answer: Answer, kind: str) -> anthropic.APIStatusError:
    """The answer is Anthropic's error of ``kind``; what the ``anthropic`` client raises for it
    (its own mapping, given the answer the server sent: it cannot itself send a body it is
    refused, nor trickle its headers)."""
    body = orjson.loads(answer.body)
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body
    assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}
    response = httpx2.Response(answer.status, headers=answer.headers, content=answer.body,
                               request=httpx2.Request("POST", "http://127.0.0.1/v1/messages"))
    return anthropic.Anthropic(api_key="-")._make_status_error_from_response(response)


MESSAGES_REFUSALS = [
    ("POST", (), 401, "authentication_error", anthropic.AuthenticationError),
    ("POST", ("x-api-key: sk-motor-not-a-key",), 401, "authentication_error", anthropic.AuthenticationError),
    ("POST", (f"x-api-key: {CLIENT_KEY}",), 413, "request_too_large", anthropic.ContentTooLargeError),
    ("POST", (f"Authorization: Bearer {CLIENT_KEY}",), 413, "request_too_large", anthropic.ContentTooLargeError),
    ("PUT", (f"x-api-key: {CLIENT_KEY}",), 405, "invalid_request_error", anthropic.APIStatusError),
]


@pytest.mark.parametrize(("method", "headers", "status", "kind", "raised"), MESSAGES_REFUSALS,
                         ids=["no-key", "wrong-x-api-key", "too-large-x-api-key", "too-large-bearer", "wrong-method"])
def test_on_v1_messages_a_refusal_before_the_body_is_anthropics(
    server: Server, method: str, headers: tuple[str, ...], status: int, kind: str, raised: type[Exception]
) -> None:
    head = _head(method, "/v1/messages", *headers, "Content-Type: application/json", f"Content-Length: {HUGE}")
    answer, read, written = _refused_unread(server, head)
    assert answer.status == status, answer
    error = _anthropic_error(answer, kind)
    assert type(error) is raised and error.status_code == status
    assert read < READ_SLACK and written < READ_SLACK, (read, written)


def test_on_v1_messages_a_chunked_body_past_its_cap_is_anthropics_413(server: Server) -> None:
    head = _head("POST", "/v1/messages", f"x-api-key: {CLIENT_KEY}", "Content-Type: application/json",
                 "Transfer-Encoding: chunked")
    answer, read, written = _refused_unread(server, head, chunked=True)
    assert answer.status == 413 and type(_anthropic_error(answer, "request_too_large")) is anthropic.ContentTooLargeError
    assert read < V1_CAP + READ_SLACK and written < V1_CAP + READ_SLACK, (read, written)


def test_the_anthropic_client_is_answered_in_its_shape_and_its_default_key_header_is_read(server: Server) -> None:
    """The client itself: a wrong key (its default ``x-api-key``) is refused before the body; the
    right one passes the front door and the edge, which answers the model the fleet lacks."""
    base = f"http://127.0.0.1:{server.port}"
    message = {"model": "absent", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with anthropic.Anthropic(base_url=base, api_key="sk-motor-not-a-key", max_retries=0, timeout=20) as client:
        with pytest.raises(anthropic.AuthenticationError) as wrong:
            client.messages.create(**message)  # type: ignore[call-overload]
    assert wrong.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with anthropic.Anthropic(base_url=base, api_key=CLIENT_KEY, max_retries=0, timeout=20) as client:
        with pytest.raises(anthropic.NotFoundError) as absent:
            client.messages.create(**message)  # type: ignore[call-overload]
    assert absent.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_a_client_cut_in_its_headers_gets_its_routes_408(server: Server, path: str) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode())
        cut, got = _cut_within(sock, b"X-Slow: still-coming\r\n", 20 * HEADER_TIMEOUT_S)
    assert cut and got.startswith(b"HTTP/1.1 408 "), got
    body = orjson.loads(got.split(b"\r\n\r\n", 1)[1])
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["code"] == 408


def test_a_keep_alive_connection_still_serves_requests_in_time(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        for _ in range(3):
            answer = _exchange(sock, _head("GET", "/v1/models", f"Authorization: Bearer {CLIENT_KEY}"))
            assert answer.status == 200, answer
