"""StreamingRenderSession: commit only after hand-off, rollback, attempt snapshots, usage account."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import sys
from typing import Any, AsyncIterator

import pytest

from serving.pipeline import json_codec
from serving.pipeline.derender.payload import packed_state, slim_request, unpacked_state
from serving.pipeline.derender.session import ChoicePhase, PendingChunk, StreamingRenderSession, StreamSettings
from serving.pipeline.errors import DerenderError, UpstreamRequestError
from serving.pipeline.render.client import DerenderRetryable

PROMPT = [1, 2, 3]


class FakeRender:
    """derender_chunk: text is the ids, the state counts chunks; ``fail`` raises on chosen calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], dict[str, Any] | None, list[int] | None]] = []
        self.requests: list[dict[str, Any] | None] = []
        self.fail: dict[int, BaseException] = {}  # call number (0-based) -> exception
        self.replay_buffer = False  # answer like the parser path: the state carries every output id
        self.hang = False
        self.timeout_s = 1.0  # RenderClient.timeout_s: the render config's timeout_ms, one bound per chunk

    def chunk_slot(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    async def derender_chunk(self, kind: str, event: dict[str, Any], *, stream_state: Any, prompt_tokens: int,
                             prompt_token_ids: list[int] | None, request: dict[str, Any] | None,
                             model: str | None, trace: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
        assert prompt_tokens == len(PROMPT)
        number = len(self.calls)
        self.calls.append((event, stream_state, prompt_token_ids))
        self.requests.append(request)
        if self.hang:
            await asyncio.Event().wait()
        if number in self.fail:
            raise self.fail[number]
        choices = event.get("choices") or []
        if not choices:
            return {"choices": [], "usage": dict(event["usage"])}, stream_state
        c = choices[0]
        stream_state = unpacked_state(stream_state)  # as the sidecar reads the JSON it is sent
        seen = (stream_state or {}).get("chunks", 0)
        delta: dict[str, Any] = {"content": "".join(f"<{t}>" for t in c["token_ids"])}
        if seen == 0:
            delta["role"] = "assistant"
        chunk = {"choices": [{"index": c["index"], "delta": delta, "finish_reason": c.get("finish_reason")}],
                 "usage": {"prompt_tokens": 999, "completion_tokens": 999, "total_tokens": 999} if "usage" in event else None}
        if "prompt_token_ids" in event:  # the sidecar hands on the engine's (return_token_ids)
            chunk["prompt_token_ids"] = event["prompt_token_ids"]
        state: dict[str, Any] = {"chunks": seen + 1}
        if self.replay_buffer:
            state["output_token_ids"] = (stream_state or {}).get("output_token_ids", []) + list(c["token_ids"])
        return chunk, state

    def kept(self, state: dict[str, Any] | None) -> dict[str, Any] | None:
        return state


def event(token: int, index: int = 0, finish: str | None = None) -> dict[str, Any]:
    return {"request_id": "g", "choices": [{"index": index, "token_ids": [token], "finish_reason": finish}]}


async def events(*items: dict[str, Any] | BaseException) -> AsyncIterator[list[dict[str, Any]]]:
    """The engine's reads, one event each."""
    for item in items:
        if isinstance(item, BaseException):
            raise item
        yield [item]


def session(render: FakeRender, **settings: Any) -> StreamingRenderSession:
    return StreamingRenderSession(
        render, "chat", {"model": "m"}, PROMPT, request_id="r", public_id="chatcmpl-r",  # type: ignore[arg-type]
        settings=StreamSettings(**{"chunk_timeout_s": 1.0, **settings}),
    )


async def test_a_chunk_is_committed_only_once_the_consumer_resumes() -> None:
    render = FakeRender()
    s = session(render)
    chunks = s.chunks(events(event(7), event(8, finish="length")))

    first = await anext(chunks)
    assert first["id"] == "chatcmpl-r" and first["choices"][0]["delta"]["role"] == "assistant"
    assert list(s.choice(0).output_ids) == [] and s.choice(0).phase is ChoicePhase.PENDING  # handed, not yet committed

    await anext(chunks)
    assert list(s.choice(0).output_ids) == [7] and s.choice(0).stream_state == {"chunks": 1}
    with pytest.raises(StopAsyncIteration):
        await anext(chunks)
    assert list(s.choice(0).output_ids) == [7, 8] and s.choice(0).phase is ChoicePhase.DONE
    # The second derender went with the state committed by the first; the first seeded it from the
    # original prompt, and a state without a replay buffer (the plain path) needs no prompt after.
    assert [c[1] for c in render.calls] == [None, {"chunks": 1}]
    assert [c[2] for c in render.calls] == [PROMPT, None]


async def test_a_chunk_handed_on_is_not_kept_by_the_session_while_the_consumer_holds_it() -> None:
    """A slow client's stream holds the chunk's frame, not the parsed chunk as well (issue 31): once
    yielded, nothing the suspended session refers to reaches the chunk."""
    s = session(FakeRender())
    chunks = s.chunks(events(event(7), event(8)))
    first = await anext(chunks)
    kept = [r for r in gc.get_referrers(first) if isinstance(r, (PendingChunk, list)) or r is chunks]
    assert not kept, kept
    await anext(chunks)  # the commit still has what it needs
    assert list(s.choice(0).output_ids) == [7]
    await chunks.aclose()


async def test_a_consumer_that_leaves_after_a_chunk_commits_nothing_of_it() -> None:
    s = session(FakeRender())
    chunks = s.chunks(events(event(7), event(8)))
    await anext(chunks)
    await chunks.aclose()
    assert s.committed_ids == [] and not s.visible


@pytest.mark.parametrize("exc", [
    DerenderError("boom"), UpstreamRequestError(400, {"error": {"message": "invalid stream_state"}}, source="derender"),
], ids=["5xx-like", "400-invalid-state"])
async def test_a_failed_derender_commits_nothing(exc: BaseException) -> None:
    render = FakeRender()
    render.fail = {1: exc}
    s = session(render, derender_retries=0)
    got = []
    with pytest.raises(type(exc)):
        async for chunk in s.chunks(events(event(7), event(8))):
            got.append(chunk)
    assert len(got) == 1 and s.committed_ids == [7] and s.choice(0).stream_state == {"chunks": 1}


async def test_by_default_a_derender_failure_is_not_retried() -> None:
    """The RFC: no automatic derender retry in this stage; the stream ends with the error."""
    render = FakeRender()
    render.fail = {1: DerenderRetryable("unreachable")}
    s = session(render)
    got = []
    with pytest.raises(DerenderRetryable):
        async for chunk in s.chunks(events(event(7), event(8))):
            got.append(chunk)
    assert len(got) == 1 and len(render.calls) == 2 and s.derender_calls == 2
    assert s.committed_ids == [7] and s.choice(0).stream_state == {"chunks": 1}


async def test_an_opted_in_retry_repeats_the_same_chunk_with_the_same_state() -> None:
    render = FakeRender()
    render.fail = {1: DerenderRetryable("unreachable")}
    s = session(render, derender_retries=1)
    out = [c async for c in s.chunks(events(event(7), event(8)))]
    assert len(out) == 2 and s.committed_ids == [7, 8]
    assert render.calls[1] == render.calls[2] and render.calls[1][1] == {"chunks": 1} and s.derender_calls == 3


async def test_the_retry_budget_and_the_render_timeout_bound_derender() -> None:
    render = FakeRender()
    render.fail = {0: DerenderRetryable("5xx"), 1: DerenderRetryable("5xx")}
    with pytest.raises(DerenderRetryable):
        await s_first(session(render, derender_retries=1))
    assert len(render.calls) == 2
    # The chunk's one bound is the render config's timeout_ms, not the engine's chunk timeout.
    render = FakeRender()
    render.hang = True
    render.timeout_s = 0.05
    with pytest.raises(DerenderError) as info:
        await s_first(session(render, chunk_timeout_s=3600.0))
    assert info.value.status == 504


async def test_retries_share_the_chunk_bound() -> None:
    """A sidecar that keeps failing fast is not retried past the chunk's bound, whatever the count."""
    render = FakeRender()
    render.fail = {n: DerenderRetryable("unreachable") for n in range(10_000)}
    render.timeout_s = 0.3
    with pytest.raises(DerenderError) as info:
        await s_first(session(render, derender_retries=10_000))
    assert info.value.status == 504 and 2 <= len(render.calls) < 50  # paused between tries, then bounded


async def s_first(s: StreamingRenderSession) -> dict[str, Any]:
    return await anext(s.chunks(events(event(7))))


async def test_an_attempt_failing_before_visible_output_restores_its_snapshot() -> None:
    s = session(FakeRender())
    snap = s.begin_attempt(0, "e1")
    with pytest.raises(RuntimeError):
        async for _ in s.chunks(events(RuntimeError("drop"))):
            pass
    s.restore(snap)
    assert s.choices == {} and not s.visible

    # After visible output the committed state survives the next attempt's early failure.
    async for _ in s.chunks(events(event(7), event(8))):
        pass
    snap = s.begin_attempt(1, "e2")
    with pytest.raises(RuntimeError):
        async for _ in s.chunks(events(RuntimeError("drop"))):
            pass
    s.restore(snap)
    assert s.committed_ids == [7, 8] and s.choice(0).stream_state == {"chunks": 2} and s.attempt == 1


async def test_the_prompt_ids_are_the_original_prompts_once_never_a_relays_replay() -> None:
    s = session(FakeRender())
    first = [c async for c in s.chunks(events({**event(7), "prompt_token_ids": PROMPT}, event(8)))]
    assert first[0]["prompt_token_ids"] == PROMPT and "prompt_token_ids" not in first[1]
    s.begin_attempt(1, "e2")  # relayed: the engine was sent prompt + committed output
    relayed = [c async for c in s.chunks(events(
        {**event(9), "prompt_token_ids": [*PROMPT, 7, 8]}, {**event(4, index=1), "prompt_token_ids": PROMPT},
    ))]
    assert relayed[0]["prompt_token_ids"] is None and relayed[0]["choices"][0]["delta"]["content"] == "<9>"
    assert relayed[1]["prompt_token_ids"] == PROMPT  # another choice's first chunk carries them, as vLLM's


async def test_restore_drops_what_a_failed_attempt_added() -> None:
    s = session(FakeRender())
    async for _ in s.chunks(events(event(7))):
        pass
    snap = s.begin_attempt(1, "e2")
    async for _ in s.chunks(events(event(8), event(5, index=1))):
        pass
    s.restore(snap)
    assert s.committed_ids == [7] and set(s.choices) == {0} and s.choice(0).stream_state == {"chunks": 1}


async def test_usage_is_the_sessions_own_account() -> None:
    s = session(FakeRender())
    usage_event = {"request_id": "g", "choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 1,
                                                               "total_tokens": 51}}
    continuous = {**event(8), "usage": {"prompt_tokens": 50, "completion_tokens": 1, "total_tokens": 51}}
    out = [c async for c in s.chunks(events(event(7), continuous, usage_event))]
    assert out[1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}  # this chunk counted
    assert out[2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


async def test_end_marks_open_choices_only() -> None:
    s = session(FakeRender())
    async for _ in s.chunks(events(event(7, finish="stop"), event(5, index=1))):
        pass
    s.end(ChoicePhase.CANCELLED)
    assert s.choice(0).phase is ChoicePhase.DONE and s.choice(1).phase is ChoicePhase.CANCELLED


async def test_the_prompt_stays_home_only_once_the_sidecar_shows_the_plain_path() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "a long conversation"}], "logprobs": True}
    plain, parser = FakeRender(), FakeRender()
    parser.replay_buffer = True
    for render in (plain, parser):
        s = StreamingRenderSession(
            render, "chat", body, PROMPT, request_id="r", public_id="chatcmpl-r",  # type: ignore[arg-type]
            settings=StreamSettings(chunk_timeout_s=1.0),
        )
        out = [c async for c in s.chunks(events(event(7), event(8), event(9, finish="stop")))]
        assert len(out) == 3
    # Plain path: the first call seeds from the prompt, later ones carry only the decoding options.
    assert [c[2] for c in plain.calls] == [PROMPT, None, None]
    assert plain.requests[0] is body
    assert plain.requests[1] == plain.requests[2] == {**body, "messages": [{"role": "user", "content": ""}]}
    # Parser path: it replays from scratch on every call, so every call carries everything.
    assert [c[2] for c in parser.calls] == [PROMPT] * 3 and all(r is body for r in parser.requests)


async def test_an_echoed_completion_always_carries_its_prompt() -> None:
    render = FakeRender()
    body = {"model": "m", "prompt": "say it again", "echo": True}
    s = StreamingRenderSession(
        render, "completions", body, PROMPT, request_id="r", public_id="cmpl-r",  # type: ignore[arg-type]
        settings=StreamSettings(chunk_timeout_s=1.0),
    )
    assert len([c async for c in s.chunks(events(event(7), event(8, finish="stop")))]) == 2
    assert all(r is body for r in render.requests) and [c[2] for c in render.calls] == [PROMPT, PROMPT]


@pytest.mark.parametrize("kind, body, bare", [
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, True),
    ("chat", {"model": "m", "messages": [], "skip_special_tokens": True, "logprobs": False}, True),
    ("completions", {"model": "m", "prompt": "hi", "max_tokens": 3}, True),
    # An option the plain path reads, away from derender's default: every call carries it.
    ("chat", {"model": "m", "messages": [], "skip_special_tokens": False}, False),
    ("chat", {"model": "m", "messages": [], "spaces_between_special_tokens": False}, False),
    ("chat", {"model": "m", "messages": [], "return_token_ids": True}, False),
    ("chat", {"model": "m", "messages": [], "logprobs": True}, False),
    ("completions", {"model": "m", "prompt": "hi", "logprobs": 0}, False),
])
async def test_a_plain_path_call_goes_without_the_request_only_where_derender_reads_none_of_it(
    kind: str, body: dict[str, Any], bare: bool,
) -> None:
    render = FakeRender()
    s = StreamingRenderSession(
        render, kind, body, PROMPT, request_id="r", public_id="x-r",  # type: ignore[arg-type]
        settings=StreamSettings(chunk_timeout_s=1.0),
    )
    with_logprobs = {**event(9), "choices": [{**event(9)["choices"][0], "logprobs": {"content": []}}]}
    usage = {"request_id": "g", "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}, "choices": []}
    out = [c async for c in s.chunks(events(event(7), event(8), with_logprobs, event(10, finish="stop"), usage))]
    assert len(out) == 5
    slim = slim_request(kind, body)  # type: ignore[arg-type]
    # The first call seeds from the whole request. Later: none on the plain middle call, where
    # allowed; the slim request where the event has logprobs or finishes its choice. The usage
    # event has no choice, so no state: it goes whole, as a first call.
    assert render.requests == [body, None if bare else slim, slim, slim, body]


async def test_it_keeps_committed_ids_at_two_bytes_while_they_fit_and_widens_for_larger_ones() -> None:
    s = session(FakeRender())
    wide = [5, 70_000, 2**40]
    chunks = s.chunks(events(event(7), event(8), *(event(t) for t in wide), event(9, finish="length")))
    async for _ in chunks:
        if len(s.choice(0).output_ids) == 2:
            assert s.choice(0).output_ids.itemsize == 2  # a relay ledger of 2 bytes an id
    ids = s.choice(0).output_ids
    assert list(ids) == [7, 8, *wide, 9] and ids.itemsize == 8 and s.committed_ids == [7, 8, *wide, 9]


def test_a_packed_stream_state_goes_back_byte_for_byte_and_keeps_only_its_json() -> None:
    state = {"prefix_offset": 3, "read_offset": 5, "tokens": list(range(40)), "text": "é\u2028x", "none": None}
    packed = packed_state(state)
    assert isinstance(packed, bytes) and unpacked_state(packed) == state
    # orjson's own bytes keep its 8 KiB output buffer; what a held-back stream keeps is the JSON.
    assert sys.getsizeof(packed) < len(packed) + 64
    body = {"stream": True, "generate_chunk": event(7), "stream_state": state, "prompt_tokens": 4}
    assert json_codec.dumps({**body, "stream_state": packed}) == json_codec.dumps(body)
    # The standard library's fallback (an integer past 64 bits elsewhere in the body) too.
    huge = {**body, "seed": 2**70}
    assert json.loads(json_codec.dumps({**huge, "stream_state": packed})) == json.loads(json_codec.dumps(huge))
    assert packed_state(None) is None and unpacked_state(None) is None


async def test_a_sidecar_state_is_kept_packed_and_handed_back_to_the_next_call() -> None:
    render = FakeRender()
    render.kept = packed_state  # type: ignore[method-assign]  # as RenderClient keeps it
    s = session(render)
    async for _ in s.chunks(events(event(7), event(8), event(9, finish="length"))):
        pass
    states = [c[1] for c in render.calls]
    assert states[0] is None and all(isinstance(st, bytes) for st in states[1:])
    assert [unpacked_state(st) for st in states[1:]] == [{"chunks": 1}, {"chunks": 2}]
    # The plain path was still proven from the answer (no prompt ids after the first call).
    assert [c[2] for c in render.calls] == [PROMPT, None, None]
