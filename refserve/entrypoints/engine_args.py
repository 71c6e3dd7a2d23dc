"""The engine's command-line flags, with vLLM's names, for `refserve.serve` and the benches.

`add_engine_args(parser)` adds them; `engine_config_from_args(args)` turns the parsed values
into an `EngineConfig` (which validates them and raises ValueError naming the knob).
`refserve.generate` defines the same flags itself; keep the two in step.
"""

from __future__ import annotations

import argparse

from refserve.capacity import parse_memory
from refserve.config import BACKENDS, BATCHING, KV_CACHE_LAYOUTS, EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    e = parser.add_argument_group("engine (names as in vLLM)")
    e.add_argument("--model", default=None, help="HF-format folder (default: the embedded "
                   "SmolLM2-135M-Instruct, fetched and converted on first use)")
    e.add_argument("--backend", default="auto", choices=BACKENDS)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-gpu-blocks", type=int, default=None)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--kv-cache-memory", type=parse_memory, default=2 * 1024**3,
                   help="host memory for the KV pool on the NumPy backend, e.g. 2GiB")
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=8192)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    e.add_argument("--batching", default="continuous", choices=BATCHING)
    e.add_argument("--kv-cache-layout", default="paged", choices=KV_CACHE_LAYOUTS)
    return e


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Raises ValueError (from EngineConfig) naming the knob that is out of range."""
    return EngineConfig(
        model=args.model, backend=args.backend, block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching, batching=args.batching,
        kv_cache_layout=args.kv_cache_layout)


def engine_cli_flags(args: argparse.Namespace) -> list[str]:
    """The flags that rebuild `args`' engine on another command line (the load test starts
    `python -m refserve.serve` with the engine it was asked to measure)."""
    flags = []
    for action_dest, flag in (("model", "--model"), ("backend", "--backend"),
                              ("block_size", "--block-size"),
                              ("num_gpu_blocks", "--num-gpu-blocks"),
                              ("gpu_memory_utilization", "--gpu-memory-utilization"),
                              ("kv_cache_memory", "--kv-cache-memory"),
                              ("max_model_len", "--max-model-len"),
                              ("max_num_seqs", "--max-num-seqs"),
                              ("max_num_batched_tokens", "--max-num-batched-tokens"),
                              ("batching", "--batching"),
                              ("kv_cache_layout", "--kv-cache-layout")):
        value = getattr(args, action_dest)
        if value is not None:
            flags += [flag, str(value)]
    flags.append("--enable-prefix-caching" if args.enable_prefix_caching
                 else "--no-enable-prefix-caching")
    return flags
