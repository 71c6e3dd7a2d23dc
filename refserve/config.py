"""`EngineConfig`: every knob of the engine, with vLLM's names, checked once at start-up.

| knob | meaning |
| --- | --- |
| block_size | tokens per KV block (PagedAttention page size) |
| num_gpu_blocks_override | force the pool size in blocks (otherwise sized from memory) |
| gpu_memory_utilization | share of the device's TOTAL memory for weights + activations + KV |
| kv_cache_memory_bytes | bytes of host memory for the KV pool on the CPU backends |
| seed | engine-level seed: requests without their own seed draw from it (None: not reproducible) |
| enforce_eager | never capture CUDA graphs (vLLM's name; the CPU backends are always eager) |
| max_model_len | longest sequence (prompt + output) a request may reach |
| max_num_seqs | seats in the running batch (continuous-batching slot cap) |
| max_num_batched_tokens | token budget of one step (chunked prefill); None: the backend's |
| long_prefill_token_threshold | most tokens one prefill takes per step (0: no cap; None: backend) |
| enable_chunked_prefill | False: prefill-first steps, decodes wait (vLLM V0's schedule) |
| enable_prefix_caching | reuse full KV blocks of an identical prompt prefix |
| prefix_caching_policy | "hash" (vLLM's hash chain, default) or "radix" (SGLang's tree) |
| scheduling_policy | waiting-queue order: "fcfs", "lpm" (longest cached prefix), "priority" |
| preemption_mode | "recompute" (vLLM v1's only one) or "swap": the KV to host memory and back |
| swap_space | GiB of host memory for swapped-out KV blocks (vLLM's; preemption_mode="swap") |
| batching | "continuous" (iteration-level) or "static" (request-level, for comparison) |
| kv_cache_layout | "paged", or "contiguous": the naive baseline, one max_model_len block |
| dtype | weights and KV cache: auto (float32 on the CPU backends), float32, float16, bfloat16 |
| speculative_config | vLLM's dict: method ngram / draft_model, num_speculative_tokens, ... |

`num_gpu_blocks` and `kv_cache_memory` are the old spellings of the two renamed knobs: still
accepted, with a FutureWarning once per process.

gpu_memory_utilization has vLLM's meaning: the whole instance (weights, activations and KV
cache) may use that fraction of the device's total memory, not of what happens to be free.

Only the logits are upcast to float32, whatever the dtype. `BACKENDS` and `DTYPES` are the
one list of each: `get_backend`, the CLIs and the validation here all read them.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import InitVar, dataclass

from refserve.speculative_config import SpeculativeConfig

# "numpy": the reference (plain NumPy, what the course reads); "cpu": the tuned CPU backend;
# "cupy": CUDA; "auto": cupy on a GPU, else cpu (refserve/backends/__init__.py).
BACKENDS = ("auto", "numpy", "cpu", "cupy")
DTYPES = ("auto", "float32", "float16", "bfloat16")
BATCHING = ("continuous", "static")
KV_CACHE_LAYOUTS = ("paged", "contiguous")
PREFIX_CACHING_POLICIES = ("hash", "radix")  # kv_cache_manager.py checks the same list
SCHEDULING_POLICIES = ("fcfs", "lpm", "priority")  # scheduler/scheduling_policy.py's
PREEMPTION_MODES = ("recompute", "swap")  # scheduler/swapping.py's

# The token budget of one step when max_num_batched_tokens is None, per backend, chosen as
# vLLM chooses its defaults per device: one step at the budget must stay well under a second,
# or every running decode stalls that long behind one long prompt. The CPU backends (the
# reference and the tuned one share the CPU's defaults): a prefill step of
# SmolLM2-135M costs 0.86-0.91 s of CPU on one core at 256 tokens (OpenBLAS SkylakeX, one
# thread, time.thread_time; 512: 1.8 s, 1024: 4.0-4.1 s, 2048: 9.9-10.9 s: attention makes a
# big step dearer per token), so about half that on 2 cores. CuPy: vLLM's 8192.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"numpy": 256, "cpu": 256, "cupy": 8192}
# vLLM's long_prefill_token_threshold: the most tokens one prefill may take in a step. With
# the CPU defaults a long prompt's chunk takes half the budget, so a request arriving
# behind it is admitted the next step instead of after the whole prefill (a prefill costs
# about the same per token in chunks of 128 as of 256 on the CPU: compute-bound). 0 = no
# cap, vLLM's default with one partial prefill (CuPy: the GPU step is short anyway). It
# applies only when the budget is the backend's default too; set it to cap a budget of yours.
DEFAULT_LONG_PREFILL_FRACTION = {"numpy": 0.5, "cpu": 0.5, "cupy": 0.0}


def resolve_max_num_batched_tokens(value: int | None, backend_name: str) -> int:
    """`value`, or the backend's default token budget when it is None."""
    return DEFAULT_MAX_NUM_BATCHED_TOKENS[backend_name] if value is None else value


def resolve_long_prefill_token_threshold(value: int | None, budget_was_default: bool,
                                         budget: int, backend_name: str) -> int:
    """`value`, or (None) the backend's default cap when the budget is its default too,
    else 0 (no cap)."""
    if value is not None:
        return value
    if not budget_was_default:
        return 0
    return int(budget * DEFAULT_LONG_PREFILL_FRACTION[backend_name])

# Old name -> vLLM's name. The old names still work and warn once per process.
DEPRECATED_ALIASES = {"num_gpu_blocks": "num_gpu_blocks_override",
                      "kv_cache_memory": "kv_cache_memory_bytes"}
_warned: set[str] = set()


def warn_deprecated(old: str, new: str) -> None:
    """Say once per process that `old` is a deprecated spelling of `new`."""
    if old not in _warned:
        _warned.add(old)
        warnings.warn(f"{old} is deprecated: use {new} (vLLM's name)", FutureWarning,
                      stacklevel=4)


@dataclass
class EngineConfig:
    model: str | None = None
    backend: str = "auto"
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int = 2 * 1024**3
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None   # None: the backend's default
    long_prefill_token_threshold: int | None = None  # None: the backend's default (0: off)
    enable_chunked_prefill: bool = True  # False: prefill-only steps (scheduler/scheduler.py)
    enable_prefix_caching: bool = True
    prefix_caching_policy: str = "hash"
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    swap_space: float = 4.0  # GiB, vLLM's default; allocated only for preemption_mode="swap"
    batching: str = "continuous"
    kv_cache_layout: str = "paged"
    speculative_config: dict | SpeculativeConfig | None = None
    dtype: str = "auto"

    seed: int | None = 0
    enforce_eager: bool = False
    # The deprecated spellings, accepted at construction only (see DEPRECATED_ALIASES).
    num_gpu_blocks: InitVar[int | None] = None
    kv_cache_memory: InitVar[int | None] = None

    @classmethod
    def keyword_names(cls) -> set[str]:
        """Every keyword `EngineConfig(...)` accepts, the deprecated aliases included."""
        return {f.name for f in dataclasses.fields(cls)} | set(DEPRECATED_ALIASES)

    def __post_init__(self, num_gpu_blocks: int | None = None,
                      kv_cache_memory: int | None = None) -> None:
        for old, value in (("num_gpu_blocks", num_gpu_blocks),
                           ("kv_cache_memory", kv_cache_memory)):
            if value is not None:
                new = DEPRECATED_ALIASES[old]
                warn_deprecated(old, new)
                setattr(self, new, value)

        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")

        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.batching not in BATCHING:
            raise ValueError(f"batching={self.batching!r}: choose one of {', '.join(BATCHING)}")
        if self.prefix_caching_policy not in PREFIX_CACHING_POLICIES:
            raise ValueError(f"prefix_caching_policy={self.prefix_caching_policy!r}: choose "
                             f"one of {', '.join(PREFIX_CACHING_POLICIES)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r}: choose one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        if self.batching == "static" and self.scheduling_policy != "fcfs":
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} needs "
                             "batching='continuous' (static batching forms batches fcfs)")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={self.preemption_mode!r}: choose one of "
                             f"{', '.join(PREEMPTION_MODES)}")
        if self.batching == "static" and self.preemption_mode != "recompute":
            raise ValueError(f"preemption_mode={self.preemption_mode!r} needs "
                             "batching='continuous' (static batching preempts by recompute)")
        if (isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float))
                or not self.swap_space >= 0):
            raise ValueError(f"swap_space={self.swap_space!r}: must be a number of GiB >= 0")
        if self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_layout={self.kv_cache_layout!r}: choose one of "
                             f"{', '.join(KV_CACHE_LAYOUTS)}")
        for name in ("block_size", "max_num_seqs", "kv_cache_memory_bytes"):
            positive_int(name)
        for name in ("num_gpu_blocks_override", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                positive_int(name)
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (not isinstance(threshold, int) or isinstance(
                threshold, bool) or threshold < 0):
            raise ValueError(f"long_prefill_token_threshold={threshold!r}: must be an integer "
                             ">= 0 (0: no cap on a prefill's tokens per step)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(
                self.seed, bool) or self.seed < 0):
            raise ValueError(f"seed={self.seed!r}: must be an integer >= 0 or None")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill={self.enable_chunked_prefill!r}: must "
                             "be True or False")
        if self.batching == "static" and not self.enable_chunked_prefill:
            raise ValueError("enable_chunked_prefill=False needs batching='continuous' "
                             "(static batching prefills its batch before it decodes anyway)")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager={self.enforce_eager!r}: must be True or False")
        if (isinstance(self.gpu_memory_utilization, bool)
                or not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r}: "
                             "must be in (0, 1]")
        if self.speculative_config is not None:
            # vLLM's dict ({"method": "ngram", "num_speculative_tokens": 4, ...}), checked
            # and turned into a SpeculativeConfig (refserve/speculative_config.py).
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
