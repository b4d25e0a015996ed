"""The engine client's streamed events, a list per read (serving/pipeline/engine/client.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from serving.pipeline.engine.client import EngineClient
from serving.pipeline.errors import EngineError, UpstreamRequestError
from tests.serving.fakes import instance
from tests.serving.in_process import InProcessClient


def _frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _token(t: int) -> dict[str, Any]:
    return {"request_id": "generate-tokens-x", "choices": [{"index": 0, "token_ids": [t], "finish_reason": None}]}


def _engine(*pieces: bytes) -> EngineClient:
    async def body() -> Any:
        for piece in pieces:
            yield piece

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    # In process: what is asserted is what one read of the stream brings, and a socket would
    # merge the pieces (in_process.py).
    return EngineClient(InProcessClient(handler))


async def _reads(engine: EngineClient) -> tuple[list[list[dict[str, Any]]], BaseException | None]:
    reads: list[list[dict[str, Any]]] = []
    try:
        async with engine.generate_stream(instance("e1"), {"request_id": "x", "token_ids": [1]}) as events:
            async for batch in events:
                reads.append(list(batch))
    except (EngineError, UpstreamRequestError) as exc:
        return reads, exc
    return reads, None


async def test_events_that_arrived_together_come_as_one_list() -> None:
    reads, error = await _reads(_engine(_frame(_token(1)), _frame(_token(2)) + _frame(_token(3)), b"data: [DONE]\n\n"))
    assert error is None
    assert reads == [[_token(1)], [_token(2), _token(3)]]


@pytest.mark.parametrize(("code", "raised"), [(500, EngineError), (400, UpstreamRequestError)])
async def test_an_error_event_inside_a_read_comes_after_the_events_before_it(
    code: int, raised: type[BaseException]
) -> None:
    error = {"error": {"message": "boom", "type": "X", "param": None, "code": code}}
    # The events after the error in the same read are never handed on: the stream ended there.
    reads, exc = await _reads(_engine(_frame(_token(1)) + _frame(_token(2)) + _frame(error) + _frame(_token(3))))
    assert reads == [[_token(1), _token(2)]]
    assert isinstance(exc, raised)


async def test_an_error_event_first_in_a_read_hands_on_nothing_of_that_read() -> None:
    error = {"error": {"message": "boom", "type": "X", "param": None, "code": 500}}
    reads, exc = await _reads(_engine(_frame(_token(1)), _frame(error) + _frame(_token(2))))
    assert reads == [[_token(1)]]
    assert isinstance(exc, EngineError)


async def test_a_stream_cut_inside_a_read_is_an_engine_error_after_what_was_whole() -> None:
    reads, exc = await _reads(_engine(_frame(_token(1)) + b'data: {"request_id": "gen'))
    assert reads == [[_token(1)]]
    assert isinstance(exc, EngineError)


@pytest.mark.parametrize(
    ("bad", "where"),
    [
        ({"choices": [{"index": 0, "token_ids": ["7"], "finish_reason": None}]}, "$.choices[0].token_ids[0]"),
        ({"choices": [{"index": 0, "finish_reason": "stop"}]}, "token_ids"),
        ({"choices": {"index": 0, "token_ids": [7]}}, "$.choices"),
        ({"choices": [{"index": "0", "token_ids": [7]}]}, "$.choices[0].index"),
    ],
)
async def test_an_event_not_shaped_as_vllms_is_an_engine_error_after_the_events_before_it(
    bad: dict[str, Any], where: str
) -> None:
    reads, exc = await _reads(_engine(_frame(_token(1)), _frame(_token(2)) + _frame(bad) + _frame(_token(3))))
    assert reads == [[_token(1)], [_token(2)]]
    assert isinstance(exc, EngineError) and exc.instance == "e1"
    assert "e1 sent an unusable generate event" in str(exc) and where in str(exc)


async def test_the_usage_event_and_texts_extra_fields_pass() -> None:
    usage = {"request_id": "generate-tokens-x", "usage": {"prompt_tokens": 3, "completion_tokens": 1,
             "total_tokens": 4, "prompt_tokens_details": None}, "output_mode": "tokens", "choices": []}  # fmt: skip
    token = {**_token(1), "usage": None, "output_mode": "tokens", "prompt_token_ids": [5, 6]}
    token["choices"][0] |= {"stop_reason": None, "routed_experts": None, "logprobs": None}
    reads, error = await _reads(_engine(_frame(token) + _frame(usage), b"data: [DONE]\n\n"))
    assert error is None and reads == [[token, usage]]
