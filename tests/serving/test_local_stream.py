"""Which streams ``RenderConfig.local_stream_detokenize`` derenders in the coordinator.

Whether the answers are the sidecar's is proven against the real sidecar
(tests/integration/test_local_stream_diff_real.py); here, only the choice: everything that needs
more than the plain path keeps the sidecar, and so does a model without usable tokenizer files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from serving.pipeline.derender import local_stream
from serving.pipeline.derender.local_stream import LocalStreamDerenderer, stream_derenderer
from serving.pipeline.snapshot import ModelView, RenderView
from tests.serving.router_fakes import model_dir

ON = RenderView(enable=True, base_url="http://127.0.0.1:1", timeout_s=5.0, local_stream_detokenize=True)
CHAT: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def model(**kw: Any) -> ModelView:
    return ModelView("tiny", kw.pop("path", model_dir()), 64, **kw)


async def test_a_plain_stream_is_derendered_here() -> None:
    assert isinstance(await stream_derenderer(ON, model(), "chat", CHAT), LocalStreamDerenderer)
    assert isinstance(await stream_derenderer(ON, model(), "completions", {"prompt": "x", "n": 2}), LocalStreamDerenderer)


@pytest.mark.parametrize(("render", "view", "kind", "body"), [
    (RenderView(enable=True, base_url="", timeout_s=5.0), model(), "chat", CHAT),  # the option is off by default
    (ON, model(tool_parser="hermes"), "chat", CHAT),
    (ON, model(reasoning_parser="qwen3"), "completions", {"prompt": "x"}),
    (ON, model(), "chat", {**CHAT, "logprobs": True}),
    (ON, model(), "chat", {**CHAT, "top_logprobs": 0}),
    (ON, model(), "completions", {"prompt": "x", "logprobs": 0}),
    (ON, model(), "completions", {"prompt": "x", "echo": True}),
    (ON, model(), "responses", {"input": "x"}),
    (RenderView(enable=True, base_url="", timeout_s=5.0, local_stream_detokenize=True, obfuscation=True),
     model(), "chat", CHAT),
    (ON, None, "chat", CHAT),
], ids=["off", "tool-parser", "reasoning-parser", "logprobs", "top-logprobs", "logprobs-0", "echo", "responses",
        "obfuscation", "unknown-model"])
async def test_what_needs_more_keeps_the_sidecar(render: RenderView, view: ModelView | None, kind: Any,
                                                 body: dict[str, Any]) -> None:
    assert await stream_derenderer(render, view, kind, body) is None


async def test_a_model_without_tokenizer_files_keeps_the_sidecar(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    empty = str(tmp_path / "no-files")
    assert await stream_derenderer(ON, model(path=empty), "chat", CHAT) is None
    assert "local_stream_detokenize" in caplog.text
    assert local_stream._built[empty] is None  # remembered: not tried again per request


async def test_a_relayed_attempt_continues_from_the_committed_window() -> None:
    """The session's committed-state rules hold with the coordinator's derender: an attempt that
    ends after two handed-on chunks and a relayed one that derenders the rest give the client the
    text one attempt gives (the window state is the session's to carry, as with the sidecar)."""
    from serving.pipeline.derender.local_stream import local_stream_derenderer
    from serving.pipeline.derender.session import StreamingRenderSession

    derender = local_stream_derenderer(model_dir(), 5.0)
    hf = derender._hf
    ids = hf.encode(" héllo, 中文 wörld😀!", add_special_tokens=False)
    events = [{"request_id": "g", "choices": [{"index": 0, "token_ids": [i], "finish_reason": None}]} for i in ids]
    events[-1]["choices"][0]["finish_reason"] = "length"
    prompt = hf.encode("Say:", add_special_tokens=False)

    async def texts(session: StreamingRenderSession, part: list[dict[str, Any]]) -> str:
        async def batches() -> Any:
            for e in part:
                yield [{**e, "choices": [dict(c) for c in e["choices"]]}]
        return "".join([c["choices"][0]["delta"]["content"] or "" async for c in session.chunks(batches())])

    whole = await texts(StreamingRenderSession(derender, "chat", dict(CHAT), prompt, request_id="r", public_id="p"),
                        events)
    relayed = StreamingRenderSession(derender, "chat", dict(CHAT), prompt, request_id="r", public_id="p")
    relayed.begin_attempt(1, "e1")
    first = await texts(relayed, events[:5])
    relayed.begin_attempt(2, "e2")
    assert first + await texts(relayed, events[5:]) == whole == " héllo, 中文 wörld😀!"
    assert relayed.committed_ids == ids
