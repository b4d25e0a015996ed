"""The coordinator's own stream derender (derender/local_stream.py) against the real vLLM sidecar.

The gate for ``RenderConfig.local_stream_detokenize``: the real vLLM 0.33 render sidecar (no
parsers) and ``LocalStreamDerenderer`` over the tiny model's files are given the same generated
streams, and must answer byte for byte the same:

- per call (``derender_chunk``): the chunk (all but ``created``, a clock) and the carried
  ``stream_state``, with the request sent or left out as the session leaves it out;
- per stream (``StreamingRenderSession`` with the stop-string hold-back): every chunk the client
  would be handed, the committed ids and the usage.

The ids are random over the whole vocabulary (out-of-range ids too), runs of single-byte tokens
that split multi-byte UTF-8 characters across ids and chunks, special and added tokens, the
model's EOS ids ending a stream with and without a reported stop reason; the options are
``skip_special_tokens`` and ``spaces_between_special_tokens`` both ways, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output`` both ways, stop strings (the engine's stop
reason, spanning chunk boundaries) and ``return_token_ids``; the chunk boundaries are drawn too.
Hypothesis runs derandomized (the same cases every run).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from motorsite import stack
from serving.pipeline.derender.holdback import ChunkHoldback, derender_request
from serving.pipeline.derender.local_stream import LocalStreamDerenderer, local_stream_derenderer
from serving.pipeline.derender.session import StreamingRenderSession
from serving.pipeline.http11 import Http11Client
from serving.pipeline.render.client import RenderClient

pytestmark = pytest.mark.integration

MODEL = "tiny"
EOS, OTHER_EOS = 2, 0  # the tokenizer's EOS, and generation_config.json's other one
ADDED = list(range(0, 9))  # <|endoftext|> <|im_start|> <|im_end|> special; <tool_call> ... <think> added
MULTIBYTE = "é中😀€ñ𝄞"


class Pair:
    """The sidecar's client and the local derenderer, on one event loop for the whole module."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sidecar: RenderClient, local: LocalStreamDerenderer,
                 byte_ids: list[int]) -> None:
        self.loop, self.sidecar, self.local, self.byte_ids = loop, sidecar, local, byte_ids

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)


@pytest.fixture(scope="module")
def pair(base_config: stack.StackConfig, tiers: stack.StackConfig) -> Iterator[Pair]:
    """The sidecar is the session's (``conftest.tiers``: no parsers), which test_local_stream_real uses next."""
    local = local_stream_derenderer(base_config.model_dir, 30.0)
    # The byte-level alphabet's tokens, by byte: every byte alone, so a character's bytes can be split.
    table = _bytes_to_unicode()
    byte_ids = [local._hf.convert_tokens_to_ids(table[b]) for b in range(256)]
    loop = asyncio.new_event_loop()
    client = Http11Client()
    try:
        yield Pair(loop, RenderClient(client, f"http://127.0.0.1:{tiers.render_port}", 30.0), local, byte_ids)
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()


def _split_utf8(byte_ids: list[int]) -> st.SearchStrategy[list[int]]:
    """The single-byte token ids of a run of multi-byte characters (maybe cut short)."""

    def ids(text: str, cut: int) -> list[int]:
        out = [byte_ids[b] for b in text.encode()]
        return out[:len(out) - cut] if cut else out

    return st.builds(ids, st.text(alphabet=MULTIBYTE, min_size=1, max_size=3), st.integers(0, 2))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table: the ByteLevel vocabulary's token for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


@st.composite
def streams(draw: st.DrawFn, byte_ids: list[int]) -> dict[str, Any]:
    pieces = draw(st.lists(st.one_of(
        st.lists(st.integers(0, 4095), min_size=1, max_size=4),  # anything in the vocabulary
        st.lists(st.sampled_from(ADDED), min_size=1, max_size=2),  # special and added tokens
        _split_utf8(byte_ids),
        st.builds(lambda n: [4096 + n], st.integers(0, 50)),  # beyond the tokenizer: decoded as nothing
    ), min_size=1, max_size=6))
    ids = [i for piece in pieces for i in piece]
    ending = draw(st.sampled_from(["length", "eos", "other_eos", "stop_token", "stop_string", "eos_reported"]))
    body: dict[str, Any] = {"model": MODEL, "stream": True}
    kind = draw(st.sampled_from(["chat", "completions"]))
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    for key in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                "ignore_eos", "return_token_ids"):
        value = draw(st.sampled_from([None, True, False]))
        if value is not None:
            body[key] = value
    stop_reason: Any = None
    finish = "stop"
    if ending == "length":
        finish = "length"
    elif ending in ("eos", "eos_reported"):
        ids.append(EOS)
        stop_reason = EOS if ending == "eos_reported" else None
    elif ending == "other_eos":
        ids.append(OTHER_EOS)
    elif ending == "stop_token":
        token = draw(st.integers(9, 4095))
        body["stop_token_ids"] = [token]
        ids.append(token)
    else:
        stop_reason = draw(st.sampled_from(["a", " the", "e", "\n", "中"]))
        body["stop"] = [stop_reason, "zz"]
    # Chunk boundaries: any split of the ids into runs (one id a chunk is vLLM's default cadence).
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(ids) - 1)), max_size=len(ids))))
    bounds = [0, *[c for c in cuts if c < len(ids)], len(ids)]
    runs = [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    prompt = draw(st.lists(st.integers(0, 4095), min_size=0, max_size=9))
    usage = draw(st.sampled_from(["none", "final", "continuous"]))
    events = []
    done = 0
    for n, run in enumerate(runs):
        done += len(run)
        last = n == len(runs) - 1
        event: dict[str, Any] = {"request_id": "gen-1", "choices": [{
            "index": 0, "token_ids": run, "finish_reason": finish if last else None,
            "stop_reason": stop_reason if last else None}]}
        if usage == "continuous":
            event["usage"] = {"prompt_tokens": len(prompt), "completion_tokens": done,
                              "total_tokens": len(prompt) + done}
        events.append(event)
    if usage != "none":
        events.append({"request_id": "gen-1", "choices": [], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}})
    return {"kind": kind, "body": body, "prompt": prompt, "events": events}


def _without_clock(chunk: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in chunk.items() if k != "created"}


async def _calls(derender: Any, case: dict[str, Any], leave_out: bool) -> list[Any]:
    """Each call's (chunk, state), the request and prompt ids sent as a session sends them."""
    body = derender_request(case["body"])
    state, out = None, []
    for event in case["events"]:
        first = state is None
        finishes = any(c.get("finish_reason") for c in event["choices"])
        request = body if (first or finishes or not leave_out) else None
        chunk, state = await derender.derender_chunk(
            case["kind"], event, stream_state=state, prompt_tokens=len(case["prompt"]),
            prompt_token_ids=case["prompt"] if first else None, request=request, model=MODEL)
        out.append((_without_clock(chunk), state))
    return out


async def _session(derender: Any, case: dict[str, Any]) -> tuple[list[Any], list[int], dict[str, int]]:
    """What a client is handed through the session and its stop-string hold-back."""
    kind, body = case["kind"], case["body"]
    session = StreamingRenderSession(derender, kind, derender_request(body), case["prompt"], request_id="r",
                                     public_id="pub", holdback=ChunkHoldback(kind, body))

    async def batches() -> Any:
        for event in case["events"]:
            yield [{**event, "choices": [dict(c) for c in event["choices"]]}]

    chunks = [_without_clock(c) async for c in session.chunks(batches())]
    return chunks, session.committed_ids, session.usage()


CASES = settings(max_examples=150, derandomize=True, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@given(data=st.data())
@CASES
def test_each_call_matches_the_sidecar(pair: Pair, data: st.DataObject) -> None:
    case = data.draw(streams(pair.byte_ids))
    leave_out = data.draw(st.booleans())
    if leave_out and any(case["body"].get(k) is False for k in ("skip_special_tokens", "spaces_between_special_tokens")):
        leave_out = False  # the session sends the request on every call when an option is not derender's default
    if case["body"].get("return_token_ids"):
        leave_out = False
    expected = pair.run(_calls(pair.sidecar, case, leave_out))
    assert pair.run(_calls(pair.local, case, leave_out)) == expected


@given(data=st.data())
@CASES
def test_the_client_is_handed_what_the_sidecar_makes(pair: Pair, data: st.DataObject) -> None:
    case = data.draw(streams(pair.byte_ids))
    expected = pair.run(_session(pair.sidecar, case))
    assert pair.run(_session(pair.local, case)) == expected


def test_a_split_character_waits_for_its_last_byte(pair: Pair) -> None:
    """The hand-picked case: 😀's four bytes in four chunks give one delta, on the fourth."""
    ids = [pair.byte_ids[b] for b in "😀".encode()]
    case = {"kind": "completions", "body": {"model": MODEL, "prompt": "hi", "stream": True}, "prompt": [300],
            "events": [{"request_id": "g", "choices": [{"index": 0, "token_ids": [i], "finish_reason": None}]}
                       for i in ids]}
    local = pair.run(_calls(pair.local, case, leave_out=True))
    assert [c["choices"][0]["text"] for c, _ in local] == ["", "", "", "😀"]
    assert local == pair.run(_calls(pair.sidecar, case, leave_out=True))
