"""Stop-string hold-back on the streaming token-only path (serving/pipeline/dederender/holdback.py).

The reference is a transcription of vLLM's ``BaseIncrementalDetokenizer.update`` /
``get_next_output_text`` and ``check_stop_strings`` (vllm/v1/engine/detokenizer.py), fed one
token's text per step: the engine stops where it does, and the coordinator's hold-back must send
exactly the deltas native vLLM sends.
"""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from serving.pipeline.derender.holdback import ChunkHoldback, StopHoldback, derender_request, stop_strings


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


def test_it_rewrites_chat_and_completion_chunks_per_choice() -> None:
    body = {"stop": ["!!", ""], "include_stop_str_in_output": False, "messages": []}
    assert stop_strings(body) == ["!!"]
    assert "stop" not in derender_request(body) and derender_request(body)["messages"] == []
    chat = ChunkHoldback("chat", body)
    c1 = chat.apply({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi!"}, "finish_reason": None}]})
    assert c1["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    c2 = chat.apply({"choices": [{"index": 1, "delta": {"content": "yo"}, "finish_reason": None}]})
    assert c2["choices"][0]["delta"]["content"] == "y"
    c3 = chat.apply({"choices": [{"index": 0, "delta": {"content": "! tail"}, "finish_reason": "stop",
                                  "stop_reason": "!!"}]})
    assert c3["choices"][0]["delta"]["content"] is None
    comp = ChunkHoldback("completions", {"stop": "zz", "include_stop_str_in_output": True})
    out = comp.apply({"choices": [{"index": 0, "text": "abzz", "finish_reason": "stop", "stop_reason": "zz"}]})
    assert out["choices"][0]["text"] == "abzz"
    assert not ChunkHoldback("chat", {"messages": []}).active
