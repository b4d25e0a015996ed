"""JSON for the coordinator's wire: orjson, with the standard library for what orjson refuses.

One codec for every body the coordinator writes or reads: upstream requests and replies
(``http11.py``), SSE frames and the stream's scrub (``sse.py``), the Messages and Responses
events (``apis/``) and the edge's answers (``serving/edge/asgi.py``): compact, non-ASCII as
UTF-8, as vLLM's server writes them (pydantic's ``model_dump_json``).
"""

from __future__ import annotations

import json as stdlib_json
from array import array
from typing import Any

import orjson

__all__ = ["dumps", "loads"]


def dumps(payload: Any) -> bytes:
    """JSON bytes of a request body: orjson, or the standard library for what orjson refuses
    (integers past 64 bits). A ``bytes`` value in ``payload`` is JSON already, written in as it is
    (a derender's kept ``stream_state``, derender/payload.py)."""
    try:
        return orjson.dumps(payload, default=_orjson_default, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return stdlib_json.dumps(payload, default=_stdlib_default, separators=(",", ":"), ensure_ascii=False).encode()


def _orjson_default(value: Any) -> Any:
    # A prompt's ids are kept as ``array("i")`` (render/tokenization.py): sent as a JSON list.
    if isinstance(value, array):
        return value.tolist()
    if isinstance(value, bytes):
        return orjson.Fragment(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _stdlib_default(value: Any) -> Any:
    if isinstance(value, array):
        return value.tolist()
    if isinstance(value, bytes):
        return loads(value)  # the standard library has no way to write JSON in as it is
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def loads(raw: bytes | str) -> Any:
    """Parse an upstream's JSON; the standard library takes what orjson refuses (``NaN``,
    ``-Infinity``: Python's encoder writes them, and vLLM's logprobs can be ``-inf``)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return stdlib_json.loads(raw)
