"""Non-streaming generate, errors, probes and control endpoints, in process."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from enginesim.testing import gen_body

pytestmark = pytest.mark.asyncio

EOS = 2
GENERATE = "/inference/v1/generate"
CHOICE_KEYS = [
    "index", "finish_reason", "stop_reason", "token_ids",
    "routed_experts", "sampling_mask", "weight_versions", "logprobs",
]  # fmt: skip


async def generate(client: httpx.AsyncClient, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    response = await client.post(GENERATE, json=body, **kw)
    assert response.status_code == 200, response.text
    return response.json()


async def outputs(client: httpx.AsyncClient, prompt: list[int], **sampling: Any) -> list[int]:
    data = await generate(client, gen_body(prompt, sampling))
    return data["choices"][0]["token_ids"]


async def test_it_answers_generate_with_vllms_exact_shape(client: httpx.AsyncClient) -> None:
    data = await generate(client, gen_body([5, 6, 7], {"max_tokens": 4, "ignore_eos": True}))
    assert list(data) == [
        "request_id", "model", "created", "usage", "prompt_logprobs",
        "prompt_token_id_logprobs", "prompt_token_ids", "mm_placeholders", "metrics",
        "kv_transfer_params", "ec_transfer_params", "output_mode", "choices",
    ]  # fmt: skip
    assert data["request_id"] == "generate-tokens-r1"
    assert data["model"] == "tiny"
    assert data["output_mode"] == "tokens"
    assert data["prompt_token_ids"] is None
    assert data["usage"] == {
        "prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4,
        "prompt_tokens_details": None, "completion_tokens_details": None,
    }  # fmt: skip
    (choice,) = data["choices"]
    assert list(choice) == CHOICE_KEYS
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["stop_reason"] is None and len(choice["token_ids"]) == 4
    assert all(choice[k] is None for k in CHOICE_KEYS[4:])


async def test_it_prefers_the_x_request_id_header(client: httpx.AsyncClient) -> None:
    data = await generate(client, gen_body([5]), headers={"X-Request-Id": "hdr"})
    assert data["request_id"] == "generate-tokens-hdr"


async def test_it_returns_prompt_ids_when_asked(client: httpx.AsyncClient) -> None:
    data = await generate(client, gen_body([5, 6], {"max_tokens": 1}, return_token_ids=True))
    assert data["prompt_token_ids"] == [5, 6]


async def test_it_is_deterministic_across_requests(client: httpx.AsyncClient) -> None:
    first = await outputs(client, [9, 8, 7], max_tokens=20, ignore_eos=True)
    assert first == await outputs(client, [9, 8, 7], max_tokens=20, ignore_eos=True)
    assert first != await outputs(client, [9, 8, 6], max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("prompt", [[11], [12, 13, 14], list(range(100, 130))])
async def test_it_continues_a_replay_of_prompt_plus_outputs_identically(
    client: httpx.AsyncClient, prompt: list[int]
) -> None:
    full = await generate(client, gen_body(prompt, {"max_tokens": 20, "min_tokens": 3}))
    original = full["choices"][0]
    tokens = original["token_ids"]
    for k in range(1, len(tokens)):
        # The relay contract: prompt + committed ids, budgets reduced by what was committed.
        sampling = {"max_tokens": 20 - k, "min_tokens": max(0, 3 - k)}
        replay = (await generate(client, gen_body(prompt + tokens[:k], sampling)))["choices"][0]
        assert replay["token_ids"] == tokens[k:]
        assert (replay["finish_reason"], replay["stop_reason"]) == (
            original["finish_reason"],
            original["stop_reason"],
        )


async def test_it_stops_on_eos_with_the_eos_id_as_stop_reason(client: httpx.AsyncClient) -> None:
    for p in range(200):
        choice = (await generate(client, gen_body([p + 10], {"max_tokens": 60})))["choices"][0]
        if choice["finish_reason"] == "stop":
            break
    else:
        pytest.fail("no prompt stopped on eos")
    assert choice["stop_reason"] == EOS
    assert choice["token_ids"][-1] == EOS and EOS not in choice["token_ids"][:-1]


async def test_it_ignores_eos_when_asked(client: httpx.AsyncClient) -> None:
    # Find a prompt whose free run emits eos, then ask again with ignore_eos.
    for p in range(200):
        tokens = await outputs(client, [p + 10], max_tokens=30)
        # Eos before the 30th token: otherwise "went on past eos" below would prove nothing.
        if tokens[-1] == EOS and len(tokens) < 30:
            break
    else:
        pytest.fail("no prompt stopped on eos")
    ignored = (await generate(client, gen_body([p + 10], {"max_tokens": 30, "ignore_eos": True})))
    choice = ignored["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 30
    assert choice["token_ids"][: len(tokens)] == tokens  # eos kept, generation went on


async def test_it_enforces_min_tokens_by_banning_stop_ids(client: httpx.AsyncClient) -> None:
    for p in range(300):
        tokens = await outputs(client, [p + 10], max_tokens=30)
        if tokens[-1] == EOS and len(tokens) < 5:
            break
    else:
        pytest.fail("no prompt stopped early")
    longer = await outputs(client, [p + 10], max_tokens=30, min_tokens=8)
    assert len(longer) >= 8 and EOS not in longer[:7]


async def test_it_defaults_a_missing_max_tokens_to_the_remaining_context(
    client: httpx.AsyncClient,
) -> None:
    data = await generate(client, gen_body(list(range(10, 20)), {"ignore_eos": True}))
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 64 - 10


async def test_it_stops_at_the_context_end_despite_a_larger_max_tokens(
    client: httpx.AsyncClient,
) -> None:
    data = await generate(
        client, gen_body(list(range(10, 60)), {"max_tokens": 1000, "ignore_eos": True})
    )
    assert data["choices"][0]["finish_reason"] == "length"
    assert len(data["choices"][0]["token_ids"]) == 14


async def test_it_stops_on_stop_token_ids(client: httpx.AsyncClient) -> None:
    tokens = await outputs(client, [42, 43], max_tokens=12, ignore_eos=True)
    target = next(t for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])
    cut = tokens.index(target)
    data = await generate(
        client, gen_body([42, 43], {"max_tokens": 12, "ignore_eos": True, "stop_token_ids": [target]})
    )
    choice = data["choices"][0]
    assert choice["token_ids"] == tokens[: cut + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", target)


async def test_it_gives_n_distinct_choices_with_index_0_equal_to_n_1(
    client: httpx.AsyncClient,
) -> None:
    sampling = {"max_tokens": 10, "ignore_eos": True}
    data = await generate(client, gen_body([7, 7], {**sampling, "n": 3}))
    choices = data["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({tuple(c["token_ids"]) for c in choices}) == 3
    assert choices[0]["token_ids"] == await outputs(client, [7, 7], **sampling)
    assert data["usage"]["completion_tokens"] == 30
    # Choice 1 replays from its first committed token on.
    tail = choices[1]["token_ids"]
    assert await outputs(client, [7, 7, tail[0]], max_tokens=9, ignore_eos=True) == tail[1:]


async def test_it_returns_tokens_mode_logprobs(client: httpx.AsyncClient) -> None:
    body = gen_body([3, 4, 5], {"max_tokens": 12, "ignore_eos": True, "logprobs": 2})
    data = await generate(client, body)
    choice = data["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == choice["token_ids"]
    shapes = set()
    for entry in content:
        assert list(entry) == ["token_id", "logprob", "rank", "top_logprobs"]
        top = entry["top_logprobs"]
        # The sampled token first, then the top-k without repeating it.
        assert top[0] == {k: entry[k] for k in ("token_id", "logprob", "rank")}
        ranked = [e["rank"] for e in top[1:]]
        assert ranked == sorted(ranked) and entry["rank"] >= 1
        assert len(top) == (2 if entry["rank"] <= 2 else 3)
        shapes.add(len(top))
    assert shapes == {2, 3}  # both "sampled in top-k" and "not in top-k" occur
    assert data == {**(await generate(client, body)), "created": data["created"]}


async def test_it_omits_logprobs_unless_asked(client: httpx.AsyncClient) -> None:
    data = await generate(client, gen_body([3], {"max_tokens": 2}))
    assert data["choices"][0]["logprobs"] is None


async def test_it_accepts_a_null_model_and_any_served_name(client: httpx.AsyncClient) -> None:
    for model in (None, "tiny", "tiny-alias"):
        data = await generate(client, gen_body([3], {"max_tokens": 1}, model=model))
        assert data["model"] == "tiny"


def _error(response: httpx.Response, status: int, type_: str, param: str | None) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and list(body["error"]) == ["message", "type", "param", "code"]
    assert body["error"]["type"] == type_
    assert body["error"]["param"] == param
    assert body["error"]["code"] == status
    return str(body["error"]["message"])


@pytest.mark.parametrize(
    ("body", "status", "type_", "param"),
    [
        (gen_body([1], model="other"), 404, "NotFoundError", "model"),
        (gen_body([1], {"stop": ["\n"]}), 400, "BadRequestError", None),
        (gen_body([1], {"stop": "x"}, stream=True), 400, "BadRequestError", None),
        (gen_body(list(range(64))), 400, "BadRequestError", "input_tokens"),
        (gen_body(list(range(65))), 400, "BadRequestError", "input_tokens"),
        (gen_body([1, 512]), 400, "BadRequestError", "token_ids"),
        (gen_body([1], {"logprobs": 21}), 400, "BadRequestError", "logprobs"),
        (gen_body([1], {"logprobs": -1}), 400, "BadRequestError", "logprobs"),
        (gen_body([1], {"n": 300}), 400, "BadRequestError", None),
        (gen_body([1], output_mode="text"), 400, "BadRequestError", None),
        (gen_body([1], {"structured_outputs": {"json": {}}}), 400, "BadRequestError", None),
        ({"token_ids": [1]}, 400, "Bad Request", "body.sampling_params"),
        ({"sampling_params": {}}, 400, "Bad Request", "body.token_ids"),
        (gen_body([]), 400, "Bad Request", "body.token_ids"),
        (gen_body([1, -1]), 400, "Bad Request", "body.token_ids"),
        (gen_body(["x"]), 400, "Bad Request", "body.token_ids.0"),
        (gen_body([1], {"max_tokens": 0}), 400, "Bad Request", "max_tokens"),
        (gen_body([1], {"max_tokens": 2, "min_tokens": 3}), 400, "Bad Request", "min_tokens"),
        (gen_body([1], {"temperature": 0, "n": 2}), 400, "Bad Request", "n"),
    ],
)
async def test_it_rejects_bad_requests_like_vllm(
    client: httpx.AsyncClient, body: dict[str, Any], status: int, type_: str, param: str | None
) -> None:
    _error(await client.post(GENERATE, json=body), status, type_, param)


async def test_it_rejects_non_json_bodies(client: httpx.AsyncClient) -> None:
    wrong_type = await client.post(GENERATE, content=b"{}", headers={"content-type": "text/plain"})
    assert "Unsupported Media Type" in _error(wrong_type, 400, "Bad Request", None)
    broken = await client.post(
        GENERATE, content=b"{nope", headers={"content-type": "application/json"}
    )
    _error(broken, 400, "Bad Request", "body")


async def test_it_answers_unknown_paths_like_fastapi(client: httpx.AsyncClient) -> None:
    missing = await client.get("/v1/nothing")
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    wrong = await client.get(GENERATE)
    assert (wrong.status_code, wrong.json()) == (405, {"detail": "Method Not Allowed"})


async def test_it_requires_request_ids_to_abort(client: httpx.AsyncClient) -> None:
    _error(await client.post("/inference/v1/abort_requests", json={}), 400, "Bad Request", None)
    ok = await client.post("/inference/v1/abort_requests", json={"request_ids": ["r1"]})
    assert (ok.status_code, ok.content) == (200, b"")


async def test_it_serves_the_probes(client: httpx.AsyncClient) -> None:
    health = await client.get("/health")
    assert (health.status_code, health.content) == (200, b"")
    assert (await client.get("/version")).json() == {"version": "0.32.0"}
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert list(card) == [
        "id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission",
    ]  # fmt: skip
    assert card["id"] == "tiny" and card["owned_by"] == "vllm" and card["parent"] is None
    assert card["max_model_len"] == 64 and card["permission"] == []
    await generate(client, gen_body([3], {"max_tokens": 2, "ignore_eos": True}))
    metrics = (await client.get("/metrics")).text
    assert 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 2.0' in metrics


async def test_it_plays_scripts_including_multi_byte_and_special_ids(
    client: httpx.AsyncClient,
) -> None:
    # Ids 0-3 are "special": the sampler never picks them, a script may.
    script = {"prompt_token_ids": [20, 21], "output_token_ids": [3, 300, 301, 1, EOS]}
    assert (await client.post("/sim/script", json=script)).status_code == 200
    data = await generate(client, gen_body([20, 21], {"max_tokens": 50}))
    choice = data["choices"][0]
    assert choice["token_ids"] == [3, 300, 301, 1, EOS]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", EOS)
    # Replay in the middle of a script continues the script.
    assert await outputs(client, [20, 21, 3, 300], max_tokens=50) == [301, 1, EOS]
    # Exact scripts do not match a longer prompt.
    assert await outputs(client, [19, 20, 21], max_tokens=5) != [3, 300, 301, 1, EOS]


async def test_it_plays_suffix_scripts_after_any_prefix(client: httpx.AsyncClient) -> None:
    script = {"prompt_token_ids": [21], "output_token_ids": [400, 401], "match": "suffix"}
    await client.post("/sim/script", json=script)
    tokens = await outputs(client, [5, 6, 21], max_tokens=5, ignore_eos=True)
    assert tokens[:2] == [400, 401] and len(tokens) == 5  # then the hash model again
    await client.delete("/sim/script")
    assert (await outputs(client, [5, 6, 21], max_tokens=2))[:2] != [400, 401]


async def test_it_fails_the_next_n_requests_with_an_http_status(client: httpx.AsyncClient) -> None:
    armed = await client.post("/sim/faults", json={"mode": "http_status", "status": 503, "count": 2})
    assert armed.json() == {"remaining": 2}
    for _ in range(2):
        _error(await client.post(GENERATE, json=gen_body([3])), 503, "ServiceUnavailableError", None)
    assert (await client.post(GENERATE, json=gen_body([3]))).status_code == 200
    await client.post("/sim/faults", json={"mode": "http_status", "status": 500, "count": 5})
    await client.delete("/sim/faults")
    assert (await client.post(GENERATE, json=gen_body([3]))).status_code == 200


async def test_it_fails_non_streaming_requests_with_an_error_after_tokens(
    client: httpx.AsyncClient,
) -> None:
    await client.post("/sim/faults", json={"mode": "error_event_after_tokens", "tokens": 2})
    response = await client.post(GENERATE, json=gen_body([3], {"max_tokens": 5}))
    _error(response, 500, "InternalServerError", None)


async def test_it_validates_control_bodies(client: httpx.AsyncClient) -> None:
    bad_mode = await client.post("/sim/faults", json={"mode": "explode"})
    _error(bad_mode, 400, "Bad Request", "body.mode")
    bad_script = await client.post("/sim/script", json={"prompt_token_ids": [], "output_token_ids": [1]})
    _error(bad_script, 400, "Bad Request", "body.prompt_token_ids")


async def test_it_counts_requests_and_resets(client: httpx.AsyncClient) -> None:
    await client.post(GENERATE, json=gen_body([4, 5, 6], {"max_tokens": 1}))
    await client.post(GENERATE, json={"bad": True})
    stats = (await client.get("/sim/stats")).json()
    assert stats["requests_received"] == 2
    assert stats["last_token_ids"] == [4, 5, 6]
    assert (stats["active_streams"], stats["aborted"]) == (0, 0)
    reset = (await client.post("/sim/reset")).json()
    assert (reset["requests_received"], reset["last_token_ids"]) == (0, None)
