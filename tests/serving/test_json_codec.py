"""The upstream client's JSON helpers: orjson where it can, the standard library where it refuses."""

from __future__ import annotations

import json

from serving.pipeline import json_codec


def test_json_helpers_take_what_orjson_refuses() -> None:
    big = 2**70
    assert json.loads(json_codec.dumps({"n": big, 7: "int key"})) == {"n": big, "7": "int key"}
    assert json_codec.loads(b'{"lp": -Infinity}') == {"lp": float("-inf")}
    assert json_codec.loads(b'{"a": [1, 2]}') == {"a": [1, 2]}
