"""Subscriber of engines' KV cache events (vLLM's ZMQ publisher) feeding the affinity index.

Wire format (vLLM 0.32/0.33 ``vllm/distributed/kv_events.py``): multipart
``[topic, seq (8 bytes big-endian), payload]``; the payload is msgpack of an ``EventBatch``
(array-like: ``[ts, [events...], data_parallel_rank]``) whose events are tagged maps
(``{"type": "BlockStored", ...}``, ``BlockRemoved``, ``AllBlocksCleared``), decoded and
validated by msgspec into the Structs of ``protocol.py``.

Who binds follows vLLM's publisher: an engine given ``tcp://*:P`` or an ``ipc://`` path binds
and the subscriber connects; an engine given ``tcp://host:P`` *connects*, so the subscriber
binds that address; only one process can bind it, so with several coordinator processes
give engines an endpoint they bind (``ipc://`` keeps it on this host; ``tcp://*:P`` listens on
every interface). A ZMQ PUB drops what it sends before the subscription arrives, so
the index may miss the first events after a (re)connect: it only loses hits, never serves
wrong ones, except for a missed BlockRemoved (the engine then recomputes a block the index
thought cached). There is no replay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from serving.pipeline.placement.kv_affinity import KVAffinityIndex
from serving.pipeline.protocol import KVEvent, KVEventBatch

logger = logging.getLogger(__name__)

# Pause before re-creating a socket after an error, so a broken endpoint cannot spin.
RECONNECT_DELAY_S = 0.5

_decoder = msgspec.msgpack.Decoder(KVEventBatch)


class KVEventDecodeError(ValueError):
    """A message that is not a vLLM event batch."""


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """Decode one ``[topic, seq, payload]`` message; raise KVEventDecodeError."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise KVEventDecodeError(f"expected [topic, 8-byte seq, payload], got {len(frames)} frames")
    seq = int.from_bytes(frames[1], "big", signed=True)
    try:
        batch = _decoder.decode(frames[2])
    except msgspec.DecodeError as exc:  # ValidationError included
        raise KVEventDecodeError(f"not a KV event batch: {exc}") from None
    return EventBatch(seq, batch.ts, batch.events, batch.data_parallel_rank)


def engine_binds(endpoint: str) -> bool:
    """Whether a vLLM publisher given ``endpoint`` binds it (else it connects)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def subscriber_address(endpoint: str, host: str = "127.0.0.1") -> tuple[str, bool]:
    """(address, bind) for the subscriber of an engine publishing on ``endpoint``."""
    if engine_binds(endpoint):
        # A wildcard is where the engine listens, not an address to dial: use its host.
        return endpoint.replace("*", host), False
    return endpoint, True


class KVEventSubscriber:
    """One asyncio task subscribed to one instance's endpoint, applying batches to ``index``.

    ``start()`` then ``aclose()``; socket errors are logged and the socket is re-created
    after :data:`RECONNECT_DELAY_S`. Undecodable messages are counted and skipped.
    """

    def __init__(
        self,
        instance: str,
        endpoint: str,
        index: KVAffinityIndex,
        *,
        topic: str = "",
        host: str = "127.0.0.1",
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.instance = instance
        self.endpoint = endpoint
        self.index = index
        self.topic = topic
        self.address, self.bind = subscriber_address(endpoint, host)
        self._context = context or zmq.asyncio.Context.instance()
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self.batches = 0
        self.errors = 0
        self.gaps = 0
        self.last_seq: int | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kv-events:{self.instance}")

    async def wait_ready(self) -> None:
        """Until the socket is bound or connected (not until a subscription reached the engine)."""
        await self._ready.wait()

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def _socket(self) -> zmq.asyncio.Socket:
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        if self.bind:
            sock.bind(self.address)
        else:
            sock.connect(self.address)
        return sock

    async def _run(self) -> None:
        while True:
            sock: zmq.asyncio.Socket | None = None
            try:
                sock = self._socket()
                self._ready.set()
                while True:
                    frames = await sock.recv_multipart()
                    self._handle(frames)
            except zmq.ZMQError as exc:
                self.errors += 1
                logger.warning("kv events %s (%s): %s; retrying", self.instance, self.address, exc)
            finally:
                if sock is not None:
                    sock.close(linger=0)
            await asyncio.sleep(RECONNECT_DELAY_S)

    def _handle(self, frames: Sequence[bytes]) -> None:
        try:
            batch = decode_message(frames)
        except KVEventDecodeError as exc:
            self.errors += 1
            logger.warning("kv events %s: %s", self.instance, exc)
            return
        if self.last_seq is not None and batch.seq != self.last_seq + 1:
            self.gaps += 1
        self.last_seq = batch.seq
        self.batches += 1
        try:
            self.index.apply_events(self.instance, batch.events)
        except (TypeError, ValueError, KeyError) as exc:
            # A malformed event must not end the subscription of a whole instance.
            self.errors += 1
            logger.warning("kv events %s: bad event: %r", self.instance, exc)


class KVEventHub:
    """The subscribers of a whole fleet: :meth:`sync` with the current instance -> endpoint
    map (from the fleet snapshot) starts new ones, restarts moved ones and stops (and
    forgets in the index) removed ones; :meth:`aclose` stops them all."""

    def __init__(self, index: KVAffinityIndex, *, topic: str = "", host: str = "127.0.0.1") -> None:
        self.index = index
        self.topic = topic
        self.host = host
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def sync(self, endpoints: Mapping[str, str]) -> None:
        for name, subscriber in list(self.subscribers.items()):
            if endpoints.get(name) != subscriber.endpoint:
                del self.subscribers[name]
                self._close_later(subscriber)
                # Its blocks are unknown from now on (a new endpoint may be a new engine).
                self.index.forget(name)
        for name, endpoint in endpoints.items():
            if name not in self.subscribers:
                subscriber = KVEventSubscriber(name, endpoint, self.index, topic=self.topic, host=self.host)
                subscriber.start()
                self.subscribers[name] = subscriber

    def _close_later(self, subscriber: KVEventSubscriber) -> None:
        task = asyncio.create_task(subscriber.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        subscribers, self.subscribers = list(self.subscribers.values()), {}
        for subscriber in subscribers:
            await subscriber.aclose()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
