"""Sizing an engine: its token budget, its KV pool, and the start-up line that says how.

The token budget: `max_num_batched_tokens=None` means the backend's default (config.py:
on NumPy small enough that one step stays well under a second on 2 cores), and with it
the backend's `long_prefill_token_threshold`; a budget the user gave keeps the threshold
off unless the user set it too.

The blocks, not the weights, decide how many sequences fit (WARMUP §2). All arithmetic is
refserve/capacity.py's; `size_kv_pool` only picks its inputs, in this order of precedence:

    num_gpu_blocks_override        the user's block count, as is
    a device that reports memory   gpu_memory_utilization x total - what is in use - one
                                   step's activations at the token budget
    otherwise (the CPU)            kv_cache_memory_bytes

    blocks = floor(memory / (bytes per block of the target + of the draft model, if any))

With a draft model both caches get the same number of blocks, so the memory is split
between them by bytes per token. More blocks than max_num_seqs full-length sequences can
use would be wasted memory, so the count is capped there; a pool that cannot hold one
max_model_len sequence would fail mid-run, so it is refused here.

`size_kv_pool` is the one pool-sizing rule, over a model's shape (`PoolShape`): the engine
calls it through `plan_kv_pool` with the memory its backend reports, the simulator
(refserve/simulator/engine.py) with a GPU profile, whose modelled weights and reserved
bytes are what is in use, and with tensor parallelism (the pool of one of its GPUs).
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
class PoolShape:
    """What the pool sizing reads of a model (capacity.model_shape's names). The engine
    takes it from its loaded model's config (`of_config`); the simulator from its preset
    or config.json (simulator/hardware.py: ModelShape.pool_shape)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of_config(cls, config) -> PoolShape:
        """From an HF-style model config (models/config.py's LlamaConfig)."""
        return cls(num_layers=config.num_hidden_layers,
                   num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                   hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size, vocab_size=config.vocab_size)

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
        """2 x layers x KV heads x head_dim x bytes, of ONE device: with tensor parallelism
        the KV heads are split across GPUs, and each keeps at least one (vLLM replicates KV
        heads when there are fewer than GPUs)."""
        kv_heads = max(1, self.num_kv_heads // tensor_parallel_size)
        return capacity.kv_bytes_per_token(self.num_layers, kv_heads, self.head_dim,
                                           dtype_bytes)

    def activation_bytes(self, tokens: int, max_num_seqs: int, dtype_bytes: int,
                         tensor_parallel_size: int = 1) -> int:
        """One step's activations at `tokens` query tokens, per device: hidden states, q/k/v
        and the MLP's, (4 hidden + 2 intermediate) x dtype per token, split by tensor
        parallelism, plus the float32 logits of at most max_num_seqs rows."""
        return (tokens * (4 * self.hidden_size + 2 * self.intermediate_size) * dtype_bytes
                // tensor_parallel_size + min(tokens, max_num_seqs) * self.vocab_size * 4)


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as the pool sizing sees it: `total` bytes and what is `in_use`
    before the pool (`in_use_what` says what that is). The engine measures it on its
    backend (plan_kv_pool); the simulator models it from a GPU profile."""

    total: int
    in_use: int
    in_use_what: str


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


def plan_kv_pool(config: EngineConfig, model_config, backend, dtype, max_model_len: int,
                 draft_config=None) -> KVPoolPlan:
    """The engine's pool: `size_kv_pool` for its loaded model (and draft model's config,
    None without one) in `dtype`, on the memory `backend` reports now, weights loaded."""
    free, device = backend.free_device_memory(), None
    if free is not None:
        total = backend.total_device_memory()
        device = DeviceMemory(total, total - free, "weights, other processes")
    draft = PoolShape.of_config(draft_config) if draft_config is not None else None
    return size_kv_pool(config, PoolShape.of_config(model_config), dtype.itemsize,
                        max_model_len, device, draft)


def size_kv_pool(config: EngineConfig, shape: PoolShape, dtype_bytes: int, max_model_len: int,
                 device: DeviceMemory | None, draft: PoolShape | None = None, *,
                 kv_dtype_bytes: int | None = None, tensor_parallel_size: int = 1
                 ) -> KVPoolPlan:
    """The pool for `config` (its token budget already resolved) of a model of `shape` in
    `dtype_bytes` per weight and activation, on `device` (None: the CPU); see the module
    docstring. The one rule of the engine (plan_kv_pool) and the simulator alike. `draft`:
    the draft model's shape, None without one. `kv_dtype_bytes`: bytes per cached K or V
    element when they differ from dtype_bytes (an fp8 cache); `tensor_parallel_size`: the
    pool of one of that many devices (the simulator's; the engine runs on one)."""
    tp = tensor_parallel_size
    kv_bytes = kv_dtype_bytes or dtype_bytes
    block_size = max_model_len if config.kv_cache_layout == "contiguous" else config.block_size
    bytes_per_token = shape.kv_bytes_per_token(kv_bytes, tp)
    bytes_per_block = capacity.kv_bytes_per_block(bytes_per_token, block_size)
    draft_bytes_per_token = draft.kv_bytes_per_token(kv_bytes, tp) if draft else 0
    draft_bytes_per_block = (capacity.kv_bytes_per_block(draft_bytes_per_token, block_size)
                             if draft_bytes_per_token else 0)
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
        knob = f"num_gpu_blocks_override={num_blocks}"
    else:
        if device is not None:
            activations = shape.activation_bytes(config.max_num_batched_tokens,
                                                 config.max_num_seqs, dtype_bytes, tp)
            memory, knob = capacity.kv_budget_on_device(
                device.total, device.in_use, config.gpu_memory_utilization, activations,
                device.in_use_what)
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
