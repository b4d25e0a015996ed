"""The production client's surface over an in-process fake, for the two tests whose bound is in
events rather than bytes: ``test_backpressure.py`` (over a socket the kernel's buffers and the
client's read-ahead, ``http11.HIGH_WATER``, its own bound, proven in ``test_http11.py`` and
``bench/slow_reader.py``, hold far more events than the pipeline's merge queue, so the pipeline's
own bound could not be seen there) and ``test_engine_events.py`` (what one read brings: a socket
would merge the pieces). Every other component test drives ``Http11Client`` over 127.0.0.1
(``loopback.LoopbackClient``).

``InProcessClient`` answers ``post``/``get`` with the production ``Reply`` and ``stream`` with the
handler's ``httpx.Response``, which has the ``StreamReply`` surface the callers use
(``status_code``, ``headers``, ``aiter_raw``, ``aread``); a body is pulled from
the fake only as the caller reads it.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Mapping

import httpx

from serving.pipeline.http11 import Http11Client, Reply
from serving.pipeline.json_codec import dumps
from tests.serving.loopback import Handler


class InProcessClient(Http11Client):
    def __init__(self, handler: Handler) -> None:
        super().__init__()
        # In-process on purpose: a socket's buffers would hide the pipeline's own bound (docstring).
        self._mock = httpx.AsyncClient(transport=httpx.MockTransport(handler))

    async def post(  # type: ignore[override]
        self, url: str, *, json: Any = None, content: bytes | None = None,
        headers: Mapping[str, str] | None = None, timeout: Any = None,
    ) -> Reply:
        body = dumps(json) if content is None else content
        response = await self._mock.post(url, content=body, headers=dict(headers or {}))
        return Reply(response.status_code, dict(response.headers), response.content)

    async def get(  # type: ignore[override]
        self, url: str, *, headers: Mapping[str, str] | None = None, timeout: Any = None
    ) -> Reply:
        response = await self._mock.get(url, headers=dict(headers or {}))
        return Reply(response.status_code, dict(response.headers), response.content)

    @asynccontextmanager
    async def stream(  # type: ignore[override]
        self, method: str, url: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
        timeout: Any = None,
    ) -> AsyncIterator[Any]:
        body = None if json is None else dumps(json)
        async with self._mock.stream(method, url, content=body, headers=dict(headers or {})) as response:
            yield response

    async def aclose(self) -> None:
        await self._mock.aclose()
        await super().aclose()
