"""Helpers for tests that drive the simulator: a threaded uvicorn server, SSE reading.

Kept in the package (not a conftest) so coordinator tests can reuse them; pytest's
importlib import mode makes conftest modules unimportable by name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import uvicorn

from enginesim.app import create_app
from enginesim.config import SimConfig
from enginesim.engine import SimEngine
from enginesim.scripts import ScriptBook


class LiveServer:
    """A uvicorn server in a background thread serving one simulator app.

    It binds its own socket to port 0 first and hands it to uvicorn, so there is no
    window in which another process can take the port.
    """

    def __init__(self, config: SimConfig) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # The app learns its port, which P/D peers are told (remote_host / remote_port).
        self.app = create_app(dataclasses.replace(config, host="127.0.0.1", port=self.port))
        self.engine: SimEngine = self.app.state.engine
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=1)
        )
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout: float = 10.0) -> None:
        self._thread.start()
        started = threading.Event()
        for _ in range(int(timeout / 0.01)):
            if self._server.started:
                return
            started.wait(0.01)
        raise RuntimeError("uvicorn did not start")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> LiveServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reset(self) -> None:
        """Disarm faults, drop scripts, zero the stats (call between tests)."""
        self.engine.faults.clear()
        self.engine.scripts = ScriptBook()
        # Keep the live count: a stream of an earlier test may still be winding down.
        self.engine.stats = type(self.engine.stats)(active_streams=self.engine.stats.active_streams)


def gen_body(
    token_ids: list[int], sampling: dict[str, Any] | None = None, **top: Any
) -> dict[str, Any]:
    """A GenerateRequest body: ``sampling`` becomes sampling_params, ``top`` the rest."""
    return {"request_id": "r1", "token_ids": token_ids, "sampling_params": sampling or {}, **top}


async def eventually(predicate: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    """Poll ``predicate`` until it holds; raise TimeoutError after ``timeout`` seconds.

    A watchdog for state that settles asynchronously, not a timing assertion.
    """
    async with asyncio.timeout(timeout):
        while not await predicate():
            await asyncio.sleep(0.01)


class SSEReader:
    """Reads SSE frames off an httpx streaming response, byte-exact."""

    def __init__(self, response: httpx.Response) -> None:
        self._chunks: AsyncIterator[bytes] = response.aiter_raw()
        self._buffer = b""

    async def next_frame(self) -> bytes | None:
        """The next frame including its ``\\n\\n`` terminator, or None at a clean EOF."""
        while b"\n\n" not in self._buffer:
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                if self._buffer:
                    raise AssertionError(f"trailing bytes after last frame: {self._buffer!r}") from None
                return None
            self._buffer += chunk
        frame, _, self._buffer = self._buffer.partition(b"\n\n")
        return frame + b"\n\n"

    async def all_frames(self) -> list[bytes]:
        frames = []
        while (frame := await self.next_frame()) is not None:
            frames.append(frame)
        return frames
