"""uvicorn's httptools protocol with a deadline for request headers (``MOTOR_HEADER_TIMEOUT_S``).

uvicorn arms its keep-alive timeout only after a response and cancels it on the next byte, so a
client that connects and sends nothing, or sends a header byte now and then (slowloris), holds
its connection for ever. Here the deadline runs from the moment the connection waits for a
request (opened, or the previous response sent) until the request's headers are complete; a
client cut in the middle of its headers gets a 408 first, in its route's error shape
(``motorsite.refusals``) once its request line is complete. ``motorsite.stack`` passes this class
with ``--http``; Daphne's connections get the same deadline in ``motorsite.daphne_requests``.
"""

from __future__ import annotations

import asyncio
import logging

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from motorsite.refusals import headers_timed_out

logger = logging.getLogger(__name__)


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` whose connections must complete each request's headers in time."""

    _head_timer: asyncio.TimerHandle | None = None
    _head_started = False  # a byte of the awaited request has arrived (a 408 is then owed)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is not None:
            self._head_started = True
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        # A pipelined request already has its headers: only an empty pipeline waits for new ones.
        waits = not self.pipeline
        super().on_response_complete()
        if waits and not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_started = False
        self._head_timer = self.loop.call_later(settings.MOTOR_HEADER_TIMEOUT_S, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        logger.info(
            "front door cut a connection: no complete request headers in %.1f s (server=uvicorn)",
            settings.MOTOR_HEADER_TIMEOUT_S,
        )
        if self._head_started:
            # The target is whole once a header has followed it: the 408 then takes its
            # route's error shape (``url`` and ``headers`` start afresh with each request).
            self.transport.write(headers_timed_out(self.url if self.headers else None))
        self.transport.close()
