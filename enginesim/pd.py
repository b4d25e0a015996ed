"""Prefill / decode roles: simulated KV transfer between simulator instances.

Two transfer modes, chosen per process with ``--kv-transfer``:

**pull** (NixlConnector / MooncakeConnector, the coordinator's *Handoff*)

1. The coordinator sends P a non-streaming generate with ``max_tokens: 1`` and
   ``kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false}``. P prefills
   (TTFT from the latency model, only uncached tokens cost), keeps the request's blocks for
   ``--kv-hold-s`` seconds (30 by default, like vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``) and
   answers with NIXL's shape of ``kv_transfer_params``::

       {"do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": [[0, 1, 2]], "remote_engine_id": "sim-<hex>",
        "remote_request_id": "generate-tokens-<id>-<hex>", "remote_host": "127.0.0.1",
        "remote_port": <P's HTTP port>, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
        "remote_num_tokens": <prompt length>, "remote_blocks_expiry_time": null,
        "transfer_mode": "pull"}

2. The coordinator sends D the same prompt ids, the real budget and those params verbatim. D
   "pulls": ``POST http://remote_host:remote_port/sim/kv/pull`` with
   ``{"remote_engine_id", "remote_request_id", "remote_block_ids", "num_tokens"}``. P answers
   200 only for blocks it still holds for that request id, engine id, block ids and token count,
   and frees them (a second pull of the same params fails). D then decodes without prefill
   time. Anything else (unknown request id, wrong host / port, wrong token count, expired,
   missing keys such as ``{"do_remote_prefill": true}`` alone, which crash a real decode
   engine) is answered by D with vLLM's KV-load-failure error: 500 ``InternalServerError``,
   message ``Internal server error: KV transfer failed (<why>)``.

**push** (MooncakeLayerwiseConnector, the coordinator's *Trigger*): the contract of
vllm-ascend 0.23.0.post1's ``mooncake_layerwise_connector.py`` (docs/ascend-connectors.md, "Push")

1. The coordinator calls D first: ``kv_transfer_params: {"do_remote_prefill": true,
   "metaserver": "<callback url>", ...}``.
2. D registers the request, then ``POST <metaserver>`` with the body the real D builds in
   ``update_state_after_alloc`` (nothing of the params it received is echoed)::

       {"token_ids": [], "request_id": "<D's engine request id>",
        "do_remote_prefill": false, "do_remote_decode": true,
        "remote_block_ids": [[...]], "remote_block_size": [<block size>],
        "remote_engine_id": "<D's engine id>", "remote_host": "127.0.0.1",
        "remote_port": <D's HTTP port>, "remote_tp_size": 1, "remote_pcp_size": 1,
        "remote_dcp_size": 1, "remote_cached_tokens": 0}

   (the simulated D reports no local prefix hits: a remote prefill's whole prompt is pushed).
   A non-2xx answer, or no answer within 10 s, fails D's request (500 as above).
3. The coordinator picks P and sends it the prompt with ``max_tokens: 1`` under **D's request
   id** and ``kv_transfer_params`` = that body with ``do_remote_decode: true``. P reads what the
   real P reads: ``remote_cached_tokens`` indexed (missing: 500, where the real scheduler raises
   ``KeyError``), ``remote_host`` / ``remote_port`` / ``remote_engine_id`` / ``remote_block_ids``.
   P prefills, then pushes: ``POST http://remote_host:remote_port/sim/kv/push`` with
   ``{"request_id": <P's own engine request id>, "remote_engine_id", "remote_block_ids",
   "num_tokens": <prompt - remote_cached_tokens>, "source_engine_id"}``. Like the real D, which
   matches P's done-signal by P's external request id, D accepts it only for a request of that
   id waiting for exactly that push (else 404 / 409, and P answers 500).
   P's own answer is its usual one-token response with ``kv_transfer_params: null``.
4. D, woken by the push, decodes with no prefill time. If no push arrives within
   ``--kv-push-timeout-s`` (30 s), D fails the request (500) and forgets it. An abort
   (``/abort_requests`` with D's engine request id) releases the waiting request at once: it
   ends with ``finish_reason: "abort"`` and no tokens, like vLLM aborting a request in
   ``WAITING_FOR_REMOTE_KVS``; a later push for it is refused (404).

**pull, router-supplied** (``--kv-pull-params router``: upstream vLLM 0.33.0's
MooncakeConnector, ``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py``)

1. P gets ``{"do_remote_decode": true, "transfer_id": "<router's id>", ...}``; it prefills, holds
   the blocks under that transfer id (none without one: the real P only warns) and answers with
   ``kv_transfer_params: null`` (the real ``request_finished`` returns no params).
2. D gets ``{"do_remote_prefill": true, "remote_engine_id": <P's engine id>,
   "remote_bootstrap_addr": "http://<P host>:<port>", "transfer_id": <the same id>}``. Lacking
   any of the three, D does what the real one does: logs "Got invalid KVTransferParams" and
   prefills locally (no transfer). Otherwise it pulls: ``POST <remote_bootstrap_addr>/sim/kv/pull``
   with ``{"transfer_id", "remote_engine_id", "num_tokens"}`` (the simulator's bootstrap
   server is its HTTP port); a refusal is the KV-load-failure 500.

D always caches the received blocks in its prefix cache (and publishes BlockStored for them),
like a real decode engine. Output is a function of seed and context, so D's answer equals a
union instance's for the same prompt.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from enginesim.errors import SimError

logger = logging.getLogger(__name__)

# Bounds D's call to the metaserver and every KV pull / push between simulators.
PEER_TIMEOUT_S = 10.0


class TransferMode(enum.Enum):
    # D pulls from P after P answered (Handoff).
    PULL = "pull"
    # P pushes to D, which was called first and waits (Trigger).
    PUSH = "push"


def kv_failure(why: str) -> SimError:
    """vLLM's answer when a KV load fails under the default ``kv_load_failure_policy``."""
    return SimError(f"Internal server error: KV transfer failed ({why})", status=500)


@dataclass(slots=True)
class _Held:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    timer: asyncio.TimerHandle | None


@dataclass(slots=True)
class _Waiting:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    # Resolved by the push, or by an abort (then ``aborted`` is set first).
    pushed: asyncio.Future[None]
    aborted: bool = False


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class KVTransfer:
    """One engine's side of the simulated KV transfers (both P and D duties)."""

    def __init__(
        self,
        *,
        block_size: int,
        hold_seconds: float,
        push_timeout_seconds: float,
        host: str,
        port: int,
        engine_id: str | None = None,
    ) -> None:
        self.engine_id = engine_id or f"sim-{uuid.uuid4().hex[:12]}"
        self.block_size = block_size
        self.hold_seconds = hold_seconds
        self.push_timeout_seconds = push_timeout_seconds
        self.host = host
        self.port = port
        self._held: dict[str, _Held] = {}
        self._waiting: dict[str, _Waiting] = {}
        self._block_ids = itertools.count()
        self._client: httpx.AsyncClient | None = None
        # Counters for /sim/stats and tests.
        self.pulled = 0
        self.pushed = 0
        self.expired = 0

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(PEER_TIMEOUT_S))
        return self._client

    async def aclose(self) -> None:
        for held in self._held.values():
            if held.timer is not None:
                held.timer.cancel()
        self._held.clear()
        for waiting in self._waiting.values():
            waiting.pushed.cancel()
        self._waiting.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _allocate(self, num_tokens: int) -> list[int]:
        return [next(self._block_ids) for _ in range(math.ceil(num_tokens / self.block_size))]

    # -- P, pull mode -----------------------------------------------------------------

    def hold(self, engine_request_id: str, num_tokens: int) -> dict[str, Any]:
        """Keep a finished prefill's blocks for D; return the params P answers with."""
        request_id = f"{engine_request_id}-{uuid.uuid4().hex[:8]}"
        block_ids = self._allocate(num_tokens)
        timer = None
        if self.hold_seconds > 0:
            timer = asyncio.get_running_loop().call_later(self.hold_seconds, self._expire, request_id)
        self._held[request_id] = _Held(request_id, block_ids, num_tokens, timer)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [block_ids],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": num_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": TransferMode.PULL.value,
        }

    def hold_transfer(self, transfer_id: str, num_tokens: int) -> None:
        """Router-supplied pull (upstream Mooncake): keep the blocks under the router's transfer id."""
        block_ids = self._allocate(num_tokens)
        timer = None
        if self.hold_seconds > 0:
            timer = asyncio.get_running_loop().call_later(self.hold_seconds, self._expire, transfer_id)
        stale = self._held.pop(transfer_id, None)
        if stale is not None and stale.timer is not None:
            stale.timer.cancel()
        self._held[transfer_id] = _Held(transfer_id, block_ids, num_tokens, timer)

    def _expire(self, request_id: str) -> None:
        if self._held.pop(request_id, None) is not None:
            self.expired += 1
            logger.info("kv: freed unclaimed blocks of %s after %.0f s", request_id, self.hold_seconds)

    def release(self, body: Any) -> tuple[int, str]:
        """Serve ``/sim/kv/pull``: (status, reason); frees the blocks on success."""
        if not isinstance(body, dict):
            return 400, "body must be a JSON object"
        # Upstream Mooncake names the blocks by the router's transfer id; D never saw P's block ids.
        by_transfer = "transfer_id" in body
        request_id = body.get("transfer_id") if by_transfer else body.get("remote_request_id")
        held = self._held.get(request_id) if isinstance(request_id, str) else None
        if held is None or not isinstance(request_id, str):
            return 404, f"no blocks held for {'transfer' if by_transfer else 'request'} {request_id!r}"
        if body.get("remote_engine_id") != self.engine_id:
            return 409, f"engine id {body.get('remote_engine_id')!r} is not {self.engine_id!r}"
        if _int(body.get("num_tokens")) != held.num_tokens:
            return 409, f"{body.get('num_tokens')!r} tokens requested, {held.num_tokens} held"
        if not by_transfer and body.get("remote_block_ids") != [held.block_ids]:
            return 409, "block ids do not match the held blocks"
        del self._held[request_id]
        if held.timer is not None:
            held.timer.cancel()
        self.pulled += 1
        return 200, "ok"

    # -- D, pull mode -----------------------------------------------------------------

    async def pull(self, params: dict[str, Any], num_tokens: int) -> None:
        """Fetch the blocks named by P's params; raise the KV-failure error if refused."""
        missing = [
            key
            for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids")
            if key not in params
        ]
        if missing:
            raise kv_failure(
                f"kv_transfer_params lack {', '.join(missing)}; they must be the ones a prefill "
                "instance returned, verbatim (a real decode engine crashes on these)"
            )
        host, port = params["remote_host"], _int(params["remote_port"])
        if not isinstance(host, str) or port is None:
            raise kv_failure("remote_host / remote_port are not a host name and a port")
        request_id = params["remote_request_id"]
        body = {
            "remote_engine_id": params["remote_engine_id"],
            "remote_request_id": request_id,
            "remote_block_ids": params["remote_block_ids"],
            "num_tokens": num_tokens,
        }
        try:
            response = await self._http().post(f"http://{host}:{port}/sim/kv/pull", json=body)
        except httpx.HTTPError as exc:
            raise kv_failure(f"cannot reach {host}:{port}: {exc!r}") from None
        if response.status_code != 200:
            raise kv_failure(f"{host}:{port} refused request {request_id!r}: {_reason(response)}")

    async def pull_transfer(self, params: dict[str, Any], num_tokens: int) -> None:
        """Router-supplied pull (upstream Mooncake): fetch the blocks P holds under ``transfer_id``
        through P's bootstrap address; raise the KV-failure error if refused."""
        addr = params["remote_bootstrap_addr"]
        if not isinstance(addr, str) or not addr.startswith(("http://", "https://")):
            # The real D GETs remote_bootstrap_addr + "/query": it must be a base URL.
            raise kv_failure(f"remote_bootstrap_addr {addr!r} is not an http(s) base URL")
        body = {
            "transfer_id": params["transfer_id"],
            "remote_engine_id": params["remote_engine_id"],
            "num_tokens": num_tokens,
        }
        try:
            response = await self._http().post(addr.rstrip("/") + "/sim/kv/pull", json=body)
        except httpx.HTTPError as exc:
            raise kv_failure(f"cannot reach bootstrap {addr}: {exc!r}") from None
        if response.status_code != 200:
            raise kv_failure(f"{addr} refused transfer {params['transfer_id']!r}: {_reason(response)}")

    # -- D, push mode -----------------------------------------------------------------

    async def await_push(self, params: dict[str, Any], engine_request_id: str, num_tokens: int) -> bool:
        """Announce the request to the metaserver, then wait for P's push.

        True when the KV arrived, False when :meth:`abort_waiting` released the request.
        """
        metaserver = params.get("metaserver")
        if not isinstance(metaserver, str) or not metaserver.startswith(("http://", "https://")):
            raise kv_failure("push mode needs kv_transfer_params.metaserver, an http(s) URL")
        block_ids = self._allocate(num_tokens)
        pushed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = _Waiting(engine_request_id, block_ids, num_tokens, pushed)
        self._waiting[engine_request_id] = waiting
        try:
            # vllm-ascend's D builds this dict itself: the received params are not echoed.
            announce = {
                "token_ids": [],
                "request_id": engine_request_id,
                "do_remote_prefill": False,
                "do_remote_decode": True,
                "remote_block_ids": [block_ids],
                "remote_block_size": [self.block_size],
                "remote_engine_id": self.engine_id,
                "remote_host": self.host,
                "remote_port": self.port,
                "remote_tp_size": 1,
                "remote_pcp_size": 1,
                "remote_dcp_size": 1,
                "remote_cached_tokens": 0,
            }
            try:
                response = await self._http().post(metaserver, json=announce)
            except httpx.HTTPError as exc:
                raise kv_failure(f"metaserver {metaserver} unreachable: {exc!r}") from None
            if not 200 <= response.status_code < 300:
                raise kv_failure(f"metaserver answered {response.status_code}: {_reason(response)}")
            try:
                async with asyncio.timeout(self.push_timeout_seconds):
                    await pushed
            except TimeoutError:
                raise kv_failure(
                    f"no KV pushed for {engine_request_id} within {self.push_timeout_seconds:g} s"
                ) from None
            return not waiting.aborted
        finally:
            # Only our own entry: a retry under the same id may have replaced it.
            if self._waiting.get(engine_request_id) is waiting:
                del self._waiting[engine_request_id]
            if not pushed.done():
                pushed.cancel()

    def abort_waiting(self, engine_request_id: str) -> bool:
        """Release a request waiting for a push (an abort); True if one was waiting."""
        waiting = self._waiting.get(engine_request_id)
        if waiting is None or waiting.pushed.done():
            return False
        waiting.aborted = True
        # Wakes await_push now, even while the metaserver call is still in flight.
        waiting.pushed.set_result(None)
        return True

    def accept_push(self, body: Any) -> tuple[int, str]:
        """Serve ``/sim/kv/push``: (status, reason); wakes the waiting request on success."""
        if not isinstance(body, dict):
            return 400, "body must be a JSON object"
        request_id = body.get("request_id")
        waiting = self._waiting.get(request_id) if isinstance(request_id, str) else None
        if waiting is None or waiting.pushed.done():
            return 404, f"no request {request_id!r} is waiting for a push"
        if body.get("remote_engine_id") != self.engine_id:
            return 409, f"engine id {body.get('remote_engine_id')!r} is not {self.engine_id!r}"
        if _int(body.get("num_tokens")) != waiting.num_tokens:
            return 409, f"{body.get('num_tokens')!r} tokens pushed, {waiting.num_tokens} expected"
        if body.get("remote_block_ids") != [waiting.block_ids]:
            return 409, "block ids do not match the allocated blocks"
        waiting.pushed.set_result(None)
        self.pushed += 1
        return 200, "ok"

    # -- P, push mode -----------------------------------------------------------------

    async def push(self, params: dict[str, Any], engine_request_id: str, num_tokens: int) -> None:
        """Push a finished prefill to the D named in ``params``; raise if D refuses.

        ``engine_request_id`` is P's own: D matches the push by it, so P must run under D's id.
        """
        if "remote_cached_tokens" not in params:
            # vllm-ascend's P indexes it (``params["remote_cached_tokens"]``): KeyError.
            raise kv_failure(
                "kv_transfer_params lack remote_cached_tokens; they must be D's metaserver callback, "
                "whole (a real layer-wise prefill engine raises KeyError on this)"
            )
        cached = _int(params["remote_cached_tokens"])
        if cached is None or not 0 <= cached <= num_tokens:
            raise kv_failure(f"remote_cached_tokens {params['remote_cached_tokens']!r} is not a token count")
        host, port = params.get("remote_host"), _int(params.get("remote_port"))
        if not isinstance(host, str) or port is None:
            raise kv_failure("push needs remote_host and remote_port of the decode instance")
        body = {
            "request_id": engine_request_id,
            "remote_engine_id": params.get("remote_engine_id"),
            "remote_block_ids": params.get("remote_block_ids"),
            "num_tokens": num_tokens - cached,
            "source_engine_id": self.engine_id,
        }
        try:
            response = await self._http().post(f"http://{host}:{port}/sim/kv/push", json=body)
        except httpx.HTTPError as exc:
            raise kv_failure(f"cannot reach {host}:{port}: {exc!r}") from None
        if response.status_code != 200:
            raise kv_failure(f"{host}:{port} refused the push: {_reason(response)}")


def _reason(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}"
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, str):
        return detail
    return f"HTTP {response.status_code}"
