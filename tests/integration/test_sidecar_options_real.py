"""The render sidecar as make run starts it (``stack.render_spec``) runs with motorsite's options.

The session's real ``vllm launch render`` (``conftest.tiers``), called through the coordinator's
own client. Nothing else calls it while this test runs (the package's coordinators call a sidecar
only for a request, and every rig's readiness check calls its own), so its counters move by this
test's calls only; in a whole run it has derendered every earlier test's streams, uncounted too.
What is checked is what an operator sees: the sidecar's ``/metrics`` no longer counts streaming derender calls (``motorsite/render_site``: they skip
vLLM's per-request HTTP metrics, about a sixth of the sidecar's CPU per call in
``bench/sidecar_options.py``), while render calls and a derender call carrying a browser's
``Origin`` (which CORS must see) are still counted, and the derender answers are unchanged.
"""

from __future__ import annotations

import re
import uuid

import httpx
import pytest

from motorsite import stack
from serving.pipeline.http11 import Http11Client
from serving.pipeline.render.client import CHAT_DERENDER, RenderClient

pytestmark = pytest.mark.integration

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about cats."}], "max_tokens": 8,
        "stream": True, "temperature": 0}
EVENT = {
    "request_id": "generate-tokens-test", "usage": None, "output_mode": "tokens",
    "choices": [{"index": 0, "finish_reason": None, "stop_reason": None, "token_ids": [1000],
                 "routed_experts": None, "sampling_mask": None, "weight_versions": None, "logprobs": None}],
}


@pytest.fixture(scope="module")
def sidecar(tiers: stack.StackConfig) -> str:
    return stack.render_base_url(tiers, tiers.render_port)


def requests_counted(base_url: str) -> dict[str, float]:
    """``http_requests_total`` of the sidecar's ``/metrics`` by handler (all methods and statuses)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for handler, value in re.findall(r'^http_requests_total\{[^}]*handler="([^"]+)"[^}]*\} (\S+)$', text, re.M):
        out[handler] = out.get(handler, 0.0) + float(value)
    return out


async def test_streaming_derender_calls_are_left_out_of_the_sidecars_http_metrics(
    sidecar: str, upstream: Http11Client,
) -> None:
    render = RenderClient(upstream, sidecar, 60.0)
    before = requests_counted(sidecar)
    ids = (await render.render_chat(CHAT, uuid.uuid4().hex))["token_ids"]
    chunk, state = await render.derender_chunk("chat", EVENT, stream_state=None, prompt_tokens=len(ids),
                                               prompt_token_ids=ids, request=CHAT, model="tiny")
    texts = [chunk["choices"][0]["delta"].get("content")]
    for _ in range(4):
        chunk, state = await render.derender_chunk("chat", EVENT, stream_state=state, prompt_tokens=len(ids),
                                                   prompt_token_ids=ids, request=CHAT, model="tiny")
        texts.append(chunk["choices"][0]["delta"].get("content"))
    assert all(texts) and len(set(texts)) == 1, texts  # the same token derendered the same way each time
    after = requests_counted(sidecar)
    assert after.get("/v1/chat/completions/render", 0) - before.get("/v1/chat/completions/render", 0) == 1
    assert after.get(CHAT_DERENDER, 0) == before.get(CHAT_DERENDER, 0) == 0, after

    # A call with an Origin header takes the whole chain, CORS and the metrics included.
    browser = await upstream.post(sidecar + CHAT_DERENDER, headers={"Origin": "http://example.test"}, json={
        "stream": True, "model": "tiny", "generate_chunk": EVENT, "prompt_tokens": len(ids), "stream_state": state,
    })
    assert browser.status_code == 200
    assert browser.json()["chunk"]["choices"][0]["delta"]["content"] == texts[0]
    assert requests_counted(sidecar).get(CHAT_DERENDER, 0) == 1
