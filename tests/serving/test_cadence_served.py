"""The derender cadence by time (``RenderConfig.stream_interval_ms``) through the real server.

Daphne, as ``make run`` starts it, over the fake upstreams on 127.0.0.1 (``served.py``) with
engines paced like a decoding GPU (``TOKEN_MS`` between events). The fake sidecar counts its
derender calls; the same stream is read with the interval off and on.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.serving.served import API_KEY, Fleet, fake_fleet

TOKENS = 60
TOKEN_MS = 5  # 60 events over at least 0.3 s
# Far above the pacing: a choice then makes a handful of calls however the machine is loaded,
# against one per event with the interval off (the fake sidecar answers in well under 5 ms).
INTERVAL_MS = 200


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fake_fleet(tmp_path_factory.mktemp("cadence"), tokens=TOKENS, token_ms=TOKEN_MS) as f:
        yield f


def set_interval_ms(fleet: Fleet, ms: int) -> None:
    db = Path(fleet.cfg.database_url.removeprefix("sqlite:///"))
    with sqlite3.connect(db) as conn:
        assert conn.execute("UPDATE serving_renderconfig SET stream_interval_ms = ?", (ms,)).rowcount == 1


# The coordinator reads the fleet for every request (a poll interval of 0 and a snapshot that is
# always stale), so the interval written behind the services' back is the next stream's.
EVERY_REQUEST = {"MOTOR_SNAPSHOT_POLL_MS": "0", "MOTOR_SNAPSHOT_TTL_MS": "0"}


def streamed(fleet: Fleet, base_url: str, ms: int) -> tuple[list[dict[str, Any]], int]:
    """The frames of one streamed chat through the coordinator at ``base_url`` with
    ``stream_interval_ms`` ms, and the derender calls the sidecar saw for it."""
    set_interval_ms(fleet, ms)
    before = fleet.stats()["derender_calls"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": TOKENS, "stream_options": {"include_usage": True}}
    raw = b""
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200, response.read()
        for piece in response.iter_bytes():
            raw += piece
    calls = fleet.stats()["derender_calls"] - before
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"data: [DONE]") == 1
    frames = [json.loads(b[6:]) for b in raw.decode().split("\n\n") if b.startswith("data: ") and b != "data: [DONE]"]
    return frames, calls


def text_and_usage(frames: list[dict[str, Any]]) -> tuple[str, dict[str, Any] | None, str | None]:
    text, usage, finish = "", None, None
    for f in frames:
        assert "error" not in f, f
        if f.get("usage") and not f.get("choices"):
            usage = f["usage"]
        for c in f.get("choices") or []:
            text += (c.get("delta") or {}).get("content") or ""
            finish = c.get("finish_reason") or finish
    return text, usage, finish


def test_a_paced_stream_makes_fewer_derender_calls_with_a_time_interval_and_says_the_same(fleet: Fleet) -> None:
    with fleet.coordinator("daphne", EVERY_REQUEST) as (cfg, _pid):
        off_frames, off_calls = streamed(fleet, cfg.coordinator_url, 0)
        on_frames, on_calls = streamed(fleet, cfg.coordinator_url, INTERVAL_MS)
    off, on = text_and_usage(off_frames), text_and_usage(on_frames)
    assert on == off and off[1] is not None and off[1]["completion_tokens"] == TOKENS and off[0]
    # Off: a call per engine event (the sidecar keeps up with 5 ms events, so coalescing merges
    # next to nothing), plus the usage chunk's. On: the first token, one run per 200 ms, the
    # finish and the usage chunk.
    assert off_calls >= TOKENS // 2, off_calls
    assert on_calls < off_calls // 3, (on_calls, off_calls)
    assert len(on_frames) == on_calls and len(off_frames) == off_calls  # a frame per call, nothing else
    # That a choice's first token is never held back is proven against a fake clock (test_coalesce.py):
    # here the first read may bring two events on a loaded machine, and merges them as it should.
