"""The streaming derender call the sidecar benchmarks make: a short chat and one engine event of one
token (``derender_cost.py``, ``sidecar_options.py``, ``sidecar_layers.py``). Nothing imported:
``sidecar_layers.py`` reads it inside the render environment, where the coordinator's packages are not."""

BODY = {
    "model": "tiny",
    "messages": [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Tell me about cats."}],
    "max_tokens": 32, "stream": True, "temperature": 0, "ignore_eos": True,
}
# One engine event as generate streams it (serving/pipeline/engine: nulls present), one token.
EVENT = {
    "request_id": "generate-tokens-bench", "usage": None, "output_mode": "tokens",
    "choices": [{"index": 0, "finish_reason": None, "stop_reason": None, "token_ids": [1000],
                 "routed_experts": None, "sampling_mask": None, "weight_versions": None, "logprobs": None}],
}
