"""Client keys for ``/v1``, checked against the fleet snapshot: no database query per request.

Closed unless opened on purpose: a request needs a key unless ``MOTOR_OPEN_ACCESS`` is true.
Keys are the snapshot's client key records (stored as sha256, revocable in the admin); until the
first client key record exists, the plain keys of ``MOTOR_API_KEYS`` are used instead. Once any
client record exists (even a revoked one) only records count, so revoking the last key never
reopens ``/v1``; deleting every record leaves ``MOTOR_API_KEYS`` (if set), and with neither
``/v1`` answers 401. Admin keys (``/api``) never open ``/v1``.

The key comes in ``Authorization: Bearer <key>`` (the ``openai`` client's) or, when that is
absent, in ``x-api-key`` (the ``anthropic`` client's default), on every ``/v1`` route.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from serving.edge.asgi import Scope, header
from serving.pipeline.errors import Unauthorized
from serving.pipeline.flow_control.rate_limit import KeyLimit
from serving.pipeline.request_checks import KeyPolicy
from serving.pipeline.request_context import NO_GRANT, KeyGrant
from serving.pipeline.snapshot import FleetSnapshot

INVALID_KEY = "Missing or invalid API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`."


def chosen_key(authorization: bytes | None, api_key: bytes | None) -> bytes:
    """The client key of a request's first ``Authorization`` and ``x-api-key`` headers: the token
    of ``Bearer <token>`` (scheme case-insensitive), else ``x-api-key``, else b"". The front door
    reads a head with this too, so both decide alike."""
    if authorization is not None and authorization[:7].lower() == b"bearer ":
        token = authorization[7:].strip()
        if token:
            return token
    return (api_key or b"").strip()


def client_token(scope: Scope) -> bytes:
    return chosen_key(header(scope, b"authorization"), header(scope, b"x-api-key"))


def is_client_key(token: bytes, snapshot: FleetSnapshot, *, env_keys: Sequence[str]) -> bool:
    """Whether ``token`` opens /v1, as ``authenticate`` decides, without its grant
    (the front door asks this before a request's body is read)."""
    if not token or not token.isascii():
        return False
    if snapshot.client_keys_managed:
        return hashlib.sha256(token).hexdigest() in snapshot.client_keys
    return any(hmac.compare_digest(token, k.encode()) for k in env_keys)


def authenticate(scope: Scope, snapshot: FleetSnapshot, *, env_keys: Sequence[str], open_access: bool) -> KeyGrant:
    """What the request's key grants (its policy and token rate limit), or raise ``Unauthorized`` (401).

    A token that is not ASCII is no key of ours (keys are generated ASCII): 401, never an
    encoding error. With open access a known key still brings its rate limit. Returned, never
    bound to a context: a key's grant cannot carry over to another request.
    """
    token = client_token(scope)
    if token and not token.isascii():
        token = b""
    if snapshot.client_keys_managed:
        # A dict lookup by sha256 of the token: the hash hides timing of the stored key bytes.
        digest = hashlib.sha256(token).hexdigest() if token else ""
        key = snapshot.client_keys.get(digest) if digest else None
        if key is not None:
            # The limit is charged once the token count is known (``Response.charge``).
            limited = key.tokens_per_minute
            return KeyGrant(KeyPolicy(allow_priority=key.allow_priority),
                            KeyLimit(digest, key.name, limited) if limited else None)
    elif token and any(hmac.compare_digest(token, k.encode()) for k in env_keys):
        return NO_GRANT
    if not open_access:
        raise Unauthorized(INVALID_KEY)
    return NO_GRANT
