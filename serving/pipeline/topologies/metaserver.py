"""The Trigger topology's callback registry ("metaserver"), one per coordinator process.

In Trigger (vllm-ascend's layer-wise Mooncake proxy, ``shared/seeds/pd-disaggregation-vllm-ascend.txt``)
the decode instance is called first and posts the request's transfer parameters to a callback
URL; its arrival is what starts the prefill. The peers' proxies take anyone's word for such a
callback. Ours does not:

- every Trigger request registers here and gets its own URL, ``<base>/internal/metaserver/<token>``,
  where ``<base>`` is this process's own address and the token is ``<owner>.<secret>``: ``owner``
  names this process (a callback that reaches another process is refused as misdirected, since the
  request's task and its registration live only here) and ``secret`` is 256 random bits;
- registrations are looked up by the SHA-256 of the presented token, so lookup time says nothing
  about stored secrets, and an unknown token (forged, or of a request that already ended) is a 404;
- a registration accepts exactly one callback: a replay is a 409 and never starts a second
  prefill; a body that names another engine request than the one we sent is a 400;
- the request's task releases its registration exactly once on every exit path (``release`` is
  idempotent, and ``Registration`` is a context manager), so ``pending`` returns to zero.

Django-free: the view in ``serving.views_internal`` only calls ``check`` and ``deliver``.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import os
import secrets
import uuid
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

logger = logging.getLogger(__name__)

CALLBACK_PATH = "/internal/metaserver/"


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


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


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
    """Per-process registry of Trigger requests waiting for their decode instance's callback."""

    def __init__(self, base_url: str, *, owner: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        # Fresh per process start: a token handed out by a previous run never matches.
        self.owner = owner or uuid.uuid4().hex[:12]
        self._by_digest: dict[str, Registration] = {}
        # Counters for metrics and tests.
        self.delivered = 0
        self.refused = 0

    @property
    def pending(self) -> int:
        """Registrations not yet released (zero when no Trigger request is in flight)."""
        return len(self._by_digest)

    def register(self, request_id: str, *, engine_request_id: str) -> Registration:
        """Create the callback of one Trigger request; call from the request's own task."""
        token = f"{self.owner}.{secrets.token_urlsafe(32)}"
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

    def deliver(self, token: str, body: Any) -> Registration:
        """Hand D's callback to the request waiting on ``token``; return its registration.

        Raises ``CallbackRefused``: 421 for another process's token, 404 for an unknown one
        (forged, or its request already ended), 409 for a replay, 400 for a body that is not an
        object naming the engine request we sent to D.
        """
        try:
            return self._deliver(token, body)
        except CallbackRefused as exc:
            self.refused += 1
            logger.warning("metaserver refused a callback: %d %s", exc.status, exc.message)
            raise

    def check(self, token: str) -> Registration:
        """The registration waiting on ``token``, before its body is read; raises ``CallbackRefused``
        (421, 404, 409) as ``deliver`` does, so a forged callback costs no JSON parsing."""
        try:
            return self._waiting(token)
        except CallbackRefused as exc:
            self.refused += 1
            logger.warning("metaserver refused a callback: %d %s", exc.status, exc.message)
            raise

    def _waiting(self, token: str) -> Registration:
        owner, _, _ = token.partition(".")
        if owner != self.owner:
            raise CallbackRefused(421, "this callback belongs to another coordinator process")
        reg = self._by_digest.get(_digest(token))
        if reg is None:
            raise CallbackRefused(404, "unknown or expired callback token")
        if reg.state is not CallbackState.WAITING:
            raise CallbackRefused(409, f"callback for request {reg.request_id} already delivered")
        return reg

    def _deliver(self, token: str, body: Any) -> Registration:
        reg = self._waiting(token)
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
_base_url = ""


def configure(base_url: str) -> None:
    """Set how engines reach this process (before the first Trigger request)."""
    global _base_url, _process
    _base_url = base_url
    _process = None


def process_metaserver() -> MetaServer:
    """This process's metaserver. Its base URL names this very process, not a load balancer in
    front of several: the registrations live here. Unconfigured, ``MOTOR_METASERVER_BASE_URL``
    (set by ``motorsite.stack`` to the coordinator's own address) is used."""
    global _process
    if _process is None:
        _process = MetaServer(_base_url or os.environ.get("MOTOR_METASERVER_BASE_URL", "http://127.0.0.1:8000"))
    return _process
