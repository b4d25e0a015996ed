"""Streaming relay, fan-out failures, derender faults and disconnects, against fake upstreams.

The fake engine here is deterministic in its context like enginesim: the next token is a function
of prompt + output so far, so a relayed stream (replay prompt = prompt + committed ids) must give
exactly the fault-free text. Faults are scripted per engine call; every test ends with the leak
check (load, admission, open engine streams, stray tasks).
"""

from __future__ import annotations

import asyncio
import gc
import json
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import httpx
import pytest

from serving.pipeline.derender.session import StreamSettings
from serving.pipeline.engine.client import EngineClient
from serving.pipeline.placement.load import LoadTracker
from serving.pipeline.placement.scheduler import Scheduler
from serving.pipeline.render.client import RenderClient
from serving.pipeline.request_context import RequestContext
from serving.pipeline.resilience.breaker import BreakerBoard
from serving.pipeline.response import Response
from serving.pipeline.service import EventStream, ServingPipeline
from tests.serving.fakes import (
    CHAT_PROMPT,
    MODEL,
    RENDER_URL,
    FakeUpstreams,
    SSEBody,
    completion_prompt_ids,
    error_json,
    fleet_snapshot,
    parse_frames,
)
from tests.serving.leaks import assert_nothing_held
from tests.serving.loopback import HANG_DEADLINE_S, LoopbackClient, hang

WATCHDOG_S = 5.0


def next_token(context: list[int]) -> int:
    return 3000 + (sum(context) * 7 + len(context) * 13) % 500


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    for _ in range(max_tokens):
        out.append(next_token(prompt + out))
    return out


def text(ids: list[int]) -> str:
    return "".join(f"<{t}>" for t in ids)


@dataclass
class Fault:
    mode: str  # raise | eof | hang | error500 | error400 | status500
    after: int = 0  # tokens sent before the fault


@dataclass
class ContextEngines:
    """Both fake engines generate ``next_token`` streams; ``faults[host]`` fail their next calls."""

    upstreams: FakeUpstreams
    faults: dict[str, list[Fault]] = field(default_factory=dict)
    hang: asyncio.Event = field(default_factory=asyncio.Event)
    opened: asyncio.Event = field(default_factory=asyncio.Event)

    def install(self) -> None:
        for host in ("e1", "e2"):
            self.upstreams.override(host, "generate", self._answer(host))

    def _answer(self, host: str) -> Callable[[httpx.Request, Any], httpx.Response]:
        def answer(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
            queue = self.faults.get(host) or []
            fault = queue.pop(0) if queue else None
            if fault is not None and fault.mode == "status500":
                return httpx.Response(500, json=error_json(500, "boom", "InternalServerError"))
            return self._sse(body, fault)

        return answer

    def _sse(self, body: dict[str, Any], fault: Fault | None) -> httpx.Response:
        rid = body["request_id"]
        prompt = list(body["token_ids"])
        params = body["sampling_params"]
        max_tokens = int(params.get("max_tokens", 16))
        n = int(params.get("n", 1))
        engine_rid = "generate-tokens-" + rid
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        upstreams = self.upstreams

        def event(index: int, token: int, finish: str | None) -> bytes:
            e = {"request_id": engine_rid, "usage": None, "output_mode": "tokens",
                 "choices": [{"index": index, "finish_reason": finish, "stop_reason": None, "token_ids": [token],
                              "routed_experts": None, "sampling_mask": None, "weight_versions": None, "logprobs": None}]}
            return ("data: " + json.dumps(e) + "\n\n").encode()

        async def agen() -> AsyncIterator[bytes]:
            self.opened.set()
            outs: list[list[int]] = [[] for _ in range(n)]
            sent = 0
            for pos in range(max_tokens):
                for j in range(n):
                    if fault is not None and sent == fault.after:
                        async for b in self._fail(fault):
                            yield b
                        return
                    # Choices differ from their first token on, then follow their own context,
                    # so a choice relayed alone (n 1) from its committed ids goes on as it would have.
                    token = next_token(prompt + outs[j]) + (j if not outs[j] else 0)
                    outs[j].append(token)
                    sent += 1
                    yield event(j, token, "length" if pos == max_tokens - 1 else None)
                    await asyncio.sleep(0)
            if fault is not None and sent == fault.after:  # "after k" fires at the end if k >= output
                async for b in self._fail(fault):
                    yield b
                return
            if include_usage:
                usage = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens * n,
                         "total_tokens": len(prompt) + max_tokens * n}
                yield ("data: " + json.dumps({"request_id": engine_rid, "usage": usage, "output_mode": "tokens",
                                              "choices": []}) + "\n\n").encode()
            yield b"data: [DONE]\n\n"

        upstreams.open_streams.add(rid)

        def on_close() -> None:
            upstreams.open_streams.discard(rid)
            upstreams.closed_streams.append(rid)

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=SSEBody(agen(), on_close))

    async def _fail(self, fault: Fault) -> AsyncIterator[bytes]:
        if fault.mode == "raise":
            raise httpx.ReadError("peer closed connection")
        if fault.mode == "hang":
            await self.hang.wait()
        elif fault.mode in ("error500", "error400"):
            code = 500 if fault.mode == "error500" else 400
            err = error_json(code, "engine failed mid-stream", "InternalServerError" if code == 500 else "BadRequestError")
            yield ("data: " + json.dumps(err) + "\n\n").encode()
            yield b"data: [DONE]\n\n"
        # eof: end without [DONE]


@pytest.fixture
def scheduler() -> Scheduler:
    return Scheduler(LoadTracker(), breakers=BreakerBoard())


@pytest.fixture(autouse=True)
async def no_leaks(scheduler: Scheduler, upstreams: FakeUpstreams):
    before = asyncio.all_tasks()
    yield
    await assert_nothing_held(scheduler, before, upstreams.open_streams)


@pytest.fixture
def engines(upstreams: FakeUpstreams) -> ContextEngines:
    e = ContextEngines(upstreams)
    e.install()
    return e


@pytest.fixture
def pipeline(mock_client: LoopbackClient, scheduler: Scheduler) -> ServingPipeline:
    return ServingPipeline(
        fleet_snapshot(), RenderClient(mock_client, RENDER_URL, 5.0), EngineClient(mock_client), scheduler,
        stream_settings=StreamSettings(chunk_timeout_s=2.0, max_relays=2, derender_retries=1),
    )


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "stream": True, "max_tokens": 8,
            **extra}


async def drain(stream: Any) -> list[Any]:
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    async with asyncio.timeout(WATCHDOG_S):
        raw = b"".join([f async for f in stream.frames()])
    return parse_frames(raw)


def content(frames: list[Any]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in frames
                   if isinstance(c, dict) and c.get("choices"))


def roles(frames: list[Any]) -> int:
    return sum(1 for c in frames if isinstance(c, dict) and c.get("choices") and c["choices"][0]["delta"].get("role"))


EXPECTED = reference_output(CHAT_PROMPT, 8)
USAGE = {"prompt_tokens": len(CHAT_PROMPT), "completion_tokens": 8, "total_tokens": len(CHAT_PROMPT) + 8}


async def test_fault_free_reference(pipeline: ServingPipeline, engines: ContextEngines) -> None:
    frames = await drain(await pipeline.chat(chat(stream_options={"include_usage": True}), "r0"))
    assert content(frames) == text(EXPECTED)
    assert frames[-2]["usage"] | USAGE == frames[-2]["usage"] and frames[-1] == "[DONE]"
    assert roles(frames) == 1


@pytest.mark.parametrize("fault", [
    Fault("raise", 0), Fault("raise", 1), Fault("raise", 5), Fault("eof", 3), Fault("error500", 1),
    Fault("error500", 7), Fault("hang", 4), Fault("raise", 8),
    Fault("error500", 8),
], ids=["drop@0", "drop@1", "drop@5", "eof@3", "error-event@1", "error-event@7", "stall@4", "drop@end", "error@end"])
async def test_a_relayed_stream_equals_the_fault_free_stream(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams, scheduler: Scheduler, fault: Fault,
) -> None:
    if fault.mode == "hang":
        pipeline.stream_settings = StreamSettings(chunk_timeout_s=0.2, max_relays=2)
    engines.faults["e1"] = [fault]

    frames = await drain(await pipeline.chat(chat(stream_options={"include_usage": True}), "r1"))

    assert content(frames) == text(EXPECTED)  # no duplicate, no gap
    assert roles(frames) == 1  # the role delta once per choice per request, not per attempt
    usage = [c["usage"] for c in frames if isinstance(c, dict) and c.get("usage")]
    assert len(usage) == 1 and {k: usage[0][k] for k in USAGE} == USAGE  # ours, not the replay engine's
    assert frames[-1] == "[DONE]" and not any(isinstance(c, dict) and "error" in c for c in frames)
    gens = upstreams.calls_of("generate")
    committed = min(fault.after, 8)
    relays = {reason: pipeline.counters.get("motor_stream_relays_total", topology="union", reason=reason)
              for reason in ("stall", "failure")}
    if committed < 8:
        assert relays == {"stall": int(fault.mode == "hang"), "failure": int(fault.mode != "hang")}
        first, relay = gens
        assert (first.host, relay.host) == ("e1", "e2")
        assert relay.body["request_id"] == "chatcmpl-r1-a1" != first.body["request_id"]
        # Each attempt reaches its engine under its own id as X-Request-Id (what vLLM names it by).
        assert [g.headers["x-request-id"] for g in gens] == ["chatcmpl-r1", "chatcmpl-r1-a1"]
        assert relay.body["token_ids"] == CHAT_PROMPT + EXPECTED[:committed]
        assert relay.body["sampling_params"]["max_tokens"] == 8 - committed
    else:
        assert len(gens) == 1  # the whole budget was out: nothing to relay, the stream just ends
        assert relays == {"stall": 0, "failure": 0}
    # Derender always saw the original prompt ids, never the replay prompt.
    carried = [d.body["prompt_token_ids"] for d in upstreams.calls_of("derender") if "prompt_token_ids" in d.body]
    assert carried and all(ids == CHAT_PROMPT for ids in carried)
    assert ("e1", "generate-tokens-chatcmpl-r1") in upstreams.aborted_ids()
    assert scheduler.breakers._get(pipeline.snapshot.instances[0]).failures == 1  # the breaker heard it


async def test_an_open_stream_holds_renders_request_as_json_and_a_relay_sends_it_unchanged(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams,
) -> None:
    # A held stream keeps render's GenerateRequest for a relay: as its JSON bytes, not the parsed
    # dicts (about three times the size), and the relay's body is what it was.
    engines.faults["e1"] = [Fault("raise", 3)]
    stream = await pipeline.chat(chat(), "r7")
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    (prompt,) = stream.body.tokenized.prompts
    assert not [r for r in gc.get_referents(prompt) if isinstance(r, dict)]
    frames = await drain(stream)
    assert content(frames) == text(reference_output(CHAT_PROMPT, 8))
    first, relay = upstreams.calls_of("generate")
    assert relay.body == {**first.body, "request_id": "chatcmpl-r7-a1", "token_ids": CHAT_PROMPT + EXPECTED[:3],
                          "sampling_params": {**first.body["sampling_params"], "max_tokens": 5}}
    assert list(relay.body) == list(first.body)  # the keys in render's order


async def test_a_relay_attempt_carries_the_requests_trace_headers(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams,
) -> None:
    engines.faults["e1"] = [Fault("raise", 3)]
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    # What the edge puts in the request's context: its trace headers.
    frames = await drain(await pipeline.chat(chat(), RequestContext("r-traced", trace={"traceparent": traceparent})))
    assert content(frames) == text(EXPECTED)
    gens = upstreams.calls_of("generate")
    assert len(gens) == 2  # the first attempt and its relay
    assert [c.headers.get("traceparent") for c in gens] == [traceparent, traceparent]


@pytest.mark.parametrize("fault", [Fault("raise", 1), Fault("raise", 5), Fault("error500", 6), Fault("hang", 4)],
                         ids=["drop@1", "drop@5", "error-event@6", "stall@4"])
async def test_a_relay_under_a_time_interval_resumes_from_what_was_committed(
    mock_client: httpx.AsyncClient, scheduler: Scheduler, engines: ContextEngines, upstreams: FakeUpstreams,
    fault: Fault,
) -> None:
    # An interval far longer than the test: after the first token every event is held until the
    # failure flushes it (it came before the failure) or the relayed stream finishes.
    pipeline = ServingPipeline(
        fleet_snapshot(derender_coalesce=True, stream_interval_ms=1000), RenderClient(mock_client, RENDER_URL, 5.0),
        EngineClient(mock_client), scheduler,
        stream_settings=StreamSettings(chunk_timeout_s=0.2 if fault.mode == "hang" else 2.0, max_relays=2),
    )
    engines.faults["e1"] = [fault]
    frames = await drain(await pipeline.chat(chat(stream_options={"include_usage": True}), "r1"))
    assert content(frames) == text(EXPECTED)  # no duplicate, no gap
    assert roles(frames) == 1
    usage = [c["usage"] for c in frames if isinstance(c, dict) and c.get("usage")]
    assert len(usage) == 1 and {k: usage[0][k] for k in USAGE} == USAGE
    first, relay = upstreams.calls_of("generate")
    # What arrived before the failure was derendered and handed on before the relay: it continues
    # from exactly those ids, as without an interval.
    assert relay.body["token_ids"] == CHAT_PROMPT + EXPECTED[:fault.after]
    assert relay.body["sampling_params"]["max_tokens"] == 8 - fault.after
    # Fewer calls than engine events: the first token alone, then runs (and the usage chunk).
    assert len(upstreams.calls_of("derender")) < 8 + 1


async def test_a_chunk_held_back_for_a_stop_string_is_not_committed_and_a_relay_regenerates_it(
    mock_client: LoopbackClient, scheduler: Scheduler, engines: ContextEngines, upstreams: FakeUpstreams,
) -> None:
    from dataclasses import replace

    from tests.serving.fakes import instance

    # Stop strings go to tokenizer-loaded engines only; "zz" never occurs, but its hold-back keeps
    # the chunk with the last character back until the next one comes.
    snapshot = fleet_snapshot(replace(instance("e1"), tokenizer=True), replace(instance("e2"), tokenizer=True))
    pipeline = ServingPipeline(
        snapshot, RenderClient(mock_client, RENDER_URL, 5.0), EngineClient(mock_client), scheduler,
        stream_settings=StreamSettings(chunk_timeout_s=2.0, max_relays=2),
    )
    engines.faults["e1"] = [Fault("raise", 3)]

    frames = await drain(await pipeline.chat(chat(stop=["zz"], stream_options={"include_usage": True}), "r1s"))

    assert content(frames) == text(EXPECTED) and roles(frames) == 1
    first, relay = upstreams.calls_of("generate")
    # The client had the first two chunks; the third was held back, so it was never the
    # client's: the relay continues from two committed ids, and regenerates the third.
    assert relay.body["token_ids"] == CHAT_PROMPT + EXPECTED[:2]
    assert relay.body["sampling_params"]["max_tokens"] == 6
    usage = [c["usage"] for c in frames if isinstance(c, dict) and c.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == 8


async def test_an_in_band_400_ends_the_stream_without_relay_or_breaker(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams, scheduler: Scheduler,
) -> None:
    engines.faults["e1"] = [Fault("error400", 2)]

    frames = await drain(await pipeline.chat(chat(), "r2"))

    assert content(frames) == text(EXPECTED[:2])
    assert frames[-2] == error_json(400, "engine failed mid-stream") and frames[-1] == "[DONE]"
    assert len(upstreams.calls_of("generate")) == 1
    assert scheduler.breakers._get(pipeline.snapshot.instances[0]).failures == 0


async def test_relays_are_bounded(pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams) -> None:
    engines.faults = {"e1": [Fault("raise", 1), Fault("raise", 1)], "e2": [Fault("raise", 1)]}

    frames = await drain(await pipeline.chat(chat(), "r3"))

    assert content(frames) == text(EXPECTED[:3])  # one token from each of the three attempts
    assert frames[-2]["error"]["code"] == 502 and frames[-1] == "[DONE]"
    ids = [g.body["request_id"] for g in upstreams.calls_of("generate")]
    assert ids == ["chatcmpl-r3", "chatcmpl-r3-a1", "chatcmpl-r3-a2"]  # 1 + max_relays, each its own id
    assert pipeline.counters.get("motor_stream_relays_total", topology="union", reason="failure") == 2


def choice_reference(prompt: list[int], max_tokens: int, j: int) -> list[int]:
    """Choice ``j`` of the fake engine's fault-free n > 1 stream."""
    out = [next_token(prompt) + j]
    while len(out) < max_tokens:
        out.append(next_token(prompt + out))
    return out


def choice_contents(frames: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for f in frames:
        if isinstance(f, dict) and f.get("choices"):
            c = f["choices"][0]
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    return texts


@pytest.mark.parametrize(("after", "relayed"), [(3, {0: 2, 1: 1}), (15, {1: 7}), (16, {})],
                         ids=["both-open", "one-finished", "all-finished"])
async def test_n_greater_than_one_relays_every_open_choice_from_its_own_committed_ids(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams, scheduler: Scheduler,
    after: int, relayed: dict[int, int],
) -> None:
    engines.faults["e1"] = [Fault("raise", after)]

    frames = await drain(await pipeline.chat(chat(n=2, stream_options={"include_usage": True}), "r4"))

    # One uninterrupted stream per choice: each choice's text is its fault-free text, no error.
    expected = {j: choice_reference(CHAT_PROMPT, 8, j) for j in (0, 1)}
    assert choice_contents(frames) == {j: text(ids) for j, ids in expected.items()}
    assert frames[-1] == "[DONE]" and not any(isinstance(c, dict) and "error" in c for c in frames)
    assert roles(frames) == 2  # one role delta per choice, not per attempt
    finishes = [c["choices"][0]["index"] for c in frames if isinstance(c, dict) and c.get("choices")
                and c["choices"][0].get("finish_reason")]
    assert sorted(finishes) == [0, 1]
    usage = [c["usage"] for c in frames if isinstance(c, dict) and c.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == 16  # ours: every committed token, once
    assert usage[0]["prompt_tokens"] == len(CHAT_PROMPT)
    # Each open choice continued alone (n 1) from its own committed ids with its own budget.
    first, *relays = upstreams.calls_of("generate")
    assert first.body["sampling_params"]["n"] == 2
    assert {r.body["request_id"]: (r.body["token_ids"], r.body["sampling_params"]["max_tokens"],
                                   r.body["sampling_params"]["n"]) for r in relays} == {
        f"chatcmpl-r4-a1-c{j}": (CHAT_PROMPT + expected[j][:k], 8 - k, 1) for j, k in relayed.items()
    }
    assert all(r.host == "e2" for r in relays)
    assert pipeline.counters.get("motor_stream_relays_total", topology="union", reason="failure") == int(bool(relayed))
    assert ("e1", "generate-tokens-chatcmpl-r4") in upstreams.aborted_ids()
    assert scheduler.breakers._get(pipeline.snapshot.instances[0]).failures == 1


async def test_a_single_prompt_completion_with_n_2_relays_each_choice_under_its_index(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams,
) -> None:
    engines.faults["e1"] = [Fault("raise", 5)]
    body = {"model": MODEL, "prompt": "a", "stream": True, "max_tokens": 6, "n": 2}

    frames = await drain(await pipeline.completions(body, "r4e"))

    prompt = completion_prompt_ids(0)  # what the fake render makes of a single prompt
    texts: dict[int, str] = {}
    for f in frames[:-1]:
        c = f["choices"][0]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {j: text(choice_reference(prompt, 6, j)) for j in (0, 1)} and frames[-1] == "[DONE]"
    relays = {g.body["request_id"]: g.body["token_ids"] for g in upstreams.calls_of("generate")[1:]}
    assert relays == {"cmpl-r4e-a1-c0": prompt + choice_reference(prompt, 6, 0)[:3],
                      "cmpl-r4e-a1-c1": prompt + choice_reference(prompt, 6, 1)[:2]}


async def test_a_relayed_choice_that_fails_again_relays_again_and_the_others_follow(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams,
) -> None:
    # e1 fails after 3 events; both choices go to e2, whose first stream (choice 0) fails after
    # one more token: every open choice continues once more (back on e1), from what the client has.
    engines.faults = {"e1": [Fault("raise", 3)], "e2": [Fault("raise", 1)]}

    frames = await drain(await pipeline.chat(chat(n=2), "r4b"))

    expected = {j: text(choice_reference(CHAT_PROMPT, 8, j)) for j in (0, 1)}
    assert choice_contents(frames) == expected
    assert frames[-1] == "[DONE]" and not any(isinstance(c, dict) and "error" in c for c in frames)
    ids = [g.body["request_id"] for g in upstreams.calls_of("generate")]
    assert ids[:3] == ["chatcmpl-r4b", "chatcmpl-r4b-a1-c0", "chatcmpl-r4b-a1-c1"]
    assert all(i.startswith("chatcmpl-r4b-a2-c") for i in ids[3:]) and ids[3:]


async def test_disconnect_while_choices_are_relayed_releases_every_choice_stream(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams,
) -> None:
    engines.faults = {"e1": [Fault("raise", 3)], "e2": [Fault("hang", 1), Fault("hang", 1)]}
    stream = await pipeline.chat(chat(n=2), "r4d")
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    frames = stream.frames()
    async with asyncio.timeout(WATCHDOG_S):
        got = [await anext(frames) for _ in range(5)]  # three from e1, one from each relayed choice
        assert b"<" in got[-1]
        assert upstreams.open_streams == {"chatcmpl-r4d-a1-c0", "chatcmpl-r4d-a1-c1"}
        await frames.aclose()  # the client went away while both relayed choices stalled
    assert upstreams.open_streams == set()
    aborted = set(upstreams.aborted_ids())
    assert {("e2", "generate-tokens-chatcmpl-r4d-a1-c0"), ("e2", "generate-tokens-chatcmpl-r4d-a1-c1")} <= aborted


async def test_n_greater_than_one_relays_are_bounded_and_end_with_an_error_frame(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams,
) -> None:
    engines.faults = {"e1": [Fault("raise", 3), Fault("raise", 0), Fault("raise", 0)],
                      "e2": [Fault("raise", 0), Fault("raise", 0), Fault("raise", 0)]}

    frames = await drain(await pipeline.chat(chat(n=2), "r4c"))

    assert frames[-2]["error"]["code"] == 502 and frames[-1] == "[DONE]"
    assert {c["choices"][0]["index"] for c in frames[:-2]} == {0, 1}


async def test_multi_prompt_substream_failure_cancels_and_aborts_siblings(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams,
) -> None:
    engines.faults = {"e1": [Fault("raise", 2)], "e2": [Fault("hang", 1)]}
    body = {"model": MODEL, "prompt": ["a", "b"], "stream": True, "max_tokens": 8}

    frames = await drain(await pipeline.completions(body, "r5"))

    assert frames[-2]["error"]["code"] == 502 and frames[-1] == "[DONE]"
    assert sum(1 for f in frames if f == "[DONE]") == 1
    aborted = {rid for _, rid in upstreams.aborted_ids()}
    assert aborted == {"generate-tokens-cmpl-r5-0", "generate-tokens-cmpl-r5-1"}  # the hung sibling too


async def test_multi_prompt_fan_out_has_global_indices_one_usage_one_done(
    pipeline: ServingPipeline, engines: ContextEngines,
) -> None:
    body = {"model": MODEL, "prompt": ["a", "b"], "stream": True, "max_tokens": 4, "n": 2,
            "stream_options": {"include_usage": True}}

    frames = await drain(await pipeline.completions(body, "r6"))

    assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
    usage = [f for f in frames if isinstance(f, dict) and f.get("usage")]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 16
    assert usage[0]["usage"]["prompt_tokens"] == 2 + 3  # completion_prompt_ids: 2 and 3 tokens
    assert {c["choices"][0]["index"] for c in frames if isinstance(c, dict) and c.get("choices")} == {0, 1, 2, 3}


async def test_fan_out_commits_a_chunk_only_once_the_client_was_handed_it(
    pipeline: ServingPipeline, engines: ContextEngines,
) -> None:
    body = {"model": MODEL, "prompt": ["a", "b", "c"], "stream": True, "max_tokens": 6}
    stream = await pipeline.completions(body, "r6b")
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    handed = 0
    async with asyncio.timeout(WATCHDOG_S), aclosing(stream.frames()) as frames:
        async for raw in frames:
            # What the sessions committed is what the client has been handed, never what only
            # entered the merge queue (the chunk in hand commits when the client asks for more).
            committed = sum(s.completion_tokens for s in stream.body.sessions)
            assert handed <= committed + raw.count(b"<") and committed <= handed, (committed, handed)
            handed += raw.count(b"<")
            await asyncio.sleep(0)  # a slow client: the producers run meanwhile
    assert handed == 18 == sum(s.completion_tokens for s in stream.body.sessions)


async def test_disconnect_during_relay_releases_everything(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams,
) -> None:
    engines.faults = {"e1": [Fault("raise", 2)], "e2": [Fault("hang", 1)]}
    stream = await pipeline.chat(chat(), "r7")
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    frames = stream.frames()
    async with asyncio.timeout(WATCHDOG_S):
        got = [await anext(frames) for _ in range(3)]  # two from e1, one from the relay on e2
        assert b"<" in got[-1]
        assert upstreams.open_streams == {"chatcmpl-r7-a1"}
        await frames.aclose()  # the client went away mid-relay
    assert upstreams.open_streams == set()
    assert ("e2", "generate-tokens-chatcmpl-r7-a1") in upstreams.aborted_ids()


async def test_disconnect_while_the_relay_is_being_opened(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams,
) -> None:
    release = asyncio.Event()

    async def slow_open(request: httpx.Request, body: Any) -> httpx.Response:
        await release.wait()  # never: the client leaves first
        raise AssertionError("unreachable")

    engines.faults = {"e1": [Fault("raise", 1)]}
    upstreams._overrides[("e2", "generate")].insert(0, (slow_open, 1))
    stream = await pipeline.chat(chat(), "r8")
    assert isinstance(stream, Response) and isinstance(stream.body, EventStream)
    task = asyncio.create_task(drain(stream))
    async with asyncio.timeout(WATCHDOG_S):
        while len(upstreams.calls_of("generate")) < 2:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.parametrize(("status", "code"), [(404, 502), (422, 422), (500, 502)], ids=["404", "422", "5xx-twice"])
async def test_derender_faults_end_the_stream_without_reinference(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams, scheduler: Scheduler,
    status: int, code: int,
) -> None:
    body = error_json(status, "bad stream_state") if status != 404 else {"detail": "Not Found"}
    calls = 0

    def fail_third(request: httpx.Request, payload: Any) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls >= 3:
            return httpx.Response(status, json=body)
        return httpx.Response(200, json=upstreams._derender_chunk(payload, True))

    upstreams.override("render", "derender", fail_third)

    frames = await drain(await pipeline.chat(chat(), "r9"))

    assert content(frames) == text(EXPECTED[:2])
    assert frames[-2]["error"]["code"] == code and frames[-1] == "[DONE]"
    assert len(upstreams.calls_of("generate")) == 1  # no re-inference
    assert calls == (4 if status == 500 else 3)  # 5xx: one retry of the same chunk
    assert scheduler.breakers._get(pipeline.snapshot.instances[0]).failures == 0
    assert upstreams.aborted_ids() == [("e1", "generate-tokens-chatcmpl-r9")]


async def test_derender_timeout_is_504(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams, mock_client: LoopbackClient
) -> None:
    # A sidecar that never answers, against a short render deadline (over loopback a handler's
    # ReadTimeout would be a reset, not a timeout).
    pipeline.render = RenderClient(mock_client, RENDER_URL, HANG_DEADLINE_S)
    upstreams.override("render", "derender", hang)

    frames = await drain(await pipeline.chat(chat(), "r10"))

    assert frames[0]["error"]["code"] == 504 and frames[1] == "[DONE]"


async def test_one_derender_retry_succeeds_with_the_same_state(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams,
) -> None:
    calls: list[Any] = []

    def flaky(request: httpx.Request, payload: Any) -> httpx.Response:
        calls.append(payload["stream_state"])
        if len(calls) == 3:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=upstreams._derender_chunk(payload, True))

    upstreams.override("render", "derender", flaky)

    frames = await drain(await pipeline.chat(chat(), "r11"))

    assert content(frames) == text(EXPECTED) and frames[-1] == "[DONE]"
    assert calls[2] == calls[3]  # the retried chunk went with the same previous state


async def test_relay_with_obfuscation_replays_semantic_ids_re_obfuscated(
    mock_client: LoopbackClient, scheduler: Scheduler, engines: ContextEngines, upstreams: FakeUpstreams,
) -> None:
    from serving.pipeline.obfuscation.boundary import EngineBoundary
    from serving.pipeline.obfuscation.mapping import TokenMapping

    mapping = TokenMapping.from_key(b"relay-test-obfuscation-key-0001", 152000)
    pipeline = ServingPipeline(
        fleet_snapshot(), RenderClient(mock_client, RENDER_URL, 5.0), EngineClient(mock_client), scheduler,
        boundary=EngineBoundary(mapping), stream_settings=StreamSettings(chunk_timeout_s=2.0),
    )
    reference = content(await drain(await pipeline.chat(chat(), "o0")))
    upstreams.calls.clear()
    engines.faults["e1"] = [Fault("raise", 3)]

    frames = await drain(await pipeline.chat(chat(), "o1"))

    assert content(frames) == reference and roles(frames) == 1
    first, relay = upstreams.calls_of("generate")
    # The engine's output ids, deobfuscated at the boundary, are the ledger; the replay goes out re-obfuscated.
    physical_out: list[int] = []
    for _ in range(3):
        physical_out.append(next_token(first.body["token_ids"] + physical_out))
    assert relay.body["token_ids"] == first.body["token_ids"] + physical_out
    assert mapping.to_semantic(relay.body["token_ids"]) == CHAT_PROMPT + mapping.to_semantic(physical_out)
    carried = [d.body["prompt_token_ids"] for d in upstreams.calls_of("derender") if "prompt_token_ids" in d.body]
    assert carried and all(ids == CHAT_PROMPT for ids in carried)


def test_retry_plan_replays_committed_ids_with_the_rest_of_the_budget() -> None:
    from serving.pipeline.streaming.relay import RetryRequestPlan

    base = {"request_id": "chatcmpl-x", "token_ids": [1, 2], "sampling_params": {"max_tokens": 10, "min_tokens": 4}}
    plan = RetryRequestPlan.build(base, [1, 2], [7, 8, 9], attempt=2)
    req = plan.request()
    assert req["token_ids"] == [1, 2, 7, 8, 9] and req["request_id"] == "chatcmpl-x-a2"
    assert req["sampling_params"] == {"max_tokens": 7, "min_tokens": 1}
    assert base["sampling_params"] == {"max_tokens": 10, "min_tokens": 4}  # render's request untouched
    # render omits a resolved 16: the budget left is 16 minus what was committed
    assert RetryRequestPlan.build({"request_id": "y", "sampling_params": {}}, [1], [5] * 6, attempt=1).remaining_tokens == 10
    with pytest.raises(ValueError):
        RetryRequestPlan.build(base, [1, 2], [7] * 10, attempt=1).request()


async def test_fan_out_restarts_the_whole_request_before_any_visible_chunk(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams,
) -> None:
    # Prompt 0 (e1) drops before its first token while prompt 1 (e2) has sent nothing either.
    engines.faults = {"e1": [Fault("raise", 0)], "e2": [Fault("hang", 0)]}
    body = {"model": MODEL, "prompt": ["a", "b"], "stream": True, "max_tokens": 4}

    frames = await drain(await pipeline.completions(body, "r12"))

    assert frames[-1] == "[DONE]" and not any(isinstance(f, dict) and "error" in f for f in frames)
    texts: dict[int, str] = {}
    for f in frames[:-1]:
        c = f["choices"][0]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {i: text(reference_output([1000 + i] * (i + 2), 4)) for i in (0, 1)}
    ids = [g.body["request_id"] for g in upstreams.calls_of("generate")]
    assert ids == ["cmpl-r12-0", "cmpl-r12-1", "cmpl-r12-0-a1", "cmpl-r12-1-a1"]  # every attempt its own id
    assert {h for h, _ in upstreams.aborted_ids()} == {"e1", "e2"}


async def test_n_greater_than_one_restarts_before_any_visible_chunk(
    pipeline: ServingPipeline, engines: ContextEngines, upstreams: FakeUpstreams,
) -> None:
    engines.faults = {"e1": [Fault("raise", 0)]}

    frames = await drain(await pipeline.chat(chat(n=2, max_tokens=3), "r13"))

    assert frames[-1] == "[DONE]" and not any(isinstance(f, dict) and "error" in f for f in frames)
    assert [g.host for g in upstreams.calls_of("generate")] == ["e1", "e2"]
    assert sum(1 for f in frames[:-1] if f["choices"][0]["delta"].get("role")) == 2  # one per choice
