"""The engine's command-line flags, declared once: `refserve.generate` and `refserve.serve`
take all of them, `refserve.simulate` and `refserve.plan` all but the few they give a
meaning of their own (`exclude`), so a flag means the same, with the same default, in all
four.

`add_engine_args(parser)` adds them in two groups: vLLM's names (same flag, same meaning as
`vllm serve`) and refserve's own, plus the deprecated spellings of the renamed knobs
(config.DEPRECATED_ALIASES: they still work and warn). `engine_config_from_args(args)` is
the one way from parsed flags to an `EngineConfig`, which validates every knob and raises
ValueError naming the one out of range.

`--tensor-parallel-size` is accepted for vLLM users' command lines: refserve runs a model on
one device, so 1 is the only value; anything else is refused, pointing at vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Collection

from refserve.config import (
    BACKENDS,
    BATCHING,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEPRECATED_ALIASES,
    DTYPES,
    KV_CACHE_LAYOUTS,
    PREEMPTION_MODES,
    PREFIX_CACHING_POLICIES,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from refserve.entrypoints.cli_common import json_object, memory_size

# EngineConfig fields a flag sets; every other field keeps EngineConfig's default.
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.init)


class DeprecatedAlias(argparse.Action):
    """An old flag spelling: stores into the new flag's dest and says so on stderr."""

    def __call__(self, parser, namespace, values, option_string=None):
        new = "--" + self.dest.replace("_", "-")
        print(f"warning: {option_string} is deprecated; use {new} (vLLM's name)",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def tensor_parallel_size(text: str) -> int:
    """argparse type: 1, the only size refserve runs; the error names vLLM for more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value != 1:
        raise argparse.ArgumentTypeError(
            f"{value}: refserve runs a model on one device (1 is the only size); to shard a "
            f"model over {value} devices use vLLM: vllm serve MODEL --tensor-parallel-size "
            f"{value}")
    return value


class _Group:
    """An argument group that leaves out the flags whose dest is in `exclude`, and records
    every dest it was given (so an exclusion that names no engine flag is caught)."""

    def __init__(self, group, exclude: Collection[str], seen: set[str]) -> None:
        self.group, self.exclude, self.seen = group, exclude, seen

    def add_argument(self, *flags: str, **options) -> None:
        dest = options.get("dest") or flags[0].lstrip("-").replace("-", "_")
        self.seen.add(dest)
        if dest not in self.exclude:
            self.group.add_argument(*flags, **options)


def add_engine_args(parser: argparse.ArgumentParser, exclude: Collection[str] = ()) -> None:
    """The engine flags, grouped apart from the entry point's own (see the module docstring).
    `exclude`: the dests of engine flags the caller declares itself with a meaning of its
    own (the simulator's --model is a preset's shape, not weights to load); a deprecated
    spelling goes with its flag. Raises ValueError for a dest that is no engine flag."""
    seen: set[str] = set()
    e = _Group(parser.add_argument_group("engine: vLLM's names and meanings"), exclude, seen)
    e.add_argument("--model", default=None, help="HF-format folder, or a hub id such as "
                   "HuggingFaceTB/SmolLM2-135M-Instruct, read from the Hugging Face cache "
                   "(default: the embedded SmolLM2-135M-Instruct, fetched and converted on "
                   "first use)")
    e.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights and KV cache; auto: float32 on NumPy")
    e.add_argument("--seed", type=int, default=0, help="engine-level seed: requests without "
                   "their own seed draw from it")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    e.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="force the KV pool size in blocks")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the device's TOTAL memory for weights + activations + KV")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's)")
    e.add_argument("--max-num-seqs", type=int, default=256,
                   help="seats in the running batch")
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step; longer prompts are prefilled in chunks "
                   "(default: the backend's, " + ", ".join(
                       f"{b} {n}" for b, n in DEFAULT_MAX_NUM_BATCHED_TOKENS.items()) +
                   ": one CPU step stays well under a second on 2 cores)")
    e.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="most tokens one prefill takes per step, so a long prompt leaves "
                   "budget for the requests behind it (0: no cap; default: half the budget "
                   "with the CPU backends' default budget, else 0)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV blocks of a prompt prefix seen before")
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="decodes and prefill chunks share a step; --no-...: "
                   "a step with prefill work runs prefills only and the decodes wait "
                   "(vLLM V0's schedule)")
    e.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                   help="waiting-queue order: fcfs, priority (a request's priority, lower "
                   "first) or lpm (SGLang's longest cached prefix first)")
    e.add_argument("--preemption-mode", default="recompute", choices=PREEMPTION_MODES,
                   help="what a preempted request loses: recompute (its KV, prefilled again) "
                   "or swap (its KV goes to host memory and comes back; vLLM v0's)")
    e.add_argument("--swap-space", type=float, default=4.0,
                   help="GiB of host memory for swapped-out KV blocks, with "
                   "--preemption-mode swap")
    e.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    e.add_argument("--tensor-parallel-size", type=tensor_parallel_size, default=1,
                   help="devices to shard the model over: refserve runs on one (use vLLM "
                   "for more)")
    e.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", '
                   '"num_speculative_tokens": 4}\' or \'{"method": "draft_model", '
                   '"num_speculative_tokens": 4, "model": "self", "num_draft_layers": 8}\'')

    r = _Group(parser.add_argument_group("engine: refserve's own"), exclude, seen)
    r.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="numpy: the plain reference the course reads; cpu: the tuned "
                   "CPU backend; auto: cupy when a CUDA GPU is usable, else cpu")
    r.add_argument("--kv-cache-memory-bytes", type=memory_size(require_unit=False),
                   default="2GiB", help="host memory for the KV pool on the CPU "
                   "backends, e.g. 2GiB (a bare number is bytes)")
    r.add_argument("--batching", default="continuous", choices=BATCHING,
                   help="static: request-level batching, for comparison")
    r.add_argument("--kv-cache-layout", default="paged", choices=KV_CACHE_LAYOUTS,
                   help="contiguous: the naive one-block-per-sequence baseline")
    r.add_argument("--prefix-caching-policy", default="hash", choices=PREFIX_CACHING_POLICIES,
                   help="how prefix hits are found: hash (vLLM's chain of block hashes) or "
                   "radix (SGLang's tree of token runs)")
    kinds = {"num_gpu_blocks_override": int,
             "kv_cache_memory_bytes": memory_size(require_unit=False)}
    for old, new in DEPRECATED_ALIASES.items():
        r.add_argument("--" + old.replace("_", "-"), dest=new, type=kinds[new],
                       action=DeprecatedAlias, default=argparse.SUPPRESS,
                       help=f"deprecated: --{new.replace('_', '-')}")
    unknown = sorted(set(exclude) - seen)
    if unknown:
        raise ValueError(f"exclude names no engine flag: {unknown}")


def engine_config_from_args(args: argparse.Namespace, exclude: Collection[str] = (),
                            **overrides) -> EngineConfig:
    """The EngineConfig the parsed flags describe, with `overrides` on top. `exclude`: the
    fields whose flags the entry point gave a meaning of its own (add_engine_args'
    exclude): those keep EngineConfig's defaults unless overridden. Raises ValueError
    (EngineConfig's own validation) naming the knob that is out of range."""
    fields = {name: getattr(args, name) for name in ENGINE_FIELDS
              if name not in exclude and hasattr(args, name)}
    return EngineConfig(**{**fields, **overrides})
