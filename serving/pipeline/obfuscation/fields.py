"""Token obfuscation at the wire: which GenerateRequest and response fields cross the boundary, and how.

The keyed mapping itself is ``mapping.py``; this module walks vLLM's request and response
bodies with it.

What an obfuscated engine receives: nothing it could read as text. Each GenerateRequest field
(vllm-protocol.md 3.1), by what vLLM 0.33.0's generate (``token_in_token_out/serving.py``) does
with it in ``output_mode="tokens"``, the only mode allowed here:

=========================  ==========================================  =============================
field                      generate uses it for                        crosses the boundary as
=========================  ==========================================  =============================
token_ids                  the prompt                                  mapped to physical ids
sampling_params            sampling; id lists, logit_bias keys         ids mapped; ``stop``,
                                                                       ``bad_words``,
                                                                       ``structured_outputs``,
                                                                       ``extra_args``: refused (400)
parse_context              derender mode only (tool schemas,           left out
                           tool_choice, chat_template_kwargs)
token_offsets              nothing (characters per token)              left out
reasoning_parser_kwargs    structured outputs only (holds the          left out
                           chat_template_kwargs)
reasoning_ended            structured outputs only                     left out
features                   multimodal: pixels/audio tensors and        refused (400) when set: no
                           content hashes, needed in plain form        media obfuscation here
content_parts              media URLs the engine fetches               refused (400) when set
output_mode                response level                              "tokens" only, else 400
cache_salt                 salts the prefix-cache hashes               keyed digest (``salt``): same
                                                                       partition, unreadable
request_id, model,         ids, names, flags, numbers, connector       unchanged
return_token_ids, stream,  state (no text, no token ids)
stream_options, priority,
kv/ec_transfer_params
anything else              (a field added upstream)                    refused (400)
=========================  ==========================================  =============================

The coordinator keeps what it leaves out: derender gets the client's own request, never the
engine's copy. ``refuse_unsendable`` runs right after render, so a refused request gets its 400
before admission; ``obfuscate_request`` runs again before every engine request (retries,
relays, P/D legs). An id outside the vocabulary is refused too. A deployment with obfuscation
on but no usable key refuses all traffic (``ObfuscationKeyError``); an instance whose declared
key id differs from the render config's is not eligible for it (``keyring.eligible``). Without
obfuscation nothing here runs.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from serving.pipeline.obfuscation.mapping import ObfuscatedOutputInvalid, ObfuscationRefused, TokenMapping

# --- the request boundary ----------------------------------------------------------------------

# GenerateRequest fields (vllm-protocol.md 3.1; the per-field rule is the module docstring's
# table, from what vLLM 0.33.0's generate does with each). Anything not listed is refused: a
# field added upstream could carry text or plain ids, and guessing is not closed.
_REQUEST_PASSTHROUGH = frozenset({
    "request_id", "model", "return_token_ids", "stream", "stream_options", "priority",
    "kv_transfer_params", "ec_transfer_params",  # connector state: block ids and addresses
    "output_mode",  # checked: only "tokens"
})
# Render fills these with what the engine never reads on this path; they are left out, not sent.
_REQUEST_DROPPED = frozenset({
    "parse_context",  # tool schemas, tool_choice, chat_template_kwargs: read only in "derender" mode
    "token_offsets",  # characters per token: generate ignores them, an engine could use them to
                      # guess which physical id is which
    "reasoning_parser_kwargs",  # chat_template_kwargs again: read only with structured outputs
    "reasoning_ended",  # likewise only with structured outputs, which are refused below
})
# Content the engine would have to read in plain form (media to fetch, pixels, content hashes):
# no mapping exists for it here, so a request that carries any is refused.
_REQUEST_REFUSED = ("content_parts", "features")
_REQUEST_KNOWN = _REQUEST_PASSTHROUGH | _REQUEST_DROPPED | {"token_ids", "sampling_params", "cache_salt",
                                                            *_REQUEST_REFUSED}

# SamplingParams fields (vllm-protocol.md 3.2).
_SAMPLING_ID_LISTS = ("stop_token_ids", "allowed_token_ids", "logprob_token_ids", "trace_decode_token_ids")
_SAMPLING_TEXT = ("stop", "bad_words")  # strings a tokens-only engine would tokenize with no tokenizer
_SAMPLING_PASSTHROUGH = frozenset({
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "watermarking",
    "top_p", "top_k", "min_p", "seed", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "prompt_logprob_start", "flat_logprobs", "detokenize", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "output_kind", "stream_interval",
    "skip_clone", "output_text_buffer_length", "skip_reading_prefix_cache",
    "thinking_token_budget", "repetition_detection", "routed_experts_prompt_start",
})
_SAMPLING_KNOWN = _SAMPLING_PASSTHROUGH | set(_SAMPLING_ID_LISTS) | set(_SAMPLING_TEXT) | {
    "logit_bias", "prompt_logprob_token_ids", "structured_outputs", "extra_args",
}


def refuse_unsendable(generate_request: Mapping[str, Any]) -> None:
    """Raise ``ObfuscationRefused`` when ``generate_request`` cannot cross the boundary at all.

    What ``obfuscate_request`` would refuse, without mapping anything: the pipeline calls it once
    right after render, so such a request gets its 400 before it is admitted or placed.
    """
    unknown = set(generate_request) - _REQUEST_KNOWN
    if unknown:
        raise ObfuscationRefused(f"cannot obfuscate request field(s) {sorted(unknown)}; refusing to send them plain")
    if generate_request.get("content_parts") or generate_request.get("features"):
        raise ObfuscationRefused(
            "multimodal input (images, audio, video) cannot be sent to an obfuscated engine: the engine "
            "would need it in plain form. Send text only while token obfuscation is on.",
            param="messages",
        )
    if generate_request.get("output_mode", "tokens") not in (None, "tokens"):
        raise ObfuscationRefused("only output_mode 'tokens' can cross the obfuscation boundary", param="output_mode")
    params = generate_request.get("sampling_params")
    if params is not None:
        _refuse_sampling(params)


def obfuscate_request(generate_request: Mapping[str, Any], mapping: TokenMapping) -> dict[str, Any]:
    """Return a copy of ``generate_request`` that an obfuscated engine may receive.

    Maps the prompt ``token_ids`` (of any topology and leg, replay prompts included: call this
    right before each engine request) and, in ``sampling_params``, ``stop_token_ids``,
    ``allowed_token_ids``, ``logprob_token_ids``, ``trace_decode_token_ids``, the keys of
    ``logit_bias`` and the rows of ``prompt_logprob_token_ids`` (-1 padding stays -1); replaces
    ``cache_salt`` by a keyed digest of it; leaves out the fields the engine does not read
    (``parse_context``, ``token_offsets``, ``reasoning_parser_kwargs``, ``reasoning_ended``).
    The input is not modified. Raises ``ObfuscationRefused`` (``refuse_unsendable``) for anything
    that would carry text or plain ids to the engine.
    """
    refuse_unsendable(generate_request)
    out = {k: v for k, v in generate_request.items() if k not in _REQUEST_DROPPED and k not in _REQUEST_REFUSED}
    token_ids = generate_request.get("token_ids")
    if token_ids is not None:
        out["token_ids"] = mapping.to_physical(token_ids)
    params = generate_request.get("sampling_params")
    if params is not None:
        out["sampling_params"] = _obfuscate_sampling(params, mapping)
    salt = generate_request.get("cache_salt")
    if salt is not None:
        out["cache_salt"] = mapping.salt(str(salt))
    return out


def _refuse_sampling(params: Mapping[str, Any]) -> None:
    unknown = set(params) - _SAMPLING_KNOWN
    if unknown:
        raise ObfuscationRefused(
            f"cannot obfuscate sampling parameter(s) {sorted(unknown)}; refusing to send them plain",
            param="sampling_params",
        )
    for name in _SAMPLING_TEXT:
        if params.get(name):
            raise ObfuscationRefused(
                f"{name} strings cannot be sent to an obfuscated engine; use token ids", param=name
            )
    if params.get("extra_args"):
        # Custom logits processors read these; their values may be plain ids or text. The client
        # cannot send them (request_checks refuses vllm_xargs), so only a bug could put one here.
        raise ObfuscationRefused("extra_args cannot cross the obfuscation boundary", param="extra_args")
    if params.get("structured_outputs"):
        # The engine would compile the grammar against its (plain) vocabulary: wrong ids and text exposed.
        raise ObfuscationRefused("structured outputs are not supported with token obfuscation", param="structured_outputs")


def _obfuscate_sampling(params: Mapping[str, Any], mapping: TokenMapping) -> dict[str, Any]:
    out = dict(params)
    for name in _SAMPLING_ID_LISTS:
        if params.get(name) is not None:
            out[name] = mapping.to_physical(params[name])
    bias = params.get("logit_bias")
    if bias:
        try:
            ids = [int(k) for k in bias]
        except (TypeError, ValueError):
            raise ObfuscationRefused("logit_bias keys must be token ids", param="logit_bias") from None
        out["logit_bias"] = {str(p): v for p, v in zip(mapping.to_physical(ids), bias.values(), strict=True)}
    rows = params.get("prompt_logprob_token_ids")
    if rows is not None:
        out["prompt_logprob_token_ids"] = [_map_padded(row, mapping) for row in rows]
    return out


def _map_padded(row: Sequence[int], mapping: TokenMapping) -> list[int]:
    # -1 pads a row to the common width (scores -inf); it is not a token and stays -1.
    arr = np.asarray(row, dtype=np.int64)
    keep = arr != -1
    out = arr.copy()
    out[keep] = mapping.to_physical(arr[keep].tolist())
    result: list[int] = out.tolist()
    return result


# --- the response boundary ---------------------------------------------------------------------


def deobfuscate_response(response: dict[str, Any], mapping: TokenMapping) -> dict[str, Any]:
    """Return a copy of a non-streaming GenerateResponse with every id back in semantic ids.

    Maps each choice's ``token_ids``, an integer ``stop_reason``, logprob ``token_id``s (content
    and every top alternative), ``sampling_mask`` rows, the returned ``prompt_token_ids`` and
    the keys of ``prompt_logprobs``. Raises ``ObfuscatedOutputInvalid`` for an id outside the
    vocabulary. An error body passes through unchanged.
    """
    return _deobfuscate(response, mapping)


def deobfuscate_event(event: dict[str, Any], mapping: TokenMapping) -> dict[str, Any]:
    """The same for one streaming event (delta ``token_ids``; an ``error`` event passes through)."""
    return _deobfuscate(event, mapping)


# GenerateResponse / stream event fields (vllm-protocol.md 3.4, 3.5) by how they come back.
# Anything else is refused: a field added upstream could carry physical ids the client must not
# see, and passing it through unmapped is not closed.
_RESPONSE_PLAIN = frozenset({
    "request_id", "model", "created", "usage", "output_mode", "metrics", "mm_placeholders",
    "kv_transfer_params", "ec_transfer_params",  # connector state: block ids and addresses, no token ids
    "prompt_token_id_logprobs",  # logprob values of the requested ids, in request order: no ids
})
_RESPONSE_MAPPED = frozenset({"prompt_token_ids", "prompt_logprobs", "choices"})
_CHOICE_PLAIN = frozenset({"index", "finish_reason", "routed_experts", "weight_versions"})
_CHOICE_MAPPED = frozenset({"token_ids", "stop_reason", "sampling_mask", "logprobs"})


def _refuse_unknown(body: dict[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(k for k, v in body.items() if k not in known and v is not None)
    if unknown:
        raise ObfuscatedOutputInvalid(f"the engine answered {where} field(s) {unknown} that cannot be deobfuscated")


def scrub_error(error: dict[str, Any]) -> dict[str, Any]:
    """An engine's error object without its message: it may quote physical ids (or text decoded
    from them), which tell a client the permutation. Status, type and param stay."""
    code = error.get("code")
    return {
        "message": f"The engine refused the request ({code}); details are withheld with token obfuscation on.",
        "type": error.get("type") or "BadRequestError", "param": error.get("param"), "code": code,
    }


def _deobfuscate(body: dict[str, Any], mapping: TokenMapping) -> dict[str, Any]:
    if "error" in body and "choices" not in body:
        error = body["error"]
        return {"error": scrub_error(error) if isinstance(error, dict) else scrub_error({})}
    _refuse_unknown(body, _RESPONSE_PLAIN | _RESPONSE_MAPPED, "response")
    out = dict(body)
    if body.get("prompt_token_ids") is not None:
        out["prompt_token_ids"] = mapping.to_semantic(body["prompt_token_ids"])
    if body.get("prompt_logprobs") is not None:
        out["prompt_logprobs"] = [
            None if pos is None else _semantic_keys(pos, mapping) for pos in body["prompt_logprobs"]
        ]
    if body.get("choices") is not None:
        out["choices"] = [_deobfuscate_choice(c, mapping) for c in body["choices"]]
    return out


def _semantic_keys(by_id: dict[str, Any], mapping: TokenMapping) -> dict[str, Any]:
    ids = mapping.to_semantic([int(k) for k in by_id])
    return {str(s): v for s, v in zip(ids, by_id.values(), strict=True)}


def _deobfuscate_choice(choice: dict[str, Any], mapping: TokenMapping) -> dict[str, Any]:
    _refuse_unknown(choice, _CHOICE_PLAIN | _CHOICE_MAPPED, "choice")
    out = dict(choice)
    if choice.get("token_ids") is not None:
        out["token_ids"] = mapping.to_semantic(choice["token_ids"])
    stop = choice.get("stop_reason")
    # An int is the stop token id; a str is a stop string (never on a tokens-only engine) or
    # "repetition_detected"; bool is an int in Python but never a token id here.
    if isinstance(stop, int) and not isinstance(stop, bool):
        out["stop_reason"] = mapping.semantic(stop)
    if choice.get("sampling_mask") is not None:
        out["sampling_mask"] = [mapping.to_semantic(row) for row in choice["sampling_mask"]]
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and logprobs.get("content") is not None:
        out["logprobs"] = {**logprobs, "content": _deobfuscate_logprobs(logprobs["content"], mapping)}
    return out


def _deobfuscate_logprobs(content: list[dict[str, Any]], mapping: TokenMapping) -> list[dict[str, Any]]:
    # Every id of every position (sampled and alternatives) in one vectorized call.
    flat: list[int] = []
    for e in content:
        flat.append(e["token_id"])
        flat.extend(t["token_id"] for t in e.get("top_logprobs") or ())
    ids = iter(mapping.to_semantic(flat))
    out = []
    for e in content:
        entry = {**e, "token_id": next(ids)}
        tops = e.get("top_logprobs")
        if tops:
            entry["top_logprobs"] = [{**t, "token_id": next(ids)} for t in tops]
        out.append(entry)
    return out
