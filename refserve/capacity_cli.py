"""`python -m refserve.capacity`: how much KV cache fits, and how many sequences it serves.

The command line around refserve/capacity.py (the math). Example:

    python -m refserve.capacity --model llama-3-8b --memory 80GiB --context 2048

The dtype is the model's own (config.json's torch_dtype; bfloat16 for the presets) unless
--dtype says otherwise. Warnings (on stderr) say when the context exceeds the model's
max_position_embeddings, or when one sequence of that context does not fit in the pool.
A mistake is one `error: ...` line, exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from refserve.capacity import (
    DTYPE_BYTES,
    KV_CACHE_DTYPES,
    PRESET_DTYPE,
    PRESETS,
    QUANTIZATIONS,
    capacity_report,
    format_bytes,
    kv_cache_dtype_bytes,
    load_model_config,
    model_dtype,
    weight_dtype_bytes,
)
from refserve.entrypoints.cli_common import ArgumentParser, memory_size


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _utilization(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1]")
    return value


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m refserve.capacity",
        description="How much KV cache fits, and how many sequences it serves.")
    parser.add_argument("--model", required=True,
                        help=f"folder with config.json, or a preset: {', '.join(PRESETS)}")
    parser.add_argument("--memory", required=True, type=memory_size(require_unit=True),
                        help="device memory with its unit, e.g. 80GiB, 24GB, 512MiB")
    parser.add_argument("--context", required=True, type=_positive_int,
                        help="tokens per sequence (prompt + output)")
    parser.add_argument("--block-size", type=_positive_int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                        help="dtype of weights and KV cache (default: the model's own)")
    parser.add_argument("--gpu-memory-utilization", type=_utilization, default=0.9)
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="fp8: one byte per weight (vLLM's --quantization fp8)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="fp8: one byte per K/V element, twice the tokens per pool "
                        "(vLLM's --kv-cache-dtype fp8; auto: --dtype's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    try:
        name, config = load_model_config(args.model)
        if args.dtype is None:
            args.dtype = (PRESET_DTYPE if name in PRESETS else model_dtype(config)) or "float16"
        dtype_bytes = DTYPE_BYTES[args.dtype]
        weight_bytes = weight_dtype_bytes(args.dtype, args.quantization)
        kv_bytes = kv_cache_dtype_bytes(args.dtype, args.kv_cache_dtype)
        r = capacity_report(config, args.memory, args.context, args.block_size, dtype_bytes,
                            args.gpu_memory_utilization, weight_bytes=weight_bytes,
                            kv_bytes=kv_bytes)
    except ValueError as err:
        parser.error(str(err))  # one `error:` line, exit status 2

    bs = args.block_size
    rows = [
        ("model", f"{name}: {r['num_layers']} layers, {r['num_heads']} heads, "
                  f"{r['num_kv_heads']} KV heads x {r['head_dim']}, {args.dtype}"
                  + (f", {args.quantization} weights" if args.quantization else "")
                  + (f", {args.kv_cache_dtype} KV cache" if args.kv_cache_dtype != "auto"
                     else "")),
        ("parameters", f"{r['parameters']:,}"),
        ("weights", f"{format_bytes(r['weights_bytes'])} ({r['weights_bytes']:,} bytes = "
                    f"{r['parameters']:,} x {weight_bytes})"),
        ("KV per token", f"{format_bytes(r['kv_bytes_per_token'])} "
                         f"= 2 x {r['num_layers']} x {r['num_kv_heads']} x {r['head_dim']} "
                         f"x {kv_bytes} bytes"),
        ("KV per block", f"{format_bytes(r['kv_bytes_per_block'])} = {bs} tokens x "
                         f"{r['kv_bytes_per_token']:,} bytes"),
        ("usable memory", f"{format_bytes(r['budget_bytes'])} "
                          f"= {format_bytes(args.memory)} x {args.gpu_memory_utilization}"),
        ("KV pool", f"{r['num_blocks']:,} blocks = {r['pool_tokens']:,} tokens "
                    f"({format_bytes(r['num_blocks'] * r['kv_bytes_per_block'])})"),
        (f"per sequence @ {args.context}",
         f"{r['blocks_per_sequence']} blocks, last holds {r['last_block_fill']}/{bs}, "
         f"{r['wasted_slots_per_sequence']} slots wasted "
         f"({format_bytes(r['kv_bytes_per_sequence'])})"),
        (f"max concurrency @ {args.context}", f"{r['max_concurrent_sequences']:,} sequences"),
    ]
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    limit = config.get("max_position_embeddings")
    if isinstance(limit, int) and args.context > limit:
        print(f"warning: --context {args.context} exceeds the model's max_position_embeddings "
              f"{limit}; the engine refuses a max_model_len above it", file=sys.stderr)
    if r["blocks_per_sequence"] > r["num_blocks"]:
        print(f"warning: one sequence of {args.context} tokens needs "
              f"{r['blocks_per_sequence']} blocks but the pool holds {r['num_blocks']}; the "
              "engine refuses to start with this memory and context", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
