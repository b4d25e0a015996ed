"""vLLM's probe routes on the simulator: health, version, load, served models and Prometheus metrics,
answered the way a coordinator's probes read a real engine's."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from enginesim.engine import SimEngine
from enginesim.protocol import ModelCard, ModelList


class ProbeHandlers:
    """The probe routes bound to one engine."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": self.engine.config.version})

    async def load(self, request: Request) -> Response:
        return JSONResponse({"server_load": self.engine.running})

    async def models(self, request: Request) -> Response:
        config = self.engine.config
        created = int(time.time())
        cards = [
            ModelCard(id=name, created=created, root=config.root, max_model_len=config.max_model_len)
            for name in config.served_model_names
        ]
        return JSONResponse(ModelList(data=cards).model_dump())

    async def metrics(self, request: Request) -> Response:
        engine = self.engine
        label = f'engine="0",model_name="{engine.config.model_name}"'
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{label}}} {float(engine.running)}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{label}}} 0.0",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{label}}} {float(engine.stats.prompt_tokens_total)}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{label}}} {float(engine.stats.generation_tokens_total)}",
            "# TYPE vllm:request_success_total counter",
        ]
        for reason in ("stop", "length", "abort"):
            count = float(engine.stats.finished.get(reason, 0))
            lines.append(f'vllm:request_success_total{{{label},finished_reason="{reason}"}} {count}')
        cache = engine.cache
        lines.append("# TYPE vllm:prompt_tokens_by_source_total counter")
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            count = float(engine.stats.prompt_tokens_by_source.get(source, 0))
            lines.append(f'vllm:prompt_tokens_by_source_total{{{label},source="{source}"}} {count}')
        lines += [
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{label}}} {float(cache.stats.queried_tokens)}",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{label}}} {float(cache.stats.hits)}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{label}}} {len(cache) / max(cache.capacity, 1)}",
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            # The labels vLLM's CacheConfig.metrics_info() gives that a coordinator reads.
            f'vllm:cache_config_info{{block_size="{cache.block_size}",cache_dtype="auto",'
            f'enable_prefix_caching="True",engine="0",num_gpu_blocks="{cache.capacity}",'
            f'prefix_caching_hash_algo="sha256"}} 1.0',
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
