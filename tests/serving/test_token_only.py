"""Unit tests of the engine-request builder (serving.pipeline.engine.requests)."""

from __future__ import annotations

import copy

import pytest

from serving.pipeline.engine.requests import (
    RENDER_OMITTED_MAX_TOKENS,
    engine_request,
    resolved_max_tokens,
    sorted_choices,
)


def _rendered(**sampling: object) -> dict:
    params = {"temperature": 0.2, "top_p": 1.0, "stop": [], "stop_token_ids": [], "output_kind": 2}
    params.update(sampling)
    return {
        "request_id": "chatcmpl-abc",
        "token_ids": [151644, 872, 198],
        "sampling_params": params,
        "model": "tiny",
        "output_mode": "tokens",
        "parse_context": {"tools": None, "tool_choice": "none"},
        "stream": False,
        "stream_options": None,
        "priority": 0,
    }


def test_missing_max_tokens_means_sixteen() -> None:
    assert RENDER_OMITTED_MAX_TOKENS == 16
    rendered = _rendered()
    assert "max_tokens" not in rendered["sampling_params"]
    assert engine_request(rendered, request_id="r")["sampling_params"]["max_tokens"] == 16
    assert resolved_max_tokens(rendered) == 16


def test_null_max_tokens_also_means_sixteen() -> None:
    assert engine_request(_rendered(max_tokens=None), request_id="r")["sampling_params"]["max_tokens"] == 16


def test_missing_sampling_params_gets_max_tokens_sixteen() -> None:
    rendered = _rendered()
    del rendered["sampling_params"]
    assert engine_request(rendered, request_id="r")["sampling_params"] == {"max_tokens": 16}


@pytest.mark.parametrize("value", [1, 15, 17, 64, 8180])
def test_present_max_tokens_is_kept(value: int) -> None:
    assert engine_request(_rendered(max_tokens=value), request_id="r")["sampling_params"]["max_tokens"] == value
    assert resolved_max_tokens(_rendered(max_tokens=value)) == value


def test_everything_else_travels_as_render_wrote_it() -> None:
    rendered = _rendered(max_tokens=64)
    out = engine_request(rendered, request_id="chatcmpl-abc-a1")
    expected = copy.deepcopy(rendered)
    expected["request_id"] = "chatcmpl-abc-a1"
    assert out == expected


def test_request_id_is_set_per_attempt() -> None:
    rendered = _rendered()
    first = engine_request(rendered, request_id="chatcmpl-abc")
    retry = engine_request(rendered, request_id="chatcmpl-abc-a1")
    assert first["request_id"] == "chatcmpl-abc"
    assert retry["request_id"] == "chatcmpl-abc-a1"


def test_input_is_not_mutated() -> None:
    rendered = _rendered()
    before = copy.deepcopy(rendered)
    out = engine_request(rendered, request_id="other")
    out["sampling_params"]["temperature"] = 9.9
    assert rendered == before
    assert out["sampling_params"] is not rendered["sampling_params"]


def test_sorted_choices_orders_by_index_without_mutating() -> None:
    response = {"request_id": "generate-tokens-x", "choices": [{"index": 2}, {"index": 0}, {"index": 1}]}
    before = copy.deepcopy(response)
    out = sorted_choices(response)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["request_id"] == "generate-tokens-x"
    assert response == before


def test_sorted_choices_tolerates_missing_choices_and_index() -> None:
    assert sorted_choices({"request_id": "x"})["choices"] == []
    out = sorted_choices({"choices": [{"index": 1, "t": "b"}, {"t": "a"}]})
    assert [c["t"] for c in out["choices"]] == ["a", "b"]  # a missing index counts as 0
