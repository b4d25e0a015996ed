"""What a stream whose client reads nothing keeps alive in the coordinator, through the real server.

A silent client's stream stays suspended in every layer of its response for as long as it is held
back (issue 31's 64 KiB a stream, ``bench/slow_reader.py``). An async generator weighs its frame
and asyncio's weak-set entry for it, so the response's chain per prompt (the prompt's chunks
across attempts, the session's derender, the event reader, the engine's events and their SSE
parsing) is made of plain async iterators: what is left as async generators is the response's
own, one per stream. Likewise each engine attempt's holds (its admission lease's release, its load
hold) are kept as small objects, not contextlib's closures and generator-based context managers.
The coordinator runs as ``make run`` starts it under ``tests/serving/counted_server.py``, which
counts what is alive on a signal.
"""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path
from typing import Iterator

import pytest

from motorsite import stack
from tests.serving.served import ROOT, Fleet, fake_fleet, signal_for_json
from tests.serving.test_silent_client import silent_post
from tests.still import wait_still

STREAMS = 2
PROMPTS = 3  # each stream's prompts: a generator per prompt would be alive PROMPTS times a stream
TOKENS = 1000  # each engine stream's length: far more than the kernel's buffers take, padded
PAD = 16 * 1024  # bytes of text added to every derendered chunk: the client's buffers fill at once
POLL_S = 0.25
STILL_POLLS = 4  # the streams are blocked: no derender call over this many polls
WAIT_S = 60.0  # an upper bound for a state to be reached, never a timing assertion


@pytest.fixture(scope="module", params=[False, True], ids=["coalescing-off", "coalescing-on"])
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fake_fleet(tmp_path_factory.mktemp("held"), tokens=TOKENS, pad_bytes=PAD, coalesce=request.param) as f:
        yield f


def counted_coordinator(
    fleet: Fleet, server: str, count_file: Path,
) -> contextlib.AbstractContextManager[tuple[stack.StackConfig, int]]:
    """``fleet``'s coordinator under ``server``, run by ``counted_server.py``."""
    env = {"MOTOR_TEST_COUNT_FILE": str(count_file), "MOTOR_CLIENT_STALL_S": "3600"}
    return fleet.coordinator(server, env, wrapper=ROOT / "tests" / "serving" / "counted_server.py")


def alive(pid: int, count_file: Path) -> dict[str, dict[str, int]]:
    """What ``counted_server.py`` counts in the coordinator now, by kind and site."""
    return signal_for_json(pid, count_file, WAIT_S)


def silent_client(port: int) -> socket.socket:
    """A client that sends a streaming completion of ``PROMPTS`` prompts and then reads nothing."""
    body = json.dumps({"model": "tiny", "prompt": [f"p{i}" for i in range(PROMPTS)], "stream": True,
                       "max_tokens": TOKENS}).encode()
    return silent_post(port, "/v1/completions", body)


def wait_blocked(fleet: Fleet, streams: int) -> None:
    """Poll until the coordinator has derendered for every prompt and then stopped."""
    wait_still(lambda: fleet.stats()["derender_calls"], polls=STILL_POLLS, poll_s=POLL_S, wait_s=WAIT_S,
               never="the streams never stopped", settled=lambda calls: calls >= streams * PROMPTS)


@pytest.fixture(scope="module", params=stack.SERVERS)
def grown(request: pytest.FixtureRequest, fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, int]]:
    """What ``STREAMS`` silent streams of ``PROMPTS`` prompts each keep alive in the coordinator
    under the server ``request.param``, once they are held back: by kind and site, what more there
    is than before they opened."""
    count_file = tmp_path_factory.mktemp("counted") / "alive.json"
    with counted_coordinator(fleet, request.param, count_file) as (cfg, pid):
        before = alive(pid, count_file)
        clients = [silent_client(cfg.coordinator_port) for _ in range(STREAMS)]
        try:
            wait_blocked(fleet, STREAMS)
            held = alive(pid, count_file)
        finally:
            for c in clients:
                c.close()
    return {kind: {site: n - before[kind].get(site, 0) for site, n in sites.items() if n > before[kind].get(site, 0)}
            for kind, sites in held.items()}


def test_a_held_stream_keeps_no_async_generator_per_prompt(grown: dict[str, dict[str, int]]) -> None:
    assert grown["async_generators"], "no stream was held (nothing of the response is alive)"
    # One a stream (the response's own frames, its fan-in) at most; none for each prompt.
    per_prompt = {site: n for site, n in grown["async_generators"].items() if n > STREAMS}
    assert not per_prompt, per_prompt


def test_a_held_stream_keeps_no_contextlib_closure_or_generator_context_manager_per_prompt(
    grown: dict[str, dict[str, int]],
) -> None:
    assert grown["async_generators"], "no stream was held (nothing of the response is alive)"
    per_prompt = {f"{kind} {site}": n for kind in ("context_managers", "exit_callbacks")
                  for site, n in grown[kind].items() if n > STREAMS}
    assert not per_prompt, per_prompt
