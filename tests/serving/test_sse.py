"""Unit tests of SSE framing and parsing (serving.pipeline.sse)."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import httpx
import pytest

from serving.pipeline import json_codec
from serving.pipeline.request_checks import RESPONSE_CONTROLS
from serving.pipeline.sse import DONE, FieldScrub, SSEProtocolError, StreamTruncated, frame, iter_event_batches


async def _pieces(*pieces: bytes) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


def _lines(*lines: str) -> AsyncIterator[bytes]:
    """Each line its own piece of the body, as an engine writing them one by one would."""
    return _pieces(*(line.encode() + b"\n" for line in lines))


async def _batches(pieces: AsyncIterator[bytes]) -> list[list[dict]]:
    return [b async for b in iter_event_batches(pieces)]


async def _collect(pieces: AsyncIterator[bytes]) -> list[dict]:
    return [e for b in await _batches(pieces) for e in b]


def test_frame_is_one_compact_data_line_and_a_blank_line() -> None:
    out = frame({"a": 1, "b": [1, 2], "c": None})
    assert out == b'data: {"a":1,"b":[1,2],"c":null}\n\n'


def test_frame_keeps_non_ascii_text_as_utf8() -> None:
    out = frame({"content": "héllo ✓ 你好"})
    assert "héllo ✓ 你好".encode() in out  # not \u-escaped
    assert json.loads(out[len(b"data: "):]) == {"content": "héllo ✓ 你好"}


def test_frame_escapes_newlines_so_an_event_stays_on_one_line() -> None:
    out = frame({"content": "a\nb\n\nc"})
    assert out.count(b"\n") == 2 and out.endswith(b"\n\n")


def test_done_marker_is_exactly_what_openai_clients_expect() -> None:
    assert DONE == b"data: [DONE]\n\n"


async def test_iter_events_yields_objects_in_order_and_stops_at_done() -> None:
    events = await _collect(_lines('data: {"i":1}', "", 'data: {"i":2}', "", "data: [DONE]", 'data: {"i":3}'))
    assert events == [{"i": 1}, {"i": 2}]


async def test_iter_events_accepts_data_without_a_space_after_the_colon() -> None:
    assert await _collect(_lines('data:{"i":1}', "data:[DONE]")) == [{"i": 1}]


async def test_iter_events_skips_comments_blank_lines_and_other_fields() -> None:
    events = await _collect(
        _lines(": keep-alive", "", "event: message", "id: 7", "retry: 10", 'data: {"i":1}', "", "data: [DONE]")
    )
    assert events == [{"i": 1}]


async def test_a_stream_that_ends_before_done_is_truncated() -> None:
    seen = []
    with pytest.raises(StreamTruncated):
        async for b in iter_event_batches(_lines('data: {"i":1}', "")):
            seen.extend(b)
    assert seen == [{"i": 1}]  # what came before the drop was still delivered


async def test_an_empty_stream_is_truncated() -> None:
    with pytest.raises(StreamTruncated):
        await _collect(_lines())


async def test_truncation_is_a_protocol_error() -> None:
    assert issubclass(StreamTruncated, SSEProtocolError)


@pytest.mark.parametrize("data", ["{not json", '"a string"', "[1, 2]", "42"])
async def test_data_that_is_not_a_json_object_is_a_protocol_error_not_truncation(data: str) -> None:
    with pytest.raises(SSEProtocolError) as info:
        await _collect(_lines(f"data: {data}", "data: [DONE]"))
    assert not isinstance(info.value, StreamTruncated)


async def test_frames_round_trip_through_httpx_line_splitting_across_chunk_boundaries() -> None:
    payloads = [{"i": 0, "t": "x\ny"}, {"i": 1, "t": "✓"}, {"i": 2, "t": ""}]
    raw = b"".join(frame(p) for p in payloads) + DONE
    # Cut the byte stream at awkward places: inside "data:", inside a UTF-8 sequence, between \n\n.
    cuts = [3, 11, raw.index("✓".encode()) + 1, len(raw) - len(DONE) + 1, len(raw) - 1]
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    assert b"".join(pieces) == raw

    async def body() -> AsyncIterator[bytes]:
        for p in pieces:
            yield p

    response = httpx.Response(200, content=body())
    assert await _collect(response.aiter_bytes()) == payloads


async def test_events_that_arrive_in_one_piece_come_as_one_batch_in_order() -> None:
    raw = b"".join(frame({"i": i}) for i in range(3))
    assert await _batches(_pieces(raw, frame({"i": 3}), b": keep-alive\n\n", DONE)) == [
        [{"i": 0}, {"i": 1}, {"i": 2}], [{"i": 3}]
    ]


async def test_a_bad_event_inside_a_piece_comes_after_the_events_before_it() -> None:
    seen: list[list[dict]] = []
    with pytest.raises(SSEProtocolError):
        async for b in iter_event_batches(_pieces(frame({"i": 0}) + b"data: {not json\n\n" + frame({"i": 1}))):
            seen.append(b)
    assert seen == [[{"i": 0}]]


async def test_a_last_line_without_its_newline_still_counts() -> None:
    assert await _collect(_pieces(frame({"i": 0}) + b"data: [DONE]")) == [{"i": 0}]
    with pytest.raises(StreamTruncated):
        await _collect(_pieces(b'data: {"i": 0}'))


async def test_crlf_framing_is_accepted() -> None:
    raw = b'data: {"i":1}\r\n\r\ndata: [DONE]\r\n\r\n'
    response = httpx.Response(200, content=raw)
    assert await _collect(response.aiter_bytes()) == [{"i": 1}]


LEAKY = (
    b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    b'data: {"id":"a","choices":[],"kv_transfer_params":{"remote_host":"10.0.0.7","remote_block_ids":[1,2]}}\n\n'
    b'event: response.completed\ndata: {"type":"response.completed","response":{"ec_transfer_params":{"x":1},'
    b'"kv_transfer_params":null,"output":[]}}\n\n'
    + DONE
)


@pytest.mark.parametrize("cut", [None, *range(1, len(LEAKY))])
def test_field_scrub_nulls_engine_controls_wherever_the_chunks_are_cut(cut: int | None) -> None:
    scrub = FieldScrub(RESPONSE_CONTROLS)
    chunks = [LEAKY] if cut is None else [LEAKY[:cut], LEAKY[cut:]]
    out = b"".join(scrub.feed(c) for c in chunks) + scrub.flush()
    assert b"10.0.0.7" not in out and b'"x":1' not in out
    frames = out.split(b"\n\n")
    assert frames[0] == LEAKY.split(b"\n\n")[0]  # frames without the fields pass byte for byte
    assert json.loads(frames[1][5:])["kv_transfer_params"] is None
    completed = json.loads(frames[2].split(b"\n")[1][5:])["response"]
    assert completed == {"ec_transfer_params": None, "kv_transfer_params": None, "output": []}
    assert frames[2].startswith(b"event: response.completed\n") and out.endswith(DONE)


def test_field_scrub_parses_no_frame_whose_fields_are_all_null(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM writes ``"kv_transfer_params":null`` in every chunk: such a frame passes as it is,
    unparsed (a parse would null nothing); one with a field set, in the same chunk, is scrubbed."""
    scrub = FieldScrub(RESPONSE_CONTROLS)
    nulls = (b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"\\"kv_transfer_params\\":1"}}],'
             b'"kv_transfer_params":null,"ec_transfer_params":null}\n\n')
    parsed: list[bytes] = []

    def loads(raw: bytes) -> Any:
        parsed.append(raw)
        return json_codec.loads(raw)

    monkeypatch.setattr("serving.pipeline.sse.loads", loads)
    assert scrub.feed(nulls) is nulls and parsed == []
    assert scrub.feed(nulls[:20]) == b"" and scrub.feed(nulls[20:]) == nulls and parsed == []
    leaky = b'data: {"choices":[],"kv_transfer_params":null,"x":{"kv_transfer_params":{"host":"10.0.0.7"}}}\n\n'
    out = scrub.feed(nulls + leaky)
    assert out.startswith(nulls) and b"10.0.0.7" not in out and len(parsed) == 1
    spaced = b'data: {"choices":[],"kv_transfer_params": null}\n\n'  # parsed, as before: nothing to null
    assert scrub.feed(spaced) == spaced and len(parsed) == 2


def test_field_scrub_passes_unconcerned_whole_frames_as_the_same_object() -> None:
    scrub = FieldScrub(RESPONSE_CONTROLS)
    chunk = b'data: {"choices":[],"kv_transfer_params_note":1}\n\n'  # a longer name is not the field
    assert scrub.feed(chunk) is chunk
    assert scrub.feed(b"data: {") == b"" and scrub.flush() == b"data: {"  # held, then given back at the end
