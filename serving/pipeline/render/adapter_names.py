"""A LoRA adapter's render pool: its base model's sidecars, called under the base's name.

A render sidecar loads no adapter (it has no weights), so it knows only the base model's name
and answers vLLM's 404 for the adapter's, on render and derender alike. The adapter shares the
base's tokenizer and chat template, so its request is rendered and derendered exactly as the
base's would be; only the name differs. ``AdapterRenderPool`` is the base's pool with that one
translation at the boundary: every call leaves with the base's name in ``model`` (the body, and
the request a derender reads), and every answer comes back with the adapter's: render's generate
requests then name the adapter (the engine runs it with the adapter's weights) and derender's
responses and chunks say ``model: <adapter>``, as the engine's own API does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

from serving.pipeline.derender.payload import StreamState
from serving.pipeline.http11 import Http11Client
from serving.pipeline.protocol import ApiKind, TokenKind
from serving.pipeline.render.pool import PoolState, RenderPool
from serving.pipeline.snapshot import RenderView
from serving.pipeline.tracing import NO_TRACE


class AdapterRenderPool(RenderPool):
    """``RenderPool`` over the base's view, sending ``base`` for ``adapter`` (see the module doc)."""

    def __init__(
        self, client: Http11Client, view: RenderView, state: PoolState | None = None, *, adapter: str, base: str
    ) -> None:
        super().__init__(client, view, state)
        self.adapter, self.base = adapter, base

    def _out(self, body: dict[str, Any] | None) -> dict[str, Any] | None:
        return {**body, "model": self.base} if body is not None and body.get("model") == self.adapter else body

    def _back(self, answer: dict[str, Any]) -> dict[str, Any]:
        if answer.get("model") == self.base:
            answer["model"] = self.adapter
        return answer

    def _model(self, model: str | None) -> str | None:
        return self.base if model == self.adapter else model

    async def render_chat(
        self, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> dict[str, Any]:
        return self._back(await super().render_chat(self._out(body) or body, request_id, trace))

    async def render_messages(
        self, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> dict[str, Any]:
        return self._back(await super().render_messages(self._out(body) or body, request_id, trace))

    async def render_responses(
        self, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> dict[str, Any]:
        return self._back(await super().render_responses(self._out(body) or body, request_id, trace))

    async def render_completions(
        self, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> list[dict[str, Any]]:
        return [self._back(r) for r in await super().render_completions(self._out(body) or body, request_id)]

    async def prompt_lengths(
        self, kind: ApiKind, body: dict[str, Any], request_id: str, trace: Mapping[str, str] = NO_TRACE
    ) -> list[int]:
        return await super().prompt_lengths(kind, self._out(body) or body, request_id, trace)

    async def derender_chat(
        self, generate_response: dict[str, Any], *, prompt_token_ids: Sequence[int], chat_request: dict[str, Any],
        model: str | None,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> dict[str, Any]:
        return self._back(await super().derender_chat(
            generate_response, prompt_token_ids=prompt_token_ids, chat_request=self._out(chat_request) or chat_request,
            model=self._model(model), trace=trace))

    async def derender_completions(
        self, generate_responses: list[dict[str, Any]], *, prompt_token_ids: Sequence[Sequence[int]],
        completion_request: dict[str, Any], model: str | None,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> dict[str, Any]:
        return self._back(await super().derender_completions(
            generate_responses, prompt_token_ids=prompt_token_ids,
            completion_request=self._out(completion_request) or completion_request, model=self._model(model),
            trace=trace))

    async def derender_chunk(
        self, kind: TokenKind, generate_chunk: dict[str, Any], *, stream_state: StreamState,
        prompt_tokens: int, prompt_token_ids: Sequence[int] | None, request: dict[str, Any] | None, model: str | None,
        trace: Mapping[str, str] = NO_TRACE,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        chunk, state = await super().derender_chunk(
            kind, generate_chunk, stream_state=stream_state, prompt_tokens=prompt_tokens,
            prompt_token_ids=prompt_token_ids, request=self._out(request), model=self._model(model), trace=trace)
        return self._back(chunk), state
