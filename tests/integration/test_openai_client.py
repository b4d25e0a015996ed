"""The whole path on real parts, called with the official openai client.

OpenAI request -> coordinator -> real render sidecar -> real vLLM engine -> derender -> client.
"""

from __future__ import annotations

import hashlib
import secrets
import subprocess
import time
from dataclasses import replace
from urllib.parse import urlsplit

import openai
import pytest
from redis import Redis

from motorsite import stack
from motorsite.supervisor import Supervisor, free_port

from .conftest import API_KEY

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(coordinator: stack.StackConfig) -> openai.OpenAI:
    return openai.OpenAI(base_url=coordinator.coordinator_url + "/v1", api_key=API_KEY, max_retries=0)


def test_it_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_it_answers_a_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say something"}], max_tokens=12, temperature=0
    )
    assert out.id.startswith("chatcmpl-")
    assert out.object == "chat.completion"
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 5  # the chat template adds role markers around the message
    assert 1 <= out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_it_streams_a_chat_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Stream please"}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in content_chunks if c.choices[0].delta.role) == 1
    assert content_chunks[-1].choices[0].finish_reason in ("stop", "length")
    usage_chunks = [c for c in chunks if c.usage is not None and not c.choices]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert 1 <= usage_chunks[0].usage.completion_tokens <= 10
    assert {c.id for c in chunks} == {chunks[0].id}


def test_streaming_and_non_streaming_agree(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "agree"}], max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs) if c.choices  # type: ignore[call-overload]
    )
    assert streamed == whole.choices[0].message.content


def test_it_answers_a_completion(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="def main():", max_tokens=16, temperature=0)
    assert out.id.startswith("cmpl-")
    assert out.choices[0].index == 0
    # 16 is the value render leaves off the wire; the coordinator must put it back.
    assert out.usage.completion_tokens <= 16
    assert out.choices[0].finish_reason in ("stop", "length")


def test_it_keeps_prompt_order_for_a_list_of_prompts(client: openai.OpenAI) -> None:
    prompts = ["import os", "class Foo:", "for i in range(3):"]
    batch = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0)
    singles = [client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_it_streams_a_completion(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny", prompt="while True:", max_tokens=12, temperature=0)
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt="while True:", max_tokens=12, temperature=0, stream=True)
        if c.choices
    )
    assert text == whole.choices[0].text


def test_it_refuses_an_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 404
    assert err.value.body["param"] == "model"  # type: ignore[index]


def test_it_refuses_a_missing_key(coordinator: stack.StackConfig) -> None:
    bad = openai.OpenAI(base_url=coordinator.coordinator_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_it_serves_through_simulated_engines(sim_stack: stack.StackConfig) -> None:
    client = openai.OpenAI(base_url=sim_stack.coordinator_url + "/v1", api_key=API_KEY, max_retries=0)
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "sim"}], max_tokens=8)
    assert out.usage.completion_tokens >= 1
    again = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "sim"}], max_tokens=8)
    # The simulator is deterministic in the prompt, whichever of its instances answers.
    assert again.choices[0].message.content == out.choices[0].message.content


def psql(database: str, sql: str) -> list[str]:
    """The rows ``sql`` returns from PostgreSQL's ``database`` on 127.0.0.1, one line each."""
    argv = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", database, "-v", "ON_ERROR_STOP=1", "-qAtc", sql]
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.splitlines()


def test_it_serves_on_postgresql_and_redis(pg_redis_coordinator: stack.StackConfig) -> None:
    cfg = pg_redis_coordinator
    database = urlsplit(cfg.database_url).path.lstrip("/")
    # The fleet the run wrote is in the PostgreSQL database it was given.
    assert psql(database, "SELECT url FROM fleet_engineinstance ORDER BY url") == sorted(cfg.engine_urls)
    # A client key written into that database alone, behind the coordinator's back (the snapshot
    # poll sees the version bump): a coordinator on any other database answers it 401. Its
    # tokens-per-minute limit puts its window in Redis when the coordinator uses Redis.
    key = "sk-motor-" + secrets.token_urlsafe(24)
    key_hash = hashlib.sha256(key.encode()).hexdigest()
    psql(database, (
        "INSERT INTO fleet_apikey (name, prefix, key_hash, scope, tokens_per_minute, allow_priority, revoked, created) "
        f"VALUES ('pg-only', '{key[:8]}', '{key_hash}', 'client', 1000000, false, false, now()); "
        "UPDATE fleet_controlversion SET value = value + 1"
    ))
    redis = Redis.from_url(cfg.redis_url)
    seconds, micros = redis.time()
    started_ms = seconds * 1000 + micros // 1000
    client = openai.OpenAI(base_url=cfg.coordinator_url + "/v1", api_key=key, max_retries=0)

    deadline = time.monotonic() + 30  # a watchdog for the snapshot poll, not a timing assertion
    while True:
        try:
            out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "pg"}], max_tokens=4)
            break
        except openai.AuthenticationError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)

    assert out.usage.completion_tokens >= 1
    # Shared admission: its scripts ran for this request (their clock saw Redis's time after it
    # began); in-process admission writes nothing to Redis.
    wall = redis.hget("motor:admission:clock", "wall")
    assert wall is not None and int(wall) >= started_ms
    # The key's tokens-per-minute window is in Redis, charged the request's estimate (its
    # prompt plus max_tokens), not in the process; one window per key and served model.
    used = redis.get(f"motor:tpm:{key_hash}:tiny:used")
    assert used is not None and int(used) == out.usage.prompt_tokens + 4
    redis.close()


def test_it_is_a_plain_asgi_app_that_uvicorn_serves(sim_stack: stack.StackConfig) -> None:
    port = free_port()
    cfg = replace(sim_stack, server="uvicorn", coordinator_port=port)  # MOTOR_SERVER=uvicorn make run
    spec = replace(stack.coordinator_spec(cfg), name="coordinator-uvicorn", log_path=sim_stack.log_dir / "coordinator-uvicorn.log")
    with Supervisor([spec]):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
        chunks = list(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "uvicorn"}], max_tokens=6, stream=True
            )
        )
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
