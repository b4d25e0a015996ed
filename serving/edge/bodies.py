"""JSON request bodies: accepted only when everything downstream can encode them again.

Python's ``json`` accepts ``NaN`` and ``Infinity``, lone surrogates (``"\\ud800"``) and any
nesting its recursion allows; httpx then refuses to encode the body for render or an engine, or
the standard library's encoder hits the recursion limit: a 500 for the client's mistake. orjson
parses strict RFC 8259 (no NaN or Infinity, no number that overflows a double, UTF-8 without
surrogates, at most 1024 levels), and the depth bound here is tighter than any encoder's.
"""

from __future__ import annotations

from typing import Any

import orjson

from serving.pipeline.errors import RequestError


def parse_object(raw: bytes, *, max_depth: int) -> dict[str, Any]:
    """The body as a dict; raises ``RequestError`` (400) for anything else."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"Invalid JSON in request body: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object.")
    # Counting brackets runs at C speed and bounds the depth from above: only a body with more
    # brackets than the bound (long tool lists, many messages) pays for walking its tree.
    if raw.count(b"[") + raw.count(b"{") > max_depth and nests_deeper(body, max_depth):
        raise RequestError(f"The request body nests deeper than {max_depth} levels.")
    return body


def nests_deeper(value: dict[str, Any] | list[Any], limit: int) -> bool:
    """Whether ``value`` has containers more than ``limit`` levels deep (itself is level 1)."""
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False
