"""Full (non-streaming) derender: the engines' GenerateResponses -> one OpenAI response.

Render's derender, or the local tokenizer's for a request render could not tokenize (its
derender would be unusable too). Called once, after inference; a failure never re-runs it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from serving.pipeline import metric_names
from serving.pipeline.derender.local import LocalDerenderer
from serving.pipeline.engine.requests import sorted_choices
from serving.pipeline.phases import NO_PHASES, Phases
from serving.pipeline.protocol import TokenKind
from serving.pipeline.render.client import RenderClient
from serving.pipeline.render.tokenization import TokenizationService, TokenizedRequest
from serving.pipeline.snapshot import ModelView
from serving.pipeline.tracing import NO_TRACE

logger = logging.getLogger(__name__)


async def derender_full(
    render: RenderClient, model: ModelView, kind: TokenKind, body: dict[str, Any],
    request_id: str, tokenized: TokenizedRequest, responses: list[dict[str, Any]], *, phases: Phases = NO_PHASES,
    trace: Mapping[str, str] = NO_TRACE,
) -> dict[str, Any]:
    """The client's response for ``responses`` (one per prompt), with the public id set."""
    start = time.perf_counter()
    first = phases.now()
    prompt_ids = [p.token_ids for p in tokenized.prompts]
    result = "ok"
    try:
        if tokenized.tokenizer_source == "local":
            # Render was unusable for this request; its derender would be too.
            local = LocalDerenderer(await TokenizationService(render, model).local_tokenizer())
            # Off the event loop: vLLM's incremental detokenizer is a Python loop per token
            # (about 12 us each, 24 ms for 2,000 tokens), where the other streams would wait.
            if kind == "chat":
                out = await asyncio.to_thread(local.chat, responses[0], prompt_ids=prompt_ids[0], body=body)
            else:
                out = await asyncio.to_thread(local.completions, responses, prompt_ids=prompt_ids, body=body)
        elif kind == "chat":
            out = await render.derender_chat(
                responses[0], prompt_token_ids=prompt_ids[0], chat_request=body, model=body.get("model"), trace=trace
            )
        else:
            out = await render.derender_completions(
                [sorted_choices(r) for r in responses], prompt_token_ids=prompt_ids,
                completion_request=body, model=body.get("model"), trace=trace,
            )
    except BaseException as exc:
        result = type(exc).__name__
        raise
    finally:
        logger.info(
            "derender request_id=%s kind=%s source=%s result=%s latency_ms=%.1f",
            request_id, kind, tokenized.tokenizer_source, result, (time.perf_counter() - start) * 1000,
        )
    phases.observe(metric_names.PHASE_FIRST_DERENDER, first)  # the only derender call: the first
    out["id"] = f"chatcmpl-{request_id}" if kind == "chat" else f"cmpl-{request_id}"
    return out
