"""The upstream client's JSON helpers: orjson where it can, the standard library where it refuses."""

from __future__ import annotations

import json

from serving.pipeline import http11


def test_json_helpers_take_what_orjson_refuses() -> None:
    big = 2**70
    assert json.loads(http11.dumps({"n": big, 7: "int key"})) == {"n": big, "7": "int key"}
    assert http11.loads(b'{"lp": -Infinity}') == {"lp": float("-inf")}
    assert http11.loads(b'{"a": [1, 2]}') == {"a": [1, 2]}
