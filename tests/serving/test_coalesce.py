"""Coalescing of engine events that arrived while derender was busy (serving/pipeline/derender/coalesce.py)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.pipeline.derender.coalesce import coalesced, event_choice_index, merge_events


def token_event(index: int, ids: list[int], *, finish: str | None = None, logprobs: bool = True,
                usage: int | None = None, prompt: list[int] | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {
        "request_id": "generate-tokens-x",
        "output_mode": "tokens",
        "usage": None if usage is None else {"prompt_tokens": 5, "completion_tokens": usage, "total_tokens": 5 + usage},
        "choices": [{
            "index": index, "finish_reason": finish, "stop_reason": None, "token_ids": ids,
            "routed_experts": None, "sampling_mask": None, "weight_versions": None,
            "logprobs": {"content": [{"token_id": t, "logprob": -1.0, "rank": None, "top_logprobs": []} for t in ids]}
            if logprobs else None,
        }],
    }
    if prompt is not None:
        event["prompt_token_ids"] = prompt
    return event


USAGE_ONLY = {"request_id": "generate-tokens-x", "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
              "output_mode": "tokens", "choices": []}
ERROR = {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}


async def source(reads: list[list[dict[str, Any]]], *, fail: BaseException | None = None,
                 gate: asyncio.Event | None = None) -> AsyncIterator[list[dict[str, Any]]]:
    """An engine stream as its connection hands it over: a list of the events of each read."""
    for batch in reads:
        yield batch
    if gate is not None:
        await gate.wait()
    if fail is not None:
        raise fail


def one_by_one(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    return [[e] for e in events]


async def drain(reads: list[list[dict[str, Any]]], **kw: Any) -> tuple[list[dict[str, Any]], dict[str, int]]:
    stats: dict[str, int] = {}
    out = [e async for e in coalesced(source(reads), stats=stats, **kw)]
    return out, stats


def test_it_merges_ids_logprobs_and_takes_finish_and_usage_from_the_last() -> None:
    merged = merge_events([
        token_event(0, [1, 2], prompt=[9, 9], usage=2),
        token_event(0, [3], usage=3),
        token_event(0, [4], finish="stop", usage=4),
    ])
    choice = merged["choices"][0]
    assert choice["token_ids"] == [1, 2, 3, 4]
    assert [c["token_id"] for c in choice["logprobs"]["content"]] == [1, 2, 3, 4]
    assert choice["finish_reason"] == "stop"
    assert merged["usage"]["completion_tokens"] == 4
    assert merged["prompt_token_ids"] == [9, 9]


def test_it_keeps_null_logprobs_null() -> None:
    merged = merge_events([token_event(0, [1], logprobs=False), token_event(0, [2], logprobs=False)])
    assert merged["choices"][0]["logprobs"] is None


def test_it_refuses_to_merge_across_choices_or_with_usage() -> None:
    with pytest.raises(ValueError):
        merge_events([token_event(0, [1]), token_event(1, [2])])
    with pytest.raises(ValueError):
        merge_events([token_event(0, [1]), USAGE_ONLY])
    assert event_choice_index(ERROR) is None
    assert event_choice_index(USAGE_ONLY) is None


async def test_it_passes_events_through_unchanged_when_each_read_brings_one() -> None:
    events = [token_event(0, [i]) for i in range(5)] + [USAGE_ONLY]
    out, stats = await drain(one_by_one(events))
    assert all(o is e for o, e in zip(out, events, strict=True))
    assert stats == {"events_in": 6, "events_out": 6, "high_water": 1}


async def test_it_merges_what_one_read_brought() -> None:
    # What queued in the connection while the consumer was busy comes as one read.
    events = [token_event(0, [i], usage=i + 1) for i in range(6)]
    events[-1]["choices"][0]["finish_reason"] = "length"
    out, stats = await drain([events[:1], events[1:] + [USAGE_ONLY]])
    assert out[0]["choices"][0]["token_ids"] == [0]
    assert out[1]["choices"][0]["token_ids"] == [1, 2, 3, 4, 5]
    assert out[1]["choices"][0]["finish_reason"] == "length"
    assert out[1]["usage"]["completion_tokens"] == 6
    assert out[2] is USAGE_ONLY
    assert stats == {"events_in": 7, "events_out": 3, "high_water": 6}


async def test_it_never_merges_across_choice_indices_and_keeps_per_choice_order() -> None:
    events = [token_event(i % 2, [10 * (i % 2) + i]) for i in range(8)]
    out, _ = await drain([events[:1], events[1:]])
    by_index: dict[int, list[int]] = {0: [], 1: []}
    for e in out:
        assert len(e["choices"]) == 1
        by_index[e["choices"][0]["index"]] += e["choices"][0]["token_ids"]
    assert by_index == {0: [0, 2, 4, 6], 1: [11, 13, 15, 17]}
    assert len(out) == 3  # the first alone, then one merged event per choice


async def test_it_delivers_an_error_event_unmerged_after_what_came_before() -> None:
    out, _ = await drain([[token_event(0, [1])], [token_event(0, [2]), token_event(0, [3]), ERROR]])
    assert [e.get("choices", [{}])[0].get("token_ids") for e in out[:-1]] == [[1], [2, 3]]
    assert out[-1] is ERROR


async def test_it_raises_the_source_failure_after_the_events_read_before_it() -> None:
    gate = asyncio.Event()
    gen = coalesced(source([[token_event(0, [1])], [token_event(0, [2])]], fail=ConnectionError("drop"), gate=gate))
    seen = [await gen.__anext__()]
    gate.set()
    with pytest.raises(ConnectionError):
        async for e in gen:
            seen.append(e)
    assert sum(len(e["choices"][0]["token_ids"]) for e in seen) == 2


async def test_one_merged_event_covers_at_most_max_pending_engine_events() -> None:
    read = [token_event(0, [i]) for i in range(1, 50)]
    out, stats = await drain([[token_event(0, [0])], read], max_pending=4)
    assert [len(e["choices"][0]["token_ids"]) for e in out] == [1] + [4] * 12 + [1]
    assert [t for e in out for t in e["choices"][0]["token_ids"]] == list(range(50))
    assert stats["events_out"] == 14


async def test_it_starts_no_task_and_leaves_the_engine_stream_to_its_owner() -> None:
    gate = asyncio.Event()
    closed = asyncio.Event()

    async def engine() -> AsyncIterator[list[dict[str, Any]]]:
        try:
            yield [token_event(0, [1])]
            await gate.wait()  # a stalled engine
        finally:
            closed.set()

    before = asyncio.all_tasks()
    stream = engine()
    gen = coalesced(stream)
    await gen.__anext__()
    assert asyncio.all_tasks() == before  # nothing reads ahead behind the consumer's back
    await gen.aclose()
    assert not closed.is_set()
    await stream.aclose()  # the owner's to close, and closable: nothing else is inside it
    assert closed.is_set()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3), st.booleans()), min_size=1, max_size=30))
def test_it_concatenates_to_the_uncoalesced_stream_per_choice(plan: list[tuple[int, int, bool]]) -> None:
    """However the events fall into reads, per choice the ids and logprobs add up to the originals."""

    async def run() -> None:
        events = [token_event(index, list(range(100 * index + k * 10, 100 * index + k * 10 + size)))
                  for k, (index, size, _) in enumerate(plan)]
        reads: list[list[dict[str, Any]]] = []
        for e, (_, _, new_read) in zip(events, plan, strict=True):
            if new_read or not reads:
                reads.append([])
            reads[-1].append(e)
        expected: dict[int, list[int]] = {}
        for e in events:
            expected.setdefault(e["choices"][0]["index"], []).extend(e["choices"][0]["token_ids"])
        got: dict[int, list[int]] = {}
        got_lp: dict[int, list[int]] = {}
        out, stats = await drain(reads, max_pending=5)
        for e in out:
            c = e["choices"][0]
            got.setdefault(c["index"], []).extend(c["token_ids"])
            got_lp.setdefault(c["index"], []).extend(x["token_id"] for x in c["logprobs"]["content"])
        assert got == expected
        assert got_lp == expected
        assert stats["events_in"] == len(events)
        # Never more calls than events, never fewer than each read's choices capped by max_pending.
        assert sum(len({x["choices"][0]["index"] for x in r}) for r in reads) <= len(out) <= len(events)

    asyncio.run(run())


async def paced(events: list[dict[str, Any]], log: list[str]) -> AsyncIterator[list[dict[str, Any]]]:
    """An engine that sends one event per loop turn, logging each as sent."""
    for e in events:
        await asyncio.sleep(0)
        log.append(f"sent {e['choices'][0]['token_ids'] if e.get('choices') else 'usage'}")
        yield [e]


async def test_a_stream_interval_sends_the_first_token_alone_then_runs_of_n_however_fast_derender_is() -> None:
    # A consumer that keeps up (it takes each chunk as soon as it may): with interval 3 it still
    # gets the first token alone, then runs of 3, then the rest once the choice finished.
    log: list[str] = []
    events = [token_event(0, [t], finish="length" if t == 8 else None) for t in range(1, 9)] + [USAGE_ONLY]
    out = []
    async for e in coalesced(paced(events, log), stream_interval=3):
        out.append(e["choices"][0]["token_ids"] if e["choices"] else "usage")
        log.append(f"got {out[-1]}")
    assert out == [[1], [2, 3, 4], [5, 6, 7], [8], "usage"]
    # The first token went out before the engine sent the second: never held back.
    assert log.index("got [1]") < log.index("sent [2]")


async def test_a_stream_interval_never_waits_on_one_choice_while_the_buffer_is_full_of_another() -> None:
    # n=2: choice 1's events fill the buffer while choice 0's run is short of the interval; the
    # consumer must take what waits instead of both sides waiting on each other.
    events = [token_event(0, [1]), token_event(1, [100])]
    events += [token_event(1, [100 + t]) for t in range(1, 10)]
    events += [token_event(0, [2], finish="stop"), token_event(1, [110], finish="stop")]
    got: dict[int, list[int]] = {0: [], 1: []}
    async with asyncio.timeout(5):
        async for e in coalesced(source(one_by_one(events)), stream_interval=4, max_pending=4):
            got[e["choices"][0]["index"]] += e["choices"][0]["token_ids"]
    assert got == {0: [1, 2], 1: [100 + t for t in range(11)]}


async def test_a_stream_interval_lets_an_error_and_the_end_through_at_once() -> None:
    log: list[str] = []
    out = [e async for e in coalesced(paced([token_event(0, [1]), token_event(0, [2]), ERROR], log), stream_interval=8)]
    assert [e.get("error") is not None for e in out] == [False, False, True]
    assert out[1]["choices"][0]["token_ids"] == [2]  # short of the interval, but nothing more was coming
    with pytest.raises(RuntimeError, match="gone"):
        async for _ in coalesced(source([[token_event(0, [1])], [token_event(0, [2])]], fail=RuntimeError("gone")),
                                 stream_interval=8):
            pass


def test_the_largest_stream_interval_an_operator_may_set_is_what_coalescing_can_buffer() -> None:
    from catalog.models import STREAM_INTERVAL_MAX
    from serving.pipeline.derender import coalesce

    assert STREAM_INTERVAL_MAX == coalesce.MAX_PENDING
