"""Streaming through the coordinator with the real render sidecar and two simulated engines.

Faults are injected on the sims through ``POST /sim/faults``; every sim in the fleet has the same
seed, so output is a function of the context and a relayed stream must be text-identical to the
fault-free one. Each test ends by waiting for both sims and the coordinator to hold nothing.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from motorsite import stack
from motorsite.supervisor import Supervisor, free_port

from .conftest import API_KEY

pytestmark = pytest.mark.timeout(900)  # the session starts the real render sidecar

IDLE_WAIT_S = 10.0  # an upper bound for cleanup to finish, never a timing assertion


@pytest.fixture(scope="module")
def relay_stack(sim_stack: stack.StackConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackConfig]:
    """A coordinator of its own over the sim fleet: breakers that never open here (faults are
    armed on both sims, so each test fails both once), a short stall timeout, and coalescing off
    so derender runs chunk by chunk (the sims send their events back to back)."""
    db = tmp_path_factory.mktemp("relaydb") / "coordinator.sqlite3"
    cfg = replace(
        sim_stack, coordinator_port=free_port(), log_dir=sim_stack.log_dir / "relay",
        database_url=f"sqlite:///{db}",
        extra_env={**sim_stack.extra_env, "MOTOR_BREAKER_THRESHOLD": "1000", "MOTOR_STREAM_CHUNK_TIMEOUT_MS": "1500"},
    )
    stack.prepare_database(cfg)
    with sqlite3.connect(db) as conn:
        assert conn.execute("UPDATE serving_renderconfig SET derender_coalesce = 0").rowcount == 1
    with Supervisor([stack.coordinator_spec(cfg)]):
        yield cfg


@pytest.fixture
def sims(relay_stack: stack.StackConfig) -> Iterator[list[str]]:
    urls = relay_stack.engine_urls
    for url in urls:
        httpx.delete(url + "/sim/faults")
    yield urls
    for url in urls:
        httpx.delete(url + "/sim/faults")
        httpx.delete(url + "/sim/script")
    assert_idle(relay_stack)


def assert_idle(cfg: stack.StackConfig) -> None:
    """Nothing running on either sim, nothing in flight in the coordinator."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        stats = [httpx.get(u + "/sim/stats").json() for u in cfg.engine_urls]
        metrics = httpx.get(cfg.coordinator_url + "/metrics").text
        # Admission drops an instance's series when its last lease returns, so an idle instance
        # has none; the family itself must be there, or a renamed gauge would read as idle.
        assert "# TYPE motor_engine_in_flight_tokens gauge" in metrics, "no in-flight gauge in /metrics"
        inflight = [line for line in metrics.splitlines()
                    if line.startswith("motor_engine_in_flight_tokens{") and float(line.split()[-1]) != 0]
        busy = [s for s in stats if s["running"] or s["active_streams"]]
        if not busy and not inflight:
            return
        assert time.monotonic() < deadline, (busy, inflight)
        time.sleep(0.05)


def counters(urls: list[str]) -> list[tuple[int, int]]:
    """Each sim's (requests received, streams the client hung up on), in fleet order.

    A sim counts a disconnect only for a stream it did not end itself: a drop or an error event
    is the sim ending the stream, a stall ends when the coordinator gives up and hangs up.
    """
    return [(s["requests_received"], s["disconnects"]) for s in (httpx.get(u + "/sim/stats").json() for u in urls)]


def assert_moved(urls: list[str], before: list[tuple[int, int]], expected: list[tuple[int, int]]) -> None:
    """The sims' counters moved by ``expected`` (sorted per sim: which sim went first is placement's
    choice). A sim counts a disconnect when its stream's generator is closed, which may land just
    after the client has its last byte, so this waits up to IDLE_WAIT_S for it."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        moved = sorted((r - r0, d - d0) for (r, d), (r0, d0) in zip(counters(urls), before, strict=True))
        if moved == expected or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert moved == expected


def client(cfg: stack.StackConfig) -> openai.OpenAI:
    return openai.OpenAI(base_url=cfg.coordinator_url + "/v1", api_key=API_KEY, max_retries=0)


def arm(urls: list[str], mode: str, tokens: int = 0, count: int = 1) -> None:
    for url in urls:
        r = httpx.post(url + "/sim/faults", json={"mode": mode, "tokens": tokens, "status": 500, "count": count})
        r.raise_for_status()


def stream_chat(c: openai.OpenAI, prompt: str, max_tokens: int, **extra: Any) -> tuple[str, Any, int]:
    text, usage, roles = [], None, 0
    for chunk in c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body=extra or None,
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles += choice.delta.role is not None
            text.append(choice.delta.content or "")
    return "".join(text), usage, roles


@pytest.mark.parametrize(("mode", "tokens"), [
    ("drop_after_tokens", 0), ("drop_after_tokens", 1), ("drop_after_tokens", 9),
    ("error_event_after_tokens", 0), ("error_event_after_tokens", 4), ("stall_after_tokens", 3),
], ids=["drop@0", "drop@1", "drop@9", "error-event@0", "error-event@4", "stall@3"])
def test_a_relayed_stream_is_text_identical_with_the_right_usage(
    relay_stack: stack.StackConfig, sims: list[str], mode: str, tokens: int,
) -> None:
    c = client(relay_stack)
    prompt = f"relay {mode} {tokens}"
    before = counters(sims)
    # ignore_eos: all 24 tokens, so every fault fires inside the output. A fault armed past an
    # early eos fires after the last choice finished, and the stream ends with no relay at all.
    reference, ref_usage, ref_roles = stream_chat(c, prompt, 24, ignore_eos=True)
    assert ref_usage.completion_tokens == 24 and ref_roles == 1
    assert_moved(sims, before, [(0, 0), (1, 0)])  # fault-free: one request, finished

    # Armed once on both sims: the first attempt fails, the first relay fails too, the second
    # relay (back on the first sim) finishes: two relays, each from the committed state.
    arm(sims, mode, tokens)
    before = counters(sims)
    text, usage, roles = stream_chat(c, prompt, 24, ignore_eos=True)

    # One sim took the first attempt and the second relay, the other the first relay; on a
    # stall each was hung up on once. Identical text alone would also come from no fault.
    hung_up = int(mode == "stall_after_tokens")
    assert_moved(sims, before, [(1, hung_up), (2, hung_up)])
    assert text == reference
    assert roles == 1  # once per choice per request, not per attempt
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        ref_usage.prompt_tokens, ref_usage.completion_tokens, ref_usage.total_tokens)


def test_an_engine_400_is_a_proper_status_not_relayed(relay_stack: stack.StackConfig, sims: list[str]) -> None:
    c = client(relay_stack)
    for url in sims:
        httpx.post(url + "/sim/faults", json={"mode": "http_status", "status": 400, "count": 1}).raise_for_status()
    before = counters(sims)
    with pytest.raises(openai.BadRequestError):
        stream_chat(c, "bad request", 8)
    assert_moved(sims, before, [(0, 0), (1, 0)])  # one engine asked, the other never


def test_a_client_that_hangs_up_mid_stream_frees_the_engine_at_once(
    relay_stack: stack.StackConfig, sims: list[str],
) -> None:
    """Through Daphne and the /v1 edge: the client closes its connection after the first chunk.

    Armed on both sims, a stall would be relayed after ``MOTOR_STREAM_CHUNK_TIMEOUT_MS`` and the
    relay would reach the other sim: only the hang-up cancelling the request in the coordinator
    leaves the count at one engine request, hung up on once.
    """
    hang_up(relay_stack, sims)


def test_under_uvicorn_a_client_that_hangs_up_frees_the_engine_too(
    relay_stack: stack.StackConfig, sims: list[str],
) -> None:
    """``MOTOR_SERVER=uvicorn``: the same coordinator and database under uvicorn, the same proof."""
    cfg = replace(relay_stack, server="uvicorn", coordinator_port=free_port(), log_dir=relay_stack.log_dir / "uvicorn")
    cfg.log_dir.mkdir(exist_ok=True)
    with Supervisor([replace(stack.coordinator_spec(cfg), name="coordinator-uvicorn")]):
        hang_up(cfg, sims)


def hang_up(cfg: stack.StackConfig, sims: list[str]) -> None:
    arm(sims, "stall_after_tokens", tokens=2)
    before = counters(sims)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hang up"}], "max_tokens": 24, "stream": True}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=cfg.coordinator_url, headers=auth, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            assert next(response.iter_raw()).startswith(b"data: {")
        # Leaving the block closes the unread response's connection: the server reports http.disconnect.
    assert_moved(sims, before, [(0, 0), (1, 1)])
    assert_idle(cfg)
    # Still one request once everything is idle: no relay started after the client left.
    assert sorted((r - r0, d - d0) for (r, d), (r0, d0) in zip(counters(sims), before, strict=True)) == [(0, 0), (1, 1)]


def _byte_tokens(model_dir: str, text: str) -> list[int]:
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).encode(text).ids


@pytest.mark.parametrize("relay", [False, True], ids=["plain", "relay-inside-a-character"])
def test_a_multibyte_character_split_across_chunks_derenders_whole(
    relay_stack: stack.StackConfig, sims: list[str], relay: bool,
) -> None:
    output = _byte_tokens(relay_stack.model_dir, "é x🙂")
    assert len(output) > 4  # byte tokens: é is two, 🙂 four
    prompt_ids = [100, 200, 300, 400, 500 + int(relay)]  # the tiny model has a 4096-id vocabulary
    for url in sims:
        httpx.post(url + "/sim/script", json={"prompt_token_ids": prompt_ids, "output_token_ids": output,
                                              "match": "exact"}).raise_for_status()
    c = client(relay_stack)

    def run() -> list[str]:
        return [
            chunk.choices[0].text
            for chunk in c.completions.create(model="tiny", prompt=prompt_ids, max_tokens=len(output), stream=True)
            if chunk.choices
        ]

    if relay:
        arm(sims, "drop_after_tokens", 1)  # between the two bytes of é, then after the second
    before = counters(sims)
    pieces = run()
    assert_moved(sims, before, [(1, 0), (2, 0)] if relay else [(0, 0), (1, 0)])  # relay: two dropped attempts
    assert "".join(pieces) == "é x🙂"
    assert not any("\ufffd" in p for p in pieces)
    assert len([p for p in pieces if p]) >= 3  # really streamed in pieces, not one chunk
