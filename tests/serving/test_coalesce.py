"""Coalescing of engine events that arrived while derender was busy (serving/pipeline/derender/coalesce.py)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.pipeline.derender.coalesce import Clock, coalesced, event_choice_index, merge_events


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


# -- stream_interval_ms: the cadence by time, on a fake clock (nothing here waits on real time) --


class FakeClock(Clock):
    """A clock the test moves: ``wait`` ends when the read is done or the test advanced past the delay."""

    def __init__(self) -> None:
        self.t = 0.0
        self.timers: list[tuple[float, asyncio.Future[None]]] = []
        self.waits = 0

    def now(self) -> float:
        return self.t

    async def wait(self, read: asyncio.Future[Any], delay: float) -> None:
        self.waits += 1
        timer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.timers.append((self.t + max(0.0, delay), timer))
        self._fire()
        await asyncio.wait((read, timer), return_when=asyncio.FIRST_COMPLETED)

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self._fire()

    def _fire(self) -> None:
        for due, timer in self.timers:
            if due <= self.t + 1e-12 and not timer.done():
                timer.set_result(None)
        self.timers = [(d, f) for d, f in self.timers if not f.done()]


async def settle() -> None:
    """Let every ready task run until nothing moves (no I/O here, so a bounded number of turns)."""
    for _ in range(50):
        await asyncio.sleep(0)


class Engine:
    """An engine stream the test feeds read by read; ``closed`` once its generator was finalized."""

    def __init__(self) -> None:
        self.reads: asyncio.Queue[list[dict[str, Any]] | BaseException | None] = asyncio.Queue()
        self.closed = False

    async def stream(self) -> AsyncIterator[list[dict[str, Any]]]:
        try:
            while (item := await self.reads.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed = True


class Consumer:
    """Takes each coalesced event as soon as it may, recording the fake time it was taken."""

    def __init__(self, engine: Engine, clock: FakeClock, **kw: Any) -> None:
        self.clock = clock
        self.got: list[tuple[float, Any]] = []
        self.error: BaseException | None = None
        self.stats: dict[str, int] = {}
        self.gen = coalesced(engine.stream(), clock=clock, stats=self.stats, **kw)
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            async for e in self.gen:
                if "error" in e:
                    self.got.append((self.clock.now(), "error"))
                elif not e.get("choices"):
                    self.got.append((self.clock.now(), "usage"))
                else:
                    c = e["choices"][0]
                    self.got.append((self.clock.now(), (c["index"], c["token_ids"])))
        except Exception as exc:
            self.error = exc

    def runs(self) -> list[Any]:
        return [what for _, what in self.got]


async def test_a_time_interval_holds_a_choice_s_tokens_after_its_first_and_sends_them_when_it_ends() -> None:
    clock, engine = FakeClock(), Engine()
    consumer = Consumer(engine, clock, stream_interval_ms=50)
    engine.reads.put_nowait([token_event(0, [1])])
    await settle()
    assert consumer.runs() == [(0, [1])]  # the first token at once: never held back
    clock.advance(0.010)
    engine.reads.put_nowait([token_event(0, [2])])
    engine.reads.put_nowait([token_event(0, [3])])
    await settle()
    assert consumer.runs() == [(0, [1])]  # within the interval: held, not derendered
    clock.advance(0.040)
    await settle()
    # The interval ended with no new event: the held run went without waiting for one.
    assert consumer.runs() == [(0, [1]), (0, [2, 3])]
    clock.advance(0.010)
    engine.reads.put_nowait([token_event(0, [4])])
    await settle()
    assert len(consumer.runs()) == 2
    engine.reads.put_nowait([token_event(0, [5], finish="stop")])
    await settle()
    # The choice finished: flushed at once, 30 ms before its interval would have ended.
    assert consumer.runs() == [(0, [1]), (0, [2, 3]), (0, [4, 5])]
    engine.reads.put_nowait([USAGE_ONLY])
    engine.reads.put_nowait(None)
    await settle()
    assert consumer.task.done() and consumer.error is None
    assert consumer.runs()[-1] == "usage"
    assert consumer.stats["events_in"] == 6 and consumer.stats["events_out"] == 4


async def test_a_time_interval_and_a_token_count_both_hold_a_run() -> None:
    clock, engine = FakeClock(), Engine()
    consumer = Consumer(engine, clock, stream_interval=3, stream_interval_ms=50)
    engine.reads.put_nowait([token_event(0, [1])])
    await settle()
    engine.reads.put_nowait([token_event(0, [2]), token_event(0, [3])])
    clock.advance(0.100)
    await settle()
    assert consumer.runs() == [(0, [1])]  # the interval passed, but only 2 of 3 tokens came
    engine.reads.put_nowait([token_event(0, [4])])
    await settle()
    assert consumer.runs() == [(0, [1]), (0, [2, 3, 4])]  # both said so
    engine.reads.put_nowait([token_event(0, [5]), token_event(0, [6]), token_event(0, [7])])
    await settle()
    assert len(consumer.runs()) == 2  # 3 tokens, but within the interval
    clock.advance(0.050)
    await settle()
    assert consumer.runs()[-1] == (0, [5, 6, 7])
    engine.reads.put_nowait(None)
    await settle()
    assert consumer.task.done() and consumer.error is None


async def test_each_choice_has_its_own_interval_and_a_first_token_never_waits_behind_another_choice() -> None:
    clock, engine = FakeClock(), Engine()
    consumer = Consumer(engine, clock, stream_interval=2, stream_interval_ms=50)
    engine.reads.put_nowait([token_event(0, [1])])
    await settle()
    clock.advance(0.020)
    # Choice 0's run is held (one token of two, inside its interval); choice 1's first token is
    # behind it in the buffer and goes at once all the same.
    engine.reads.put_nowait([token_event(0, [2]), token_event(1, [100])])
    await settle()
    assert consumer.runs() == [(0, [1]), (1, [100])]
    engine.reads.put_nowait([token_event(0, [3]), token_event(1, [101]), token_event(1, [102])])
    clock.advance(0.030)  # t=50 ms: choice 0's interval ended, choice 1's (taken at 20 ms) has not
    await settle()
    assert consumer.runs()[2:] == [(0, [2, 3])]
    clock.advance(0.020)
    await settle()
    assert consumer.runs()[2:] == [(0, [2, 3]), (1, [101, 102])]
    engine.reads.put_nowait(None)
    await settle()
    assert consumer.task.done() and consumer.error is None


async def test_a_time_interval_lets_held_tokens_through_before_an_error_event_or_a_failed_read() -> None:
    for end in (ERROR, RuntimeError("gone")):
        clock, engine = FakeClock(), Engine()
        consumer = Consumer(engine, clock, stream_interval_ms=1000)
        engine.reads.put_nowait([token_event(0, [1])])
        engine.reads.put_nowait([token_event(0, [2])])
        engine.reads.put_nowait([token_event(0, [3])])
        await settle()
        assert consumer.runs() == [(0, [1])]
        engine.reads.put_nowait(end if isinstance(end, BaseException) else [end])
        if not isinstance(end, BaseException):
            engine.reads.put_nowait(None)
        await settle()
        assert consumer.task.done()
        # Nothing held past the stream's end: the tokens that came before it, then the error.
        assert consumer.runs()[:2] == [(0, [1]), (0, [2, 3])]
        if isinstance(end, BaseException):
            assert consumer.error is end
        else:
            assert consumer.runs()[2:] == ["error"] and consumer.error is None


async def test_a_consumer_that_leaves_while_a_run_is_held_stops_the_read_that_was_racing_the_clock() -> None:
    clock, engine = FakeClock(), Engine()
    gen = coalesced(engine.stream(), clock=clock, stream_interval_ms=50)
    engine.reads.put_nowait([token_event(0, [1])])
    assert (await anext(gen))["choices"][0]["token_ids"] == [1]
    engine.reads.put_nowait([token_event(0, [2])])
    pull = asyncio.create_task(anext(gen))
    await settle()
    assert not pull.done() and clock.waits == 1  # held by time, a read running beside the clock
    pull.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pull
    await gen.aclose()  # type: ignore[attr-defined]
    await settle()
    assert engine.closed  # the read was cancelled and the engine generator finalized with it
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()], \
        "a read task outlived the coalescer"


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=40),
    interval_ms=st.sampled_from([10, 25, 50]),
    count=st.sampled_from([1, 3]),
)
def test_after_the_first_token_a_choice_s_runs_are_at_least_the_interval_apart_and_nothing_is_lost(
    gaps: list[int], interval_ms: int, count: int
) -> None:
    async def go() -> Consumer:
        clock, engine = FakeClock(), Engine()
        consumer = Consumer(engine, clock, stream_interval=count, stream_interval_ms=interval_ms)
        for t, gap in enumerate(gaps):
            clock.advance(gap / 1000)
            last = t == len(gaps) - 1
            engine.reads.put_nowait([token_event(0, [t], finish="length" if last else None)])
            await settle()
        engine.reads.put_nowait(None)
        await settle()
        assert consumer.task.done() and consumer.error is None
        return consumer

    consumer = asyncio.run(go())
    taken = [(when, ids) for when, (_, ids) in consumer.got]
    assert [t for _, ids in taken for t in ids] == list(range(len(gaps)))
    assert taken[0][1] == [0]  # the first token alone, at once
    # Every run but the finishing one waited its interval after the one before it.
    for (before, _), (when, ids) in zip(taken, taken[1:-1], strict=False):
        assert when - before >= interval_ms / 1000 - 1e-9, taken
        assert len(ids) >= count, taken


def test_a_render_config_with_a_time_interval_reads_with_the_coalescing_reader() -> None:
    from serving.pipeline.derender.coalesce import coalesces, event_reader
    from serving.pipeline.snapshot import RenderView

    off = RenderView(enable=True, base_url="http://r", timeout_s=5.0)
    on = RenderView(enable=True, base_url="http://r", timeout_s=5.0, stream_interval_ms=40)
    assert not coalesces(off) and coalesces(on)
    reader = event_reader(on)
    assert getattr(reader, "keywords", {}) == {"stream_interval": 1, "stream_interval_ms": 40}
