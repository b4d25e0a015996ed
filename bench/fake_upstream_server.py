"""The component tests' fake render sidecar, engines and derender (``tests/serving/fakes.py``) served
over real sockets on 127.0.0.1, in a process of its own, for benchmarks that measure the
coordinator's side only (``bench/slow_reader.py``).

One uvicorn server (the real sidecar and vLLM's engines are uvicorn too, so the same write-side
flow control: a response body waits for the socket to drain) listens on three ports, one per fake
host (``render``, ``e1``, ``e2``); each request becomes an ``httpx.Request`` for
``FakeUpstreams.handler`` and its answer is streamed back as it is produced. The engines'
streaming generate yields ``--tokens`` single-token events per request, built lazily as a real
engine would (then the usage-only event when ``stream_options.include_usage`` asks for it), and
counts each token event it hands to the socket. ``GET /stats`` on any port answers
``{"events_sent": n, "derender_calls": n, "derendered_tokens": n, "open_streams": n, "aborted": [ids],
"traced": [...]}``: the tokens of every streaming derender call (what the coordinator has taken from
the engines), the engine streams not yet ended or hung up on, the engine request ids aborted, and
the W3C trace headers of the latest requests (``{"seq", "host", "path", "traceparent", "tracestate"}``,
numbered from 0, None where a header was absent), as vLLM would read them.

Prints one JSON line ``{"render": port, "e1": port, "e2": port}`` once listening; runs until killed.

``--token-ms`` paces the engines: each event after the first waits that long (a decoding engine), so
a streaming cadence (``RenderConfig.stream_interval_ms``) has time to act.

    python3 -m toolchain exec bench/fake_upstream_server.py --tokens 1000 [--pad-bytes 0] [--token-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from collections import deque
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.serving.fakes import FakeUpstreams, SSEBody, output_ids  # noqa: E402

HOSTS = ("render", "e1", "e2")


class App:
    """ASGI adapter from real HTTP requests to ``FakeUpstreams.handler``."""

    def __init__(self, tokens: int, ports: dict[int, str], pad_bytes: int = 0, token_ms: float = 0.0) -> None:
        self.upstreams = FakeUpstreams()
        self.pad_bytes = pad_bytes
        self.token_s = token_ms / 1000
        self.ports = ports
        self.events_sent = 0
        self.derender_calls = 0
        self.derendered_tokens = 0
        self.open_streams = 0
        self.aborted: list[str] = []
        self.requests = 0
        self.traced: deque[dict[str, Any]] = deque(maxlen=1000)  # bounded over a long run
        for host in ("e1", "e2"):
            self.upstreams.override(host, "generate", self._generate(tokens))

    def _generate(self, tokens: int) -> Any:
        def generate(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
            if not body.get("stream"):
                return httpx.Response(200, json=FakeUpstreams.generate_response(body))
            rid = body["request_id"]
            ids = output_ids(body["token_ids"], 0, tokens)

            async def agen() -> AsyncIterator[bytes]:
                self.open_streams += 1
                try:
                    for pos, token in enumerate(ids):
                        if pos and self.token_s:
                            await asyncio.sleep(self.token_s)
                        event = {"request_id": "generate-tokens-" + rid, "usage": None, "output_mode": "tokens",
                                 "choices": [{"index": 0, "finish_reason": "stop" if pos == len(ids) - 1 else None,
                                              "stop_reason": None, "token_ids": [token], "routed_experts": None,
                                              "sampling_mask": None, "weight_versions": None, "logprobs": None}]}
                        yield ("data: " + json.dumps(event, separators=(",", ":")) + "\n\n").encode()
                        self.events_sent += 1
                    if (body.get("stream_options") or {}).get("include_usage"):
                        usage = {"prompt_tokens": len(body["token_ids"]), "completion_tokens": len(ids),
                                 "total_tokens": len(body["token_ids"]) + len(ids)}
                        event = {"request_id": "generate-tokens-" + rid, "usage": usage, "output_mode": "tokens",
                                 "choices": []}
                        yield ("data: " + json.dumps(event, separators=(",", ":")) + "\n\n").encode()
                    yield b"data: [DONE]\n\n"
                finally:
                    self.open_streams -= 1

            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=SSEBody(agen(), lambda: None))

        return generate

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/stats":
            payload = {"events_sent": self.events_sent, "derender_calls": self.derender_calls,
                       "derendered_tokens": self.derendered_tokens, "open_streams": self.open_streams,
                       "aborted": self.aborted, "traced": list(self.traced)}
            await _send_whole(send, 200, [(b"content-type", b"application/json")], json.dumps(payload).encode())
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        host = self.ports[scope["server"][1]]
        path = scope["path"] + ("?" + scope["query_string"].decode() if scope["query_string"] else "")
        request = httpx.Request(scope["method"], f"http://{host}.test{path}", headers=scope["headers"], content=body)
        self.traced.append({"seq": self.requests, "host": host, "path": scope["path"],
                            "traceparent": request.headers.get("traceparent"),
                            "tracestate": request.headers.get("tracestate")})
        self.requests += 1
        response = await self.upstreams.handler(request)
        if path.endswith("/derender"):
            self.derender_calls += 1
            chunk = json.loads(body).get("generate_chunk") or {}
            self.derendered_tokens += sum(len(c.get("token_ids") or []) for c in chunk.get("choices") or [])
            if chunk and self.pad_bytes and response.status_code == 200:
                response = httpx.Response(200, json=_padded(response.json(), self.pad_bytes))
        elif path == "/inference/v1/abort_requests":
            self.aborted += json.loads(body)["request_ids"]
        # The test double's call records would grow without end over a long run.
        self.upstreams.calls.clear()
        self.upstreams.stream_derenders.clear()
        headers = [(k.encode(), v.encode()) for k, v in response.headers.items() if k.lower() != "content-length"]
        if isinstance(response.stream, SSEBody):
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            try:
                async for piece in response.stream:
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await response.stream.aclose()
            return
        await _send_whole(send, response.status_code, headers, response.content)


def _padded(answer: dict[str, Any], pad_bytes: int) -> dict[str, Any]:
    """A derendered chunk whose text grew by ``pad_bytes`` per choice: big frames fill a client's buffers fast."""
    for choice in (answer.get("chunk") or {}).get("choices") or []:
        # Every frame at least pad_bytes long, the role-only and finishing ones too.
        delta = choice.get("delta")
        if delta is not None:
            delta["content"] = (delta.get("content") or "") + "x" * pad_bytes
        else:
            choice["text"] = (choice.get("text") or "") + "x" * pad_bytes
    return answer


async def _send_whole(send: Any, status: int, headers: list[tuple[bytes, bytes]], content: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--pad-bytes", type=int, default=0, help="text added to each streaming derender's choices")
    parser.add_argument("--token-ms", type=float, default=0.0, help="the engines' pause between a stream's events")
    args = parser.parse_args()
    socks = {}
    for host in HOSTS:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # asyncio turns Nagle off only on sockets it creates itself; these are handed to uvicorn,
        # and without this every response written in two parts waited ~20 ms for a delayed ACK
        # (accepted sockets inherit the option from the listening one).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        socks[host] = sock
    ports = {host: sock.getsockname()[1] for host, sock in socks.items()}
    app = App(args.tokens, {port: host for host, port in ports.items()}, args.pad_bytes, args.token_ms)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30)
    server = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=list(socks.values())))
        while not server.started:
            await asyncio.sleep(0.01)
        print(json.dumps(ports), flush=True)
        await task

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
