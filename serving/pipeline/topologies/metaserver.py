"""The Trigger topology's callback registry ("metaserver"), one per coordinator process.

In Trigger (vllm-ascend's layer-wise Mooncake proxy, ``shared/seeds/pd-disaggregation-vllm-ascend.txt``)
the decode instance is called first and posts the request's transfer parameters to a callback
URL; its arrival is what starts the prefill. The peers' proxies take anyone's word for such a
callback. Ours does not:

- every Trigger request registers here and gets its own URL, ``<base>/internal/metaserver/<token>``,
  where ``<base>`` is how engines reach the coordinators and the token is
  ``<owner>.<secret>.<mac>``: ``owner`` names this process (fresh per start), ``secret`` is 256
  random bits and ``mac`` an HMAC-SHA256 of the rest under the key every replica shares
  (``MOTOR_METASERVER_KEY``);
- a callback that reaches another replica (a load balancer in front, or a base URL that names a
  Service) is routed to its owner: the replica checks the MAC first (a forged token is a 404), then
  looks the owner up in the ``ReplicaDirectory``, where every coordinator process advertised its
  own address (``MOTOR_METASERVER_OWNER_URL``) before it handed out a callback URL, and ``forward``
  posts the body unchanged there and returns the answer. The token carries no address: even with
  the signing key (a leaked ``SECRET_KEY``) nobody can make a replica post anywhere but to an
  address a coordinator process wrote into the control plane. An owner the directory does not
  know is a 404. A forwarded callback is never forwarded again (one hop at most: a stale entry
  cannot loop). The request's task and its future live only in the owner, so routing needs no
  shared state per request; only a callback that lands elsewhere pays one extra hop (and, the
  first time a replica sees that owner, one directory lookup);
- registrations are looked up by the SHA-256 of the presented token, so lookup time says nothing
  about stored secrets, and an unknown token (forged, or of a request that already ended) is a 404;
- a registration accepts exactly one callback: a replay is a 409 and never starts a second
  prefill; a body that names another engine request than the one we sent is a 400;
- the request's task releases its registration exactly once on every exit path (``release`` is
  idempotent, and ``Registration`` is a context manager), so ``pending`` returns to zero.

Django-free: the view in ``serving.views_internal`` only calls ``check``, ``deliver`` and ``forward``;
the directory is the control plane's (``fleet.replicas``), installed by ``serving.runtime``.
"""

from __future__ import annotations

import asyncio
import base64
import enum
import hashlib
import hmac
import logging
import os
import secrets
import uuid
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import httpx

from serving.pipeline.http11 import Http11Client, Reply

logger = logging.getLogger(__name__)

CALLBACK_PATH = "/internal/metaserver/"
# Marks a callback one replica forwarded to another; its receiver never forwards it again.
FORWARDED_HEADER = "X-Motor-Metaserver-Forwarded"
# Bounds the forwarding replica's call to the owner: the owner answers from memory at once, so
# anything slower is a dead or unreachable owner (the decode engine then fails its request).
FORWARD_TIMEOUT_S = 5.0


class CallbackState(enum.Enum):
    # Registered; D has not called back yet.
    WAITING = "waiting"
    # D's callback arrived and was handed to the request's task; any further one is a replay.
    DELIVERED = "delivered"
    # The request ended; the token is forgotten.
    RELEASED = "released"


class CallbackRefused(Exception):
    """A callback the metaserver will not act on; ``status`` is the HTTP answer to the caller."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class CallbackElsewhere(CallbackRefused):
    """A genuine callback (its MAC checked) of another replica's request; ``owner`` names that
    process, whose address ``forward`` looks up in the directory."""

    def __init__(self, owner: str) -> None:
        super().__init__(421, f"this callback belongs to coordinator process {owner}")
        self.owner = owner


class ReplicaDirectory(Protocol):
    """Where each coordinator process says where it can be reached (the control plane's record).

    ``advertise`` records this process's own address under its owner id (and may raise: the
    caller logs and carries on); ``address_of`` returns the address a live process advertised
    under ``owner``, or None.
    """

    async def advertise(self, owner: str, url: str) -> None: ...

    async def address_of(self, owner: str) -> str | None: ...


# How often a process that hands out callback URLs renews its directory entry; entries older than
# ``fleet.replicas.STALE_S`` are ignored, so this must stay well inside it.
ADVERTISE_EVERY_S = 60.0
# The first write waits this long at most (a request is waiting); a failed one is retried this much later.
ADVERTISE_TIMEOUT_S = 2.0
ADVERTISE_RETRY_S = 5.0


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


@dataclass(eq=False)
class Registration:
    """One Trigger request's claim on a callback; use as a (sync) context manager to release it."""

    metaserver: MetaServer
    request_id: str
    token: str
    # The engine request id D was given: its callback must name this one (vLLM may suffix it).
    engine_request_id: str
    state: CallbackState = CallbackState.WAITING
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    _arrived: asyncio.Future[dict[str, Any]] = field(init=False)

    def __post_init__(self) -> None:
        self._arrived = self._loop.create_future()

    @property
    def url(self) -> str:
        return self.metaserver.base_url + CALLBACK_PATH + self.token

    async def wait(self, timeout: float) -> dict[str, Any]:
        """Return D's callback body; raise ``TimeoutError`` if none arrives within ``timeout``."""
        async with asyncio.timeout(timeout):
            # shield: a timeout or cancellation of this wait must not cancel the future itself
            # (a late deliver would then find it cancelled and report a confusing error).
            return await asyncio.shield(self._arrived)

    def _set(self, body: dict[str, Any]) -> None:
        if not self._arrived.done():
            self._arrived.set_result(body)

    def release(self) -> None:
        self.metaserver.release(self)

    def __enter__(self) -> Registration:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class MetaServer:
    """Per-process registry of Trigger requests waiting for their decode instance's callback.

    ``base_url`` goes into the callback URLs (how engines reach a coordinator: this process, or a
    load balancer in front of all); ``owner_url`` is this process's own address, where another
    replica forwards a callback it received for us (default ``base_url``), advertised in
    ``directory``. ``key`` signs tokens; replicas that do not share it cannot route each other's
    callbacks (a random key, the default, makes every foreign token a 404), nor can a replica
    without a directory (every foreign token is then a 404 too).
    """

    def __init__(
        self, base_url: str, *, owner: str | None = None, owner_url: str | None = None, key: bytes | None = None,
        directory: ReplicaDirectory | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.owner_url = (owner_url or base_url).rstrip("/")
        # Fresh per process start: a token handed out by a previous run never matches.
        self.owner = owner or uuid.uuid4().hex[:12]
        self._key = key or secrets.token_bytes(32)
        self.directory = directory
        # When this process last advertised its address (the loop's clock; None: never), and the
        # write under way, if any.
        self._advertised_at: float | None = None
        self._advertising: asyncio.Task[None] | None = None
        self._by_digest: dict[str, Registration] = {}
        # Counters for metrics and tests.
        self.delivered = 0
        self.refused = 0
        self.forwarded = 0
        # Callbacks forwarded to their owner, by its answer (metric_names.TRIGGER_CALLBACK_RESULTS).
        self.forward_results: Counter[str] = Counter()

    @property
    def pending(self) -> int:
        """Registrations not yet released (zero when no Trigger request is in flight)."""
        return len(self._by_digest)

    async def advertise(self) -> None:
        """Make sure the directory knows this process's address before a callback URL goes out.

        The first time it waits for the write (at most ``ADVERTISE_TIMEOUT_S``); after that a
        renewal, due every ``ADVERTISE_EVERY_S``, runs in the background, so a slow or absent
        database never holds a request. A failure is logged and retried when next due: the
        callback of a request started here still reaches this process directly, only one that
        lands on another replica would be refused meanwhile.
        """
        if self.directory is None:
            return
        loop = asyncio.get_running_loop()
        if self._advertised_at is not None and loop.time() - self._advertised_at < ADVERTISE_EVERY_S:
            return
        if self._advertising is not None and not self._advertising.done():
            if self._advertised_at is None:
                await asyncio.shield(self._advertising)  # the first write, which another request started
            return
        self._advertising = loop.create_task(self._advertise(self.directory))
        if self._advertised_at is None:
            await asyncio.shield(self._advertising)

    async def _advertise(self, directory: ReplicaDirectory) -> None:
        try:
            async with asyncio.timeout(ADVERTISE_TIMEOUT_S):
                await directory.advertise(self.owner, self.owner_url)
        except Exception as exc:
            logger.warning("metaserver could not advertise %s as %s: %r", self.owner_url, self.owner, exc)
            # Not again before one retry interval, so an outage costs one attempt per interval.
            self._advertised_at = asyncio.get_running_loop().time() - ADVERTISE_EVERY_S + ADVERTISE_RETRY_S
            return
        self._advertised_at = asyncio.get_running_loop().time()

    def register(self, request_id: str, *, engine_request_id: str) -> Registration:
        """Create the callback of one Trigger request; call from the request's own task
        (after ``advertise``, so another replica can route it here)."""
        unsigned = f"{self.owner}.{secrets.token_urlsafe(32)}"
        token = f"{unsigned}.{self._mac(unsigned)}"
        reg = Registration(self, request_id, token, engine_request_id)
        self._by_digest[_digest(token)] = reg
        return reg

    def release(self, reg: Registration) -> None:
        """Forget ``reg``; idempotent, so every exit path may call it."""
        if reg.state is CallbackState.RELEASED:
            return
        reg.state = CallbackState.RELEASED
        self._by_digest.pop(_digest(reg.token), None)
        if not reg._arrived.done():
            reg._arrived.cancel()

    def deliver(self, token: str, body: Any, *, forwarded: bool = False) -> Registration:
        """Hand D's callback to the request waiting on ``token``; return its registration.

        Raises ``CallbackElsewhere`` (421) for a genuine token of another replica (the caller
        forwards it), ``CallbackRefused``: 404 for an unknown one (forged, signed under another
        key, its request already ended, or ``forwarded`` here for an owner that is gone), 409 for
        a replay, 400 for a body that is not an object naming the engine request we sent to D.
        """
        try:
            return self._deliver(token, body, forwarded)
        except CallbackElsewhere:
            raise
        except CallbackRefused as exc:
            self.refused += 1
            logger.warning("metaserver refused a callback: %d %s", exc.status, exc.message)
            raise

    def check(self, token: str, *, forwarded: bool = False) -> Registration:
        """The registration waiting on ``token``, before its body is read; raises as ``deliver``
        does (421 ``CallbackElsewhere``, 404, 409), so a forged callback costs no JSON parsing."""
        try:
            return self._waiting(token, forwarded)
        except CallbackElsewhere:
            raise
        except CallbackRefused as exc:
            self.refused += 1
            logger.warning("metaserver refused a callback: %d %s", exc.status, exc.message)
            raise

    async def forward(
        self, elsewhere: CallbackElsewhere, token: str, body: bytes, client: Http11Client
    ) -> Reply:
        """Post a callback ``check`` found to be another replica's to the address its owner
        advertised in the directory; return the answer.

        Raises ``CallbackRefused``: 404 when the directory knows no live process by that owner
        (or names this process's own address), 503 when the directory cannot be read, 502 when
        the owner cannot be reached in ``FORWARD_TIMEOUT_S`` (the owner process is gone, and
        with it the request that waited for this callback).
        """
        owner_url = await self._address_of(elsewhere.owner)
        url = owner_url + CALLBACK_PATH + token
        try:
            response = await client.post(
                url,
                content=body,
                headers={"Content-Type": "application/json", FORWARDED_HEADER: "1"},
                timeout=FORWARD_TIMEOUT_S,
            )
        except httpx.HTTPError as exc:
            self.refused += 1
            self.forward_results["unreachable"] += 1
            logger.warning("metaserver could not forward a callback to %s: %r", owner_url, exc)
            raise CallbackRefused(502, f"the coordinator process at {owner_url} is unreachable") from None
        self.forwarded += 1
        self.forward_results["accepted" if 200 <= response.status_code < 300 else "refused"] += 1
        logger.info("metaserver forwarded a callback to %s: %d", owner_url, response.status_code)
        return response

    async def _address_of(self, owner: str) -> str:
        """The address ``owner`` advertised; raises ``CallbackRefused`` as ``forward`` says."""
        try:
            found = await self.directory.address_of(owner) if self.directory is not None else None
        except Exception as exc:
            self.refused += 1
            logger.warning("metaserver could not look up coordinator process %s: %r", owner, exc)
            raise CallbackRefused(503, "the coordinator directory is unavailable; try again") from None
        # An entry naming this process's own address is a previous process here (it restarted):
        # its request is gone, and a callback is never posted back to where it arrived.
        if found is None or found.rstrip("/") == self.owner_url:
            self.refused += 1
            logger.warning("metaserver refused a callback: no live coordinator process %s", owner)
            raise CallbackRefused(404, "unknown or expired callback token (its coordinator process is gone)")
        return found.rstrip("/")

    def _mac(self, unsigned: str) -> str:
        return _b64(hmac.digest(self._key, unsigned.encode("utf-8", "surrogatepass"), "sha256"))

    def _waiting(self, token: str, forwarded: bool) -> Registration:
        parts = token.split(".")
        if len(parts) != 3:
            raise CallbackRefused(404, "unknown or expired callback token")
        owner, _, mac = parts
        if owner != self.owner:
            raise self._elsewhere(token[: -len(mac) - 1], owner, mac, forwarded)
        reg = self._by_digest.get(_digest(token))
        if reg is None:
            raise CallbackRefused(404, "unknown or expired callback token")
        if reg.state is not CallbackState.WAITING:
            raise CallbackRefused(409, f"callback for request {reg.request_id} already delivered")
        return reg

    def _elsewhere(self, unsigned: str, owner: str, mac: str, forwarded: bool) -> CallbackRefused:
        # The MAC before anything else: only a token a replica signed is ever looked up. Compared
        # as bytes: compare_digest refuses a str with non-ASCII characters (a TypeError, a 500),
        # and a MAC of any length or alphabet is simply not equal.
        if not hmac.compare_digest(mac.encode("utf-8", "surrogatepass"), self._mac(unsigned).encode("ascii")):
            return CallbackRefused(404, "unknown or expired callback token")
        # A replica forwarded this to us, though it is not ours (a stale directory entry, or this
        # address now serves another process): one hop is all a callback gets.
        if forwarded:
            return CallbackRefused(404, "unknown or expired callback token (its coordinator process is gone)")
        return CallbackElsewhere(owner)

    def _deliver(self, token: str, body: Any, forwarded: bool) -> Registration:
        reg = self._waiting(token, forwarded)
        if not isinstance(body, dict):
            raise CallbackRefused(400, "callback body must be a JSON object")
        named = body.get("request_id")
        if not (isinstance(named, str) and named.startswith(reg.engine_request_id)):
            raise CallbackRefused(400, f"callback names request {named!r}, not {reg.engine_request_id!r}")
        reg.state = CallbackState.DELIVERED
        self.delivered += 1
        if reg._loop is _running_loop():
            reg._set(body)
        else:
            reg._loop.call_soon_threadsafe(reg._set, body)
        return reg


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


_process: MetaServer | None = None


def process_metaserver() -> MetaServer:
    """This process's metaserver, from the environment on first use.

    ``MOTOR_METASERVER_BASE_URL`` (set by ``motorsite.stack`` to the coordinator's own address,
    by the k8s manifests to the pod's IP) goes into callback URLs; ``MOTOR_METASERVER_OWNER_URL``
    (default: the base URL) is this process's direct address, which must differ from the base
    URL when that names a load balancer; ``MOTOR_METASERVER_KEY`` (default: ``SECRET_KEY``, which
    replicas share) signs tokens. ``serving.runtime`` installs the control plane's directory (``directory``).
    """
    global _process
    if _process is None:
        base = os.environ.get("MOTOR_METASERVER_BASE_URL") or "http://127.0.0.1:8000"
        key = os.environ.get("MOTOR_METASERVER_KEY") or os.environ.get("SECRET_KEY") or ""
        _process = MetaServer(
            base,
            owner_url=os.environ.get("MOTOR_METASERVER_OWNER_URL") or base,
            # Derived, so the key that signs routes is never the one Django signs sessions with.
            key=hmac.digest(key.encode("utf-8"), b"motorsite.metaserver.route", "sha256") if key else None,
        )
    return _process
