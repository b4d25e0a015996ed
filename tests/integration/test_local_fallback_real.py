"""The local tokenizer fallback gives the real render sidecar's ids, not just its own template's.

The fallback serves while the sidecar is down (a crash, a restart), and its requests must go
on exactly as render would have started them: same prompt ids, same sampling parameters that
matter, same decoded text. Compared here with the real vLLM 0.33 sidecar on the same model
files, on chats and completions with digits (transformers' Qwen2 tokenizer splits them one by
one where ``tokenizer.json`` alone would not), several turns, a system prompt and non-ASCII text;
and the fallback's derender against the sidecar's on outputs a one-shot decode gets wrong.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from motorsite import stack
from serving.pipeline.derender.local import LocalDerenderer
from serving.pipeline.render import local_tokenizer as lt
from serving.pipeline.render.tokenization import local_render, local_unsupported
from serving.pipeline.snapshot import ModelView

pytestmark = pytest.mark.integration

CHATS = [
    [{"role": "user", "content": "restart case 1 chat"}],
    [{"role": "user", "content": "What is 12345 + 67890? Answer in 3 words."}],
    [
        {"role": "system", "content": "You are terse. Reply in 2 lines."},
        {"role": "user", "content": "List 3 primes below 20"},
        {"role": "assistant", "content": "2, 3, 5"},
        {"role": "user", "content": "Now 4 more, año 2026 — naïve café ✓"},
    ],
]
PROMPTS: list[Any] = [
    "restart case 1 completions",
    "The year 1999 had 365 days and 12 months",
    ["first 1", "second 22", "third 333 ümlaut"],
]


@pytest.fixture(scope="module")
def render(tiers: stack.StackConfig) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{tiers.render_port}", timeout=30)


def model(tiers: stack.StackConfig) -> ModelView:
    return ModelView(tiers.served_model_name, tiers.model_dir, tiers.max_model_len)


@pytest.mark.parametrize("messages", CHATS, ids=["digits", "arithmetic", "multi-turn"])
def test_it_renders_chats_as_the_sidecar_does(render: httpx.Client, tiers: stack.StackConfig, messages: list[dict[str, Any]]) -> None:
    body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0.0}
    assert local_unsupported("chat", body) is None  # a request the fallback takes
    theirs = render.post("/v1/chat/completions/render", json=body).json()
    (ours,) = local_render(lt.local_tokenizer(tiers.model_dir), "chat", body, "x", model(tiers))
    assert ours["token_ids"] == theirs["token_ids"]
    assert ours["sampling_params"]["max_tokens"] == theirs["sampling_params"]["max_tokens"] == 12


@pytest.mark.parametrize("prompt", PROMPTS, ids=["digits", "year", "batch"])
def test_it_renders_completions_as_the_sidecar_does(render: httpx.Client, tiers: stack.StackConfig, prompt: Any) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.0}
    assert local_unsupported("completions", body) is None
    theirs = render.post("/v1/completions/render", json=body).json()
    ours = local_render(lt.local_tokenizer(tiers.model_dir), "completions", body, "x", model(tiers))
    assert [r["token_ids"] for r in ours] == [r["token_ids"] for r in theirs]


def test_it_decodes_as_the_sidecar_does(render: httpx.Client, tiers: stack.StackConfig) -> None:
    tok = lt.local_tokenizer(tiers.model_dir)
    text = "Count 1 2 3, año 2026 ✓"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    theirs = render.post("/v1/completions/render", json={"model": "tiny", "prompt": text, "max_tokens": 1}).json()
    assert theirs[0]["token_ids"] == ids


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _tool_turns(arguments: Any) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris? 12 words, año 2026"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "assistant", "content": "It is 18C."},
        {"role": "user", "content": "And tomorrow?"},
    ]


def test_it_renders_tools_and_tool_turns_as_the_sidecar_does(render: httpx.Client, tiers: stack.StackConfig) -> None:
    # On the wire a tool call's arguments are a JSON string; vLLM parses them into the dict the
    # template formats, which is what the local template is given here. tool_choice "none": the
    # sidecar runs without a tool-call parser ("auto" is refused), and still renders the tools.
    body = {"model": "tiny", "messages": _tool_turns('{"city": "Paris"}'), "tools": TOOLS, "tool_choice": "none",
            "max_tokens": 12}
    response = render.post("/v1/chat/completions/render", json=body)
    assert response.status_code == 200, response.text
    tok = lt.local_tokenizer(tiers.model_dir)
    turns = _tool_turns({"city": "Paris"})
    ours = tok.encode(tok.apply_chat_template(turns, add_generation_prompt=True, tools=TOOLS), add_special_tokens=False)
    assert ours == response.json()["token_ids"]
    # The tools are in that prompt: without them the template gives fewer ids.
    assert len(tok.encode(tok.apply_chat_template(turns, add_generation_prompt=True), add_special_tokens=False)) < len(ours)
    # The fallback still refuses such requests (they go native while render is down): only the
    # plain chats above are served from these ids.
    assert local_unsupported("chat", body) == "param:tools"


def _unfinished(tok: lt.LocalTokenizer, text: str) -> list[int]:
    """The ids of ``text`` cut inside its last multi-byte character: a one-shot decode ends in U+FFFD."""
    ids = tok.encode(text, add_special_tokens=False)
    cut = next(n for n in range(len(ids) - 1, 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    return ids[:cut]


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_it_derenders_as_the_sidecar_does(render: httpx.Client, tiers: stack.StackConfig, kind: str) -> None:
    """The fallback's text is derender's, also where a one-shot decode differs: an output cut inside
    a character (the sidecar drops the unfinished bytes), a stop token (left out) and a stop string
    (cut at)."""
    tok = lt.local_tokenizer(tiers.model_dir)
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "temperature": 0.0}
    body.update({"messages": CHATS[0]} if kind == "chat" else {"prompt": PROMPTS[0]})
    rendered = render.post(f"/v1/{'chat/' if kind == 'chat' else ''}completions/render", json=body).json()
    rendered = rendered if kind == "chat" else rendered[0]
    generated = httpx.post(f"{tiers.engine_urls[0]}/inference/v1/generate", json={**rendered, "stream": False},
                           timeout=60).json()
    assert tok.eos_token_id is not None
    unfinished = _unfinished(tok, " naïve café ✓")
    outputs = [
        ("length", generated["choices"][0]["token_ids"]),  # what the engine made of the prompt
        ("length", unfinished),
        ("length", generated["choices"][0]["token_ids"] + unfinished),
        ("stop", tok.encode(" done", add_special_tokens=False) + [tok.eos_token_id]),
        # A stop string the engine matched: the text is cut before it (after it with
        # include_stop_str_in_output, below).
        ("stop", tok.encode(" all done, more", add_special_tokens=False), " done,"),
    ]
    local = LocalDerenderer(tok)
    prompt = rendered["token_ids"]
    for finish, ids, *reason in outputs:
        response = {**generated, "choices": [{**generated["choices"][0], "token_ids": ids, "finish_reason": finish,
                                              "stop_reason": reason[0] if reason else None}]}
        for skip, include in ((True, False), (False, False), (True, True)):
            request = {**body, "skip_special_tokens": skip, "include_stop_str_in_output": include}
            if kind == "chat":
                theirs = render.post("/v1/chat/completions/derender", json={
                    "model": "tiny", "generate_response": response, "prompt_tokens": len(prompt),
                    "prompt_token_ids": prompt, "chat_request": request})
                assert theirs.status_code == 200, theirs.text
                text = theirs.json()["choices"][0]["message"]["content"]
                ours = local.chat(response, prompt_ids=prompt, body=request)["choices"][0]["message"]["content"]
            else:
                theirs = render.post("/v1/completions/derender", json={
                    "model": "tiny", "generate_responses": [response], "prompt_tokens": [len(prompt)],
                    "prompt_token_ids": [prompt], "completion_request": request})
                assert theirs.status_code == 200, theirs.text
                text = theirs.json()["choices"][0]["text"]
                ours = local.completions([response], prompt_ids=[prompt], body=request)["choices"][0]["text"]
            assert ours == text, (finish, ids, reason, skip, include)
    # The cases differ from a one-shot decode, so the comparison above could fail.
    assert tok.decode(unfinished).endswith("\ufffd") and not local.completions(
        [{"choices": [{"index": 0, "token_ids": unfinished, "finish_reason": "length"}]}], prompt_ids=[prompt], body=body,
    )["choices"][0]["text"].endswith("\ufffd")
