"""A hostile upstream on 127.0.0.1: reads each request (head and ``Content-Length`` body), then
answers with whatever bytes a test scripts, however malformed, cut or slow.

The production client (``Http11Client``) is driven against it; nothing here parses responses.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

# What a script writes: bytes at once, a float to sleep that long, None to close the connection,
# ``HOLD`` to wait (reading the client's close) until the test ends.
Step = bytes | float | None
HOLD = "hold"


@dataclass
class Seen:
    head: bytes
    body: bytes


@dataclass
class HostileUpstream:
    script: Callable[[Seen], list[Step | str]] | list[Step | str]
    requests: list[Seen] = field(default_factory=list)
    connections: int = 0
    closed: int = 0  # connections that ended (client close, reset or the script's close)
    url: str = ""
    _server: asyncio.AbstractServer | None = None

    async def start(self) -> HostileUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                seen = Seen(head, await reader.readexactly(length))
                self.requests.append(seen)
                steps = self.script(seen) if callable(self.script) else self.script
                for step in steps:
                    if step is None:
                        return
                    if step == HOLD:
                        await reader.read()  # until the client closes
                        return
                    if isinstance(step, float):
                        await asyncio.sleep(step)
                    else:
                        assert isinstance(step, bytes)
                        writer.write(step)
                        await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()


async def hostile(script: Callable[[Seen], list[Step | str]] | list[Step | str]) -> HostileUpstream:
    return await HostileUpstream(script).start()
