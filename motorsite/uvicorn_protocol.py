"""uvicorn's httptools protocol with a deadline for request headers (``MOTOR_HEADER_TIMEOUT_S``),
and lighter per-connection state for a stream whose client reads nothing (issue 31).

uvicorn arms its keep-alive timeout only after a response and cancels it on the next byte, so a
client that connects and sends nothing, or sends a header byte now and then (slowloris), holds
its connection for ever. Here the deadline runs from the moment the connection waits for a
request (opened, or the previous response sent) until the request's headers are complete; a
client cut in the middle of its headers gets a 408 first, in its route's error shape
(``motorsite.refusals``) once its request line is complete. ``motorsite.stack`` passes this class
with ``--http``; Daphne's connections get the same deadline in ``motorsite.daphne_requests``.

What a connection keeps while its response streams, each kept for as long as a silent client
holds the stream (issue 31's 64 KiB a stream, ``bench/slow_reader.py``):

- the request parser only while a request is on its way: llhttp's state and the parser's nine
  bound callbacks weigh 0.9 KiB, and a connection between requests (or streaming its answer)
  needs none; one is made again at its next byte;
- its flow control and its request cycle's message event without ``asyncio.Event``: an empty
  ``deque`` of waiters weighs 0.6 KiB, and a ``wait()`` that is a coroutine keeps a frame for as
  long as the send or the disconnect watch waits; ``_Event.wait`` returns the future itself;
- its queue of pipelined requests as a list (an empty ``deque``, 0.6 KiB, on every connection);
- at most 29 attributes on the protocol: past that CPython stops sharing the instance dict's keys
  with the class, and the dict grows from 0.3 to 1.5 KiB (uvicorn sets 28; the deadline's state is
  one more, ``_Head``).

Read against uvicorn 0.54's ``httptools_impl`` (the callbacks and attributes named here).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httptools
from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from motorsite.refusals import headers_timed_out

logger = logging.getLogger(__name__)


class _Event:
    """What uvicorn uses of ``asyncio.Event`` (``set``, ``clear``, ``is_set``, ``wait``), with its
    waiters in a list made on the first wait, and ``wait()`` a plain function returning a future
    (``await event.wait()`` reads the same; a waiter cancelled cancels only its own future)."""

    __slots__ = ("_loop", "_value", "_waiters")

    def __init__(self, loop: asyncio.AbstractEventLoop, value: bool = False) -> None:
        self._loop = loop
        self._value = value
        self._waiters: list[asyncio.Future[bool]] | None = None

    def is_set(self) -> bool:
        return self._value

    def set(self) -> None:
        if self._value:
            return
        self._value = True
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(True)

    def clear(self) -> None:
        self._value = False

    def wait(self) -> asyncio.Future[bool]:
        waiter = self._loop.create_future()
        if self._value:
            waiter.set_result(True)
            return waiter
        if self._waiters is None:
            self._waiters = [waiter]
        else:
            # Cancelled waiters (a disconnect watch let go) leave: the list stays as long as the waiting.
            self._waiters = [w for w in self._waiters if not w.done()]
            self._waiters.append(waiter)
        return waiter


class _Flow:
    """uvicorn's ``FlowControl`` (same attributes and methods) on an ``_Event``."""

    __slots__ = ("_transport", "read_paused", "write_paused", "_writable")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self.read_paused = False
        self.write_paused = False
        self._writable = _Event(loop, value=True)

    def drain(self) -> asyncio.Future[bool]:
        return self._writable.wait()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()

    def pause_writing(self) -> None:
        if not self.write_paused:
            self.write_paused = True
            self._writable.clear()

    def resume_writing(self) -> None:
        if self.write_paused:
            self.write_paused = False
            self._writable.set()


class _Pipeline(list):  # type: ignore[type-arg]
    """uvicorn's queue of pipelined requests (``appendleft``, ``pop``, truth): a list, not a deque."""

    __slots__ = ()

    def appendleft(self, item: Any) -> None:
        self.insert(0, item)


class _Head:
    """The header deadline's state, one attribute on the protocol (see the module docstring)."""

    __slots__ = ("timer", "started", "between")

    def __init__(self) -> None:
        self.timer: asyncio.TimerHandle | None = None
        self.started = False  # a byte of the awaited request has arrived (a 408 is then owed)
        self.between = True  # the parser has no request under way: it can go until the next byte


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` whose connections must complete each request's headers in time."""

    _head: _Head

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pipeline = _Pipeline()  # type: ignore[assignment]
        self.parser = None  # type: ignore[assignment]  # made at the first byte (data_received)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _Flow(transport, self.loop)  # type: ignore[assignment]
        self._head = _Head()
        self._arm()

    def data_received(self, data: bytes) -> None:
        head = self._head
        if head.timer is not None:
            head.started = True
        if self.parser is None:
            self.parser = _request_parser(self)
        super().data_received(data)
        if head.between and self.parser is not None and not self.transport.is_closing():
            # The request (and any pipelined after it) is whole: its response may stream for long.
            self.parser = None  # type: ignore[assignment]

    def on_message_begin(self) -> None:
        self._head.between = False
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and isinstance(cycle.message_event, asyncio.Event):
            # Made just now (the parser calls on_body after this returns, the task runs later).
            cycle.message_event = _Event(self.loop)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # A connection the client keeps alive: llhttp starts afresh at the next request anyway.
        # (After a "Connection: close" request the parser stays, as uvicorn's leniency expects.)
        self._head.between = self.parser.should_keep_alive()

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
        head = self._head
        head.started = False
        head.timer = self.loop.call_later(settings.MOTOR_HEADER_TIMEOUT_S, self._head_timed_out)

    def _disarm(self) -> None:
        head = self._head
        if head.timer is not None:
            head.timer.cancel()
            head.timer = None

    def _head_timed_out(self) -> None:
        head = self._head
        head.timer = None
        if self.transport.is_closing():
            return
        logger.info(
            "front door cut a connection: no complete request headers in %.1f s (server=uvicorn)",
            settings.MOTOR_HEADER_TIMEOUT_S,
        )
        if head.started:
            # The target is whole once a header has followed it: the 408 then takes its
            # route's error shape (``url`` and ``headers`` start afresh with each request).
            self.transport.write(headers_timed_out(self.url if self.headers else None))
        self.transport.close()


def _request_parser(protocol: HeaderDeadlineProtocol) -> httptools.HttpRequestParser:
    """A parser as uvicorn's ``__init__`` makes it."""
    parser = httptools.HttpRequestParser(protocol)
    try:
        parser.set_dangerous_leniencies(lenient_data_after_close=True)
    except AttributeError:  # httptools < 0.6.3, as uvicorn allows
        pass
    return parser
