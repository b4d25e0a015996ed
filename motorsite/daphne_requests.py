"""Daphne's connections and requests: the front door at the end of the headers, a deadline for
the headers, and bodies handed to the application unparsed.

Daphne builds each connection on Twisted's ``http.HTTPChannel`` and each request on its
``http.Request``; it exposes neither choice, so ``install`` puts subclasses in (for the Daphne
4.2.3 and Twisted 26.10 of the lock file: the channel's hooks used here are Twisted's own
extension points, ``_GenericHTTPChannelProtocol`` is the wrapper Twisted's factory builds).

- **The front door** (``motorsite.front_door``). Twisted reads a request's whole body, to a
  temporary file past 100 kB and without a limit, before Daphne calls the application, so the
  application's key check and 413 came only after the upload. Here ``check_head`` runs when the
  headers are complete (``allHeadersReceived``, before ``gotLength`` creates the body's file): a
  refusal is written, the connection closed, and the body never read. When the fleet snapshot
  needs a database check first, the connection stops reading while it runs: at most the rest
  of one read (64 KiB) of the body is held meanwhile. A chunked body is counted piece by piece
  (``handleContentChunk``) and refused as soon as it passes its cap.
- **A deadline for the headers** (``MOTOR_HEADER_TIMEOUT_S``): from the moment the connection
  waits for a request (opened, or the previous response sent) until its headers are complete.
  Twisted's own timeout restarts on every byte (12 hours by default in Daphne), so a client
  that trickled a header byte now and then, or sent nothing, held its connection for ever. A
  client cut in the middle of its headers gets a 408 first (in its route's error shape once
  its request line is complete: ``motorsite.refusals``).
- **Bodies unparsed.** Twisted's request parses every POST's Content-Type and a form body into
  ``request.args``, which Daphne never reads: about 40 us of CPU per request, a form body held
  twice, and a body Twisted cannot parse as the multipart form its Content-Type names answered
  by Twisted itself (a bare 400, the connection dropped) where the client should get an OpenAI
  error from /v1 or Django's own answer elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from daphne import http_protocol
from django.conf import settings
from twisted.web import http

from motorsite.front_door import Head, check_head, current_limits, log_refusal, unavailable
from motorsite.refusals import Refusal, headers_timed_out, path_of, too_large
from serving.pipeline.errors import MotorError
from serving.pipeline.snapshot import FleetSnapshot
from serving.snapshots import current_snapshot, fresh_snapshot

logger = logging.getLogger(__name__)


class FrontDoorRequest(http_protocol.WebRequest):  # type: ignore[misc]
    """Daphne's request with Twisted's form parsing off and a counted body when it is chunked."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["parsePOSTFormSubmission"] = False
        super().__init__(*args, **kwargs)
        self.motor_head: Head | None = None  # set when the body is counted against a cap
        self.motor_cap = 0
        self.motor_size = 0

    def handleContentChunk(self, data: bytes) -> None:
        head = self.motor_head
        if head is not None:
            channel = self.channel
            if channel is None or channel.motor_refused:
                return  # answered already: the rest of this read is dropped unread by anyone
            self.motor_size += len(data)
            if self.motor_size > self.motor_cap:
                channel.motor_refuse(head, too_large(head.route, head.path))
                return
        super().handleContentChunk(data)


class FrontDoorChannel(http.HTTPChannel):  # type: ignore[misc]
    """Twisted's HTTP/1.1 connection with the front door and the header deadline."""

    header_timeout: float = 20.0
    motor_refused = False
    _head_timer: Any = None  # twisted DelayedCall while the connection waits for a request's headers
    _head_started = False  # a byte of that request has arrived (a 408 is then owed)
    _held: list[bytes] | None = None  # body bytes read while the head is judged asynchronously
    _lost = False

    # -- the header deadline ----------------------------------------------------------------

    def connectionMade(self) -> None:
        super().connectionMade()
        self._arm()

    def dataReceived(self, data: bytes) -> None:
        if self._head_timer is not None:
            self._head_started = True
        super().dataReceived(data)

    def requestDone(self, request: Any) -> None:
        # Armed before Twisted replays pipelined bytes: a head already complete disarms it at once.
        if self.persistent:
            self._arm()
        super().requestDone(request)

    def connectionLost(self, reason: Any) -> None:
        self._lost = True
        self._disarm()
        super().connectionLost(reason)

    def _arm(self) -> None:
        self._disarm()
        self._head_started = False
        self._head_timer = self.callLater(self.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            if self._head_timer.active():
                self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        logger.info("front door cut a connection: no complete request headers in %.1f s (server=daphne)", self.header_timeout)
        if self._head_started:
            # Twisted holds the request line's target from its parse until the request is
            # complete: present, the 408 takes that route's error shape.
            self.transport.write(headers_timed_out(vars(self).get("_path")))
        # Twisted's own timeout path: close after the write, abort if the client never reads it.
        self.timeoutConnection()

    # -- the front door -----------------------------------------------------------------------

    def allHeadersReceived(self) -> None:
        self._disarm()
        if self.length == 0:  # no body: nothing to read, nothing to judge
            super().allHeadersReceived()
            return
        request = self.requests[-1]
        head = Head.parse(self._command.decode("ascii", "replace"), path_of(self._path), _headers(request))
        if head.needs_snapshot:
            snapshot = fresh_snapshot()
            if snapshot is None:
                self._judge_later(head)
                return
            self._judge(head, snapshot)
        else:
            self._judge(head, None)

    def _judge(self, head: Head, snapshot: FleetSnapshot | None) -> bool:
        """Refuse, or let Twisted read the body (counted when chunked); whether it may be read."""
        try:
            answer = check_head(head, snapshot, current_limits())
        except MotorError as exc:
            answer = unavailable(head, exc)
        if answer is not None:
            self.motor_refuse(head, answer)
            return False
        if head.declared is None:
            request = self.requests[-1]
            request.motor_head = head
            request.motor_cap = current_limits().cap(head.route)
        super().allHeadersReceived()  # the body's file, and "100 Continue" if the client waits for it
        return True

    def _judge_later(self, head: Head) -> None:
        """Stop reading until the snapshot is fresh, then judge (Daphne runs Twisted on asyncio's loop)."""
        self._held = []
        self._networkProducer.pauseProducing()
        task = asyncio.get_running_loop().create_task(current_snapshot())
        task.add_done_callback(lambda done: self._judged_later(head, done))

    def _judged_later(self, head: Head, done: asyncio.Task[FleetSnapshot]) -> None:
        held, self._held = self._held or [], None
        try:
            snapshot = done.result()
        except MotorError as exc:
            if not self._lost:
                self.motor_refuse(head, unavailable(head, exc))
            return
        except BaseException:
            logger.exception("front door: the snapshot check failed")
            if not self._lost:
                self.motor_refuse(head, unavailable(head, MotorError("snapshot check failed")))
            return
        if self._lost or not self._judge(head, snapshot):
            return
        if held:
            self.rawDataReceived(b"".join(held))
        if not self._lost and not self.motor_refused:
            self._networkProducer.resumeProducing()

    def motor_refuse(self, head: Head, answer: Refusal) -> None:
        """Answer in place of the application and close: the body is never read."""
        self.motor_refused = True
        log_refusal(head, answer, "daphne")
        self.transport.write(answer.http11())
        self.loseConnection()

    def rawDataReceived(self, data: bytes) -> None:
        if self.motor_refused:
            return
        if self._held is not None:
            self._held.append(data)
            return
        super().rawDataReceived(data)

    def allContentReceived(self) -> None:
        if self.motor_refused:
            return  # the end of a chunked body that arrived in the read that refused it
        super().allContentReceived()


def _headers(request: Any) -> list[tuple[bytes, bytes]]:
    """The headers as Daphne puts them in the scope: lower case, none with "_" in its name."""
    return [
        (name.lower(), value)
        for name, values in request.requestHeaders.getAllRawHeaders()
        if b"_" not in name
        for value in values
    ]


def _protocol(factory: Any) -> Any:
    return http._GenericHTTPChannelProtocol(FrontDoorChannel())


def install() -> None:
    """Make Daphne build its connections and requests from the classes above. Idempotent.

    Called when the ASGI application is imported, before Daphne's server builds its factory. Under
    another server this module still imports Daphne's HTTP protocol (not its server) and this
    changes nothing that server uses.
    """
    FrontDoorChannel.header_timeout = settings.MOTOR_HEADER_TIMEOUT_S
    factory = http_protocol.HTTPFactory
    if getattr(factory, "_motor_front_door", False):
        return
    build = factory.buildProtocol

    def buildProtocol(self: Any, addr: Any) -> Any:
        protocol = build(self, addr)
        if protocol is not None:
            protocol.requestFactory = FrontDoorRequest
        return protocol

    factory.protocol = _protocol
    factory.buildProtocol = buildProtocol
    factory._motor_front_door = True
