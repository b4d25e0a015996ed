"""``python -m enginesim --port P --served-model-name tiny --vocab-size N --eos-token-id E``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import uvicorn

from enginesim.app import create_app
from enginesim.config import EngineRole, SimConfig, read_model_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m enginesim", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--model-dir", default=None, help="read vocab_size / eos from here")
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--eos-token-id", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eos-probability", type=float, default=0.03)
    parser.add_argument("--ttft-per-token-ms", type=float, default=0.0)
    parser.add_argument("--tpot-ms", type=float, default=0.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-logprobs", type=int, default=20)
    parser.add_argument("--engine-version", default="0.32.0", help="what GET /version reports")
    parser.add_argument("--role", choices=[r.value for r in EngineRole], default="union")
    parser.add_argument("--kv-connector", default=None, help="reported only (e.g. NixlConnector)")
    parser.add_argument("--kv-transfer", choices=["pull", "push"], default="pull")
    parser.add_argument("--kv-pull-params", choices=["returned", "router"], default="returned",
                        help="pull: P returns the decode params (NIXL, MooncakeConnectorV1) or the router "
                        "supplies them (upstream vLLM MooncakeConnector)")
    parser.add_argument("--kv-engine-id", default=None, help="the engine id in KV params (kv_transfer_config.engine_id)")
    parser.add_argument("--kv-hold-s", type=float, default=30.0)
    parser.add_argument("--kv-push-timeout-s", type=float, default=30.0)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--cache-blocks", type=int, default=512)
    parser.add_argument("--kv-events-endpoint", default=None, help="tcp://*:P or ipc:// binds; tcp://host:P connects")
    parser.add_argument("--kv-events-topic", default="")
    parser.add_argument("--tokens-only", action="store_true", help="no tokenizer, as vLLM's --tokens-only")
    parser.add_argument("--omit-route", action="append", default=[], metavar="PATH",
                        help="a route this engine does not serve (e.g. /v1/messages); repeatable")
    parser.add_argument("--log-level", default="warning")
    return parser


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Merge the model directory (if any) with CLI flags; flags win."""
    info = read_model_dir(args.model_dir) if args.model_dir else None
    vocab_size = args.vocab_size or (info.vocab_size if info else None)
    if args.eos_token_id is not None:
        eos_ids: tuple[int, ...] = (args.eos_token_id,)
    else:
        eos_ids = info.eos_token_ids if info else ()
    if vocab_size is None:
        raise SystemExit("--vocab-size is required (or --model-dir with config.json)")
    if not eos_ids:
        raise SystemExit("--eos-token-id is required (or --model-dir with generation_config.json)")
    names = tuple(args.served_model_name or [args.model_dir or "tiny"])
    return SimConfig(
        served_model_names=names,
        vocab_size=vocab_size,
        eos_token_ids=eos_ids,
        max_model_len=args.max_model_len,
        seed=args.seed,
        eos_probability=args.eos_probability,
        special_token_ids=info.special_token_ids if info else frozenset(),
        sampleable_limit=info.tokenizer_size if info else None,
        default_max_new_tokens=info.max_new_tokens if info else None,
        model_root=args.model_dir,
        version=args.engine_version,
        max_num_seqs=args.max_num_seqs,
        max_logprobs=args.max_logprobs,
        ttft_per_token_ms=args.ttft_per_token_ms,
        tpot_ms=args.tpot_ms,
        role=EngineRole(args.role),
        kv_connector=args.kv_connector,
        kv_transfer=args.kv_transfer,
        kv_pull_params=args.kv_pull_params,
        kv_engine_id=args.kv_engine_id,
        kv_hold_seconds=args.kv_hold_s,
        kv_push_timeout_seconds=args.kv_push_timeout_s,
        host=args.host,
        port=args.port,
        block_size=args.block_size,
        cache_blocks=args.cache_blocks,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_topic=args.kv_events_topic,
        tokens_only=args.tokens_only,
        omitted_routes=frozenset(args.omit_route),
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    app = create_app(config_from_args(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main(sys.argv[1:])
