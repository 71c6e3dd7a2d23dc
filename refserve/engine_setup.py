"""Sizing an engine: its token budget, its KV pool, and the start-up line that says how.

The token budget: `max_num_batched_tokens=None` means the backend's default (config.py:
on NumPy small enough that one step stays well under a second on 2 cores), and with it
the backend's `long_prefill_token_threshold`; a budget the user gave keeps the threshold
off unless the user set it too.

The blocks, not the weights, decide how many sequences fit (WARMUP §2). All arithmetic is
refserve/capacity.py's; `plan_kv_pool` only picks its inputs, in this order of precedence:

    num_gpu_blocks_override        the user's block count, as is
    a device that reports memory   gpu_memory_utilization x total - what is in use - one
                                   step's activations at the token budget
    otherwise (the CPU)            kv_cache_memory_bytes

    blocks = floor(memory / (bytes per block of the target + of the draft model, if any))

With a draft model both caches get the same number of blocks, so the memory is split
between them by bytes per token. More blocks than max_num_seqs full-length sequences can
use would be wasted memory, so the count is capped there; a pool that cannot hold one
max_model_len sequence would fail mid-run, so it is refused here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import refserve.capacity as capacity
from refserve.config import (
    EngineConfig,
    resolve_long_prefill_token_threshold,
    resolve_max_num_batched_tokens,
)
from refserve.kv_cache.host_pool import host_blocks_for_swap_space

GiB = 1024**3


def resolve_token_budget(config: EngineConfig, backend_name: str
                         ) -> tuple[EngineConfig, str]:
    """`config` with max_num_batched_tokens and long_prefill_token_threshold resolved for
    `backend_name`, and where the budget came from (for the start-up line)."""
    was_default = config.max_num_batched_tokens is None
    budget = resolve_max_num_batched_tokens(config.max_num_batched_tokens, backend_name)
    threshold = resolve_long_prefill_token_threshold(
        config.long_prefill_token_threshold, was_default, budget, backend_name)
    source = f"the {backend_name} default" if was_default else "max_num_batched_tokens"
    return dataclasses.replace(config, max_num_batched_tokens=budget,
                               long_prefill_token_threshold=threshold), source


@dataclass(frozen=True)
class KVPoolPlan:
    """How big the KV pool is and why (`knob`: the setting that decided it)."""

    block_size: int
    bytes_per_token: int            # target model: 2 x layers x KV heads x head_dim x dtype
    bytes_per_block: int
    draft_bytes_per_token: int      # 0 without a draft model
    draft_bytes_per_block: int
    num_blocks: int
    knob: str
    num_host_blocks: int            # swap preemption's host pool (0 with recompute)


def _bytes_per_token(model_config, dtype_name: str) -> int:
    return capacity.kv_bytes_per_token(
        model_config.num_hidden_layers, model_config.num_key_value_heads,
        model_config.head_dim, capacity.DTYPE_BYTES[dtype_name])


def plan_kv_pool(config: EngineConfig, model_config, backend, dtype, max_model_len: int,
                 draft_config=None) -> KVPoolPlan:
    """The pool for `config` (its token budget already resolved) on `backend`; see the
    module docstring. `draft_config`: the draft model's config, None without one."""
    mc = model_config
    block_size = max_model_len if config.kv_cache_layout == "contiguous" else config.block_size
    bytes_per_token = _bytes_per_token(mc, dtype.name)
    bytes_per_block = capacity.kv_bytes_per_block(bytes_per_token, block_size)
    draft_bytes_per_token = _bytes_per_token(draft_config, dtype.name) if draft_config else 0
    draft_bytes_per_block = (capacity.kv_bytes_per_block(draft_bytes_per_token, block_size)
                             if draft_bytes_per_token else 0)
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
        knob = f"num_gpu_blocks_override={num_blocks}"
    else:
        free_device = backend.free_device_memory()
        if free_device is not None:
            # Activations of one step at the token budget: hidden states, q/k/v, MLP, logits.
            tokens, item = config.max_num_batched_tokens, dtype.itemsize
            activations = (tokens * (4 * mc.hidden_size + 2 * mc.intermediate_size) * item
                           + min(tokens, config.max_num_seqs) * mc.vocab_size * 4)
            memory, knob = capacity.kv_budget_on_device(
                backend.total_device_memory(), free_device, config.gpu_memory_utilization,
                activations)
        else:
            memory = config.kv_cache_memory_bytes
            knob = f"kv_cache_memory_bytes={memory}"
        num_blocks = capacity.num_blocks_for_memory(
            memory, 1.0, 0, bytes_per_block + draft_bytes_per_block)
        num_blocks = min(num_blocks, config.max_num_seqs * capacity.blocks_for_tokens(
            max_model_len, block_size))
    capacity.check_pool_holds_one_sequence(num_blocks, block_size, max_model_len, knob)
    num_host_blocks = (host_blocks_for_swap_space(config.swap_space, bytes_per_block)
                       if config.preemption_mode == "swap" else 0)
    return KVPoolPlan(block_size=block_size, bytes_per_token=bytes_per_token,
                      bytes_per_block=bytes_per_block,
                      draft_bytes_per_token=draft_bytes_per_token,
                      draft_bytes_per_block=draft_bytes_per_block, num_blocks=num_blocks,
                      knob=knob, num_host_blocks=num_host_blocks)


def startup_lines(config: EngineConfig, backend_name: str, model_name: str,
                  num_parameters: int, max_model_len: int, plan: KVPoolPlan,
                  budget_source: str, speculation: str = "", backend_note: str = ""
                  ) -> list[str]:
    """What the engine prints to stderr at start-up (progress=True): backend, model, the
    pool and the knob that sized it, the token budget and where it came from, how the
    backend runs (`backend_note`: its `startup_note()`, e.g. the CPU's threads), and the
    speculative setup (`speculation`: how its proposer describes itself)."""
    tokens = plan.num_blocks * plan.block_size
    cap = (f", a prefill at most {config.long_prefill_token_threshold}"
           if config.long_prefill_token_threshold else "")
    lines = [f"refserve: {config.backend}→{backend_name} backend, model {model_name} "
             f"({num_parameters / 1e6:.0f}M params) | KV cache {plan.num_blocks} blocks × "
             f"{plan.block_size} tokens = {tokens} tokens, "
             f"{plan.num_blocks * plan.bytes_per_block / GiB:.2f} GiB | max concurrency at "
             f"max_model_len {max_model_len}: {tokens / max_model_len:.2f}x | sized by "
             f"{plan.knob} | token budget {config.max_num_batched_tokens} per step "
             f"({budget_source}){cap}" + (f" | {backend_note}" if backend_note else "")]
    spec = config.speculative_config
    if spec is not None:
        draft = ""
        if plan.draft_bytes_per_token:
            draft = (f"; KV memory split by bytes per token: target {plan.bytes_per_token} B,"
                     f" draft {plan.draft_bytes_per_token} B -> draft cache "
                     f"{plan.num_blocks * plan.draft_bytes_per_block / GiB:.2f} GiB")
        lines.append(f"refserve: speculative decoding {speculation}, k = {spec.k}, adaptive "
                     f"{'on' if spec.adaptive else 'off'}{draft}")
    return lines
