"""Stop-string hold-back on the streaming token-only path (serving/pipeline/dederender/holdback.py).

The reference is a transcription of vLLM's ``BaseIncrementalDetokenizer.update`` /
``get_next_output_text`` and ``check_stop_strings`` (vllm/v1/engine/detokenizer.py), fed one
token's text per step: the engine stops where it does, and the coordinator's hold-back must send
exactly the deltas native vLLM sends.
"""

from __future__ import annotations

import sys
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from serving.pipeline.derender.holdback import ChunkHoldback, StopHoldback, derender_request, stop_strings
from serving.pipeline.derender.session import PendingChunk


def check_stop_strings(output_text: str, new_char_count: int, stop: list[str], include: bool) -> tuple[str, int] | None:
    if not new_char_count or not stop:
        return None
    best: str | None = None
    best_index = 0
    best_end = sys.maxsize
    for s in stop:
        i = output_text.find(s, 1 - new_char_count - len(s))
        if i == -1:
            continue
        if i + len(s) < best_end:
            best, best_index, best_end = s, i, i + len(s)
    if best is None:
        return None
    if include:
        return (best, -1) if best_end >= len(output_text) else (best, best_end)
    return best, best_index


def native(pieces: list[str], stop: list[str], include: bool, min_tokens: int = 0) -> tuple[list[str], int, str | None]:
    """vLLM's detokenizer over ``pieces``: (deltas sent, tokens generated, stop string matched)."""
    text = ""
    sent = 0
    buffer = 0 if include or not stop else max(len(s) for s in stop) - 1
    deltas = []
    for n, piece in enumerate(pieces, start=1):
        before = len(text)
        text += piece
        matched = None
        if n > min_tokens:
            hit = check_stop_strings(text, len(text) - before, stop, include)
            if hit is not None:
                matched, cut = hit
                if cut != -1:
                    text = text[:cut]
        finished = matched is not None or n == len(pieces)
        end = len(text) - (0 if finished else buffer)
        deltas.append(text[sent:end] if end > sent else "")
        sent = max(sent, end)
        if matched is not None:
            return deltas, n, matched
    return deltas, len(pieces), None


def coordinator(pieces: list[str], stop: list[str], include: bool, stop_reason: str | None) -> list[str]:
    hold = StopHoldback(stop, include_in_output=include)
    return [hold.feed(p, finished=i == len(pieces) - 1, stop_reason=stop_reason) for i, p in enumerate(pieces)]


PIECES = st.lists(st.text(alphabet="ab\n\u00e9", min_size=0, max_size=3), min_size=1, max_size=25)
STOPS = st.lists(st.text(alphabet="ab\n\u00e9", min_size=1, max_size=4), min_size=1, max_size=3)


@settings(max_examples=400, deadline=None)
@given(PIECES, STOPS, st.booleans())
def test_it_sends_exactly_the_deltas_native_vllm_sends(pieces: list[str], stop: list[str], include: bool) -> None:
    expected, generated, matched = native(pieces, stop, include)
    # The engine stopped after ``generated`` tokens; derender gives their raw text one per chunk.
    got = coordinator(pieces[:generated], stop, include, matched)
    assert got == expected


@settings(max_examples=200, deadline=None)
@given(PIECES, STOPS, st.booleans(), st.integers(1, 4))
def test_it_concatenates_to_native_when_chunks_carry_several_tokens(
    pieces: list[str], stop: list[str], include: bool, group: int
) -> None:
    """Coalesced chunks (several tokens per derender call) give the same text in fewer deltas."""
    expected, generated, matched = native(pieces, stop, include)
    kept = pieces[:generated]
    chunks = ["".join(kept[i:i + group]) for i in range(0, len(kept), group)]
    assert "".join(coordinator(chunks, stop, include, matched)) == "".join(expected)


@settings(max_examples=200, deadline=None)
@given(PIECES, STOPS, st.booleans(), st.integers(0, 5))
def test_it_cuts_at_the_stop_that_ended_generation_despite_earlier_ones_under_min_tokens(
    pieces: list[str], stop: list[str], include: bool, min_tokens: int
) -> None:
    expected, generated, matched = native(pieces, stop, include, min_tokens)
    assert "".join(coordinator(pieces[:generated], stop, include, matched)) == "".join(expected)


def test_it_never_sends_the_start_of_a_stop_string_early() -> None:
    hold = StopHoldback(["STOP"])
    assert hold.feed("hello S", finished=False) == "hell"
    assert hold.feed("T", finished=False) == "o"
    assert hold.feed("OP and more", finished=True, stop_reason="STOP") == " "


def test_it_flushes_held_text_when_the_stream_ends_for_another_reason() -> None:
    hold = StopHoldback(["xyz"])
    assert hold.feed("abcxy", finished=False) == "abc"
    assert hold.feed("", finished=True, stop_reason=None) == "xy"
    assert hold.feed("late", finished=True) == ""


def test_it_keeps_memory_bounded_over_a_long_stream() -> None:
    hold = StopHoldback(["<end>"])
    for _ in range(10_000):
        hold.feed("token ", finished=False)
    assert len(hold._tail) <= 2 * len("<end>") + len("token ")


def _pending(chunk: dict[str, Any], ids: tuple[int, ...] = (1,)) -> PendingChunk:
    choices = chunk.get("choices") or []
    index = choices[0]["index"] if choices else None
    return PendingChunk(chunk, index, {"n": len(ids)}, ids, choices[0].get("finish_reason") if choices else None)


def _chat(index: int, content: str, finish: str | None = None, stop_reason: str | None = None) -> PendingChunk:
    return _pending({"choices": [{"index": index, "delta": {"content": content}, "finish_reason": finish,
                                  "stop_reason": stop_reason}]})


def test_it_holds_whole_chunks_per_choice_and_cuts_the_last_at_the_stop_string() -> None:
    body = {"stop": ["!!", ""], "include_stop_str_in_output": False, "messages": []}
    assert stop_strings(body) == ["!!"]
    assert "stop" not in derender_request(body) and derender_request(body)["messages"] == []
    chat = ChunkHoldback("chat", body)
    c1 = _chat(0, "hi!")
    assert chat.release(c1) == []  # its last character may start "!!": the whole chunk waits
    c2 = _chat(1, "yo")
    assert chat.release(c2) == []  # choices are held apart
    c3 = _chat(0, "ok!")
    assert chat.release(c3) == [c1]  # c1's text now ends 3 characters before the end: sent whole
    assert c1.chunk["choices"][0]["delta"]["content"] == "hi!"
    c4 = _chat(0, "! tail", "stop", "!!")
    assert chat.release(c4) == [c3, c4]  # the finish releases the rest, cut at the stop string
    assert [c.chunk["choices"][0]["delta"]["content"] for c in (c3, c4)] == ["ok", None]
    comp = ChunkHoldback("completions", {"stop": "zz", "include_stop_str_in_output": True})
    out = _pending({"choices": [{"index": 0, "text": "abzz", "finish_reason": "stop", "stop_reason": "zz"}]})
    assert comp.release(out) == [out] and out.chunk["choices"][0]["text"] == "abzz"
    assert not ChunkHoldback("chat", {"messages": []}).active


def test_a_stop_string_across_held_chunks_is_cut_where_it_starts() -> None:
    comp = ChunkHoldback("completions", {"stop": ["END"]})
    pieces = [_pending({"choices": [{"index": 0, "text": t, "finish_reason": None}]}) for t in ("ab", "cE", "N")]
    released = [p for piece in pieces for p in comp.release(piece)]
    last = _pending({"choices": [{"index": 0, "text": "Dxy", "finish_reason": "stop", "stop_reason": "END"}]})
    released += comp.release(last)
    assert released == [*pieces, last]
    assert "".join(p.chunk["choices"][0]["text"] for p in released) == "abc"


def test_discard_forgets_what_an_attempt_left_held() -> None:
    comp = ChunkHoldback("completions", {"stop": ["END"]})
    first = _pending({"choices": [{"index": 0, "text": "abcd", "finish_reason": None}]})
    assert comp.release(first) == []
    comp.discard()  # the attempt failed: "abcd" was never the client's, a relay regenerates it
    again = _pending({"choices": [{"index": 0, "text": "xyz", "finish_reason": "length"}]})
    assert comp.release(again) == [again] and again.chunk["choices"][0]["text"] == "xyz"


@settings(max_examples=300, deadline=None)
@given(PIECES, STOPS, st.booleans(), st.integers(1, 4))
def test_whole_chunks_concatenate_to_native_vllms_text(
    pieces: list[str], stop: list[str], include: bool, group: int
) -> None:
    """``ChunkHoldback``, what the stream uses, against native vLLM: chunks of several tokens, a
    stop string that starts in a chunk already handed on (include_stop_str_in_output holds
    nothing back, so it always may), the cut inside the finishing chunk."""
    expected, generated, matched = native(pieces, stop, include)
    kept = pieces[:generated]
    texts = ["".join(kept[i:i + group]) for i in range(0, len(kept), group)] or [""]
    hold = ChunkHoldback("completions", {"stop": stop, "include_stop_str_in_output": include})
    sent: list[PendingChunk] = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        finish = ("stop" if matched is not None else "length") if last else None
        sent += hold.release(_pending({"choices": [{"index": 0, "text": text, "finish_reason": finish,
                                                    "stop_reason": matched if last else None}]}))
    assert "".join(p.chunk["choices"][0]["text"] for p in sent) == "".join(expected)


def test_an_included_stop_string_begun_in_a_chunk_already_sent_is_cut_after_it() -> None:
    # Seen against real vLLM (stop "rut", include_stop_str_in_output, coalesced chunks): the last
    # chunk "utc" finished on the stop string begun in "r", and went out whole.
    comp = ChunkHoldback("completions", {"stop": ["rut"], "include_stop_str_in_output": True})
    first = _pending({"choices": [{"index": 0, "text": "ORDHeader", "finish_reason": None}]})
    assert comp.release(first) == [first]
    last = _pending({"choices": [{"index": 0, "text": "utc", "finish_reason": "stop", "stop_reason": "rut"}]})
    assert comp.release(last) == [last] and last.chunk["choices"][0]["text"] == "ut"
