"""Could this request ever run? Checked before anything is queued or allocated (the
scheduler's add_sequence, the engine's validate_request). And could a scheduler with these
limits ever run anything (check_scheduler_args, at construction). The other rule of a sequence's
length, when it stops, is the stop rules' (refserve/sequence.py).
"""

from __future__ import annotations

from refserve.capacity import blocks_for_tokens
from refserve.config import PREEMPTION_MODES


def check_fits(scheduler, num_prompt_tokens: int, num_seats: int = 1) -> None:
    """Raise ValueError if a prompt could never run on `scheduler`: empty, longer than
    max_model_len, more blocks than the whole pool (prompt + the first sampled token), or
    more seats (SamplingParams.n) than max_num_seqs. Changes nothing."""
    if num_prompt_tokens == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if num_prompt_tokens > scheduler.max_model_len:
        raise ValueError(f"the prompt has {num_prompt_tokens} tokens, more than "
                         f"max_model_len={scheduler.max_model_len}")
    kv = scheduler.kv_cache_manager
    needed = blocks_for_tokens(num_prompt_tokens + 1, kv.block_size)
    if needed > kv.num_blocks:
        raise ValueError(f"the prompt has {num_prompt_tokens} tokens and needs {needed} KV "
                         f"blocks, more than the whole KV pool: the whole pool is "
                         f"{kv.num_blocks} blocks of {kv.block_size} tokens; give it more "
                         "memory (kv_cache_memory_bytes / num_gpu_blocks_override)")
    if num_seats > scheduler.max_num_seqs:
        raise ValueError(f"SamplingParams.n={num_seats} is more than max_num_seqs="
                         f"{scheduler.max_num_seqs} batch seats")


def check_scheduler_args(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                         long_prefill_token_threshold: int, preemption_mode: str,
                         host_pool) -> None:
    """Raise ValueError naming the first of a scheduler's limits that could never work."""
    for name, value in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an integer >= 1")
    if not isinstance(long_prefill_token_threshold, int) or long_prefill_token_threshold < 0:
        raise ValueError(f"long_prefill_token_threshold={long_prefill_token_threshold!r}: "
                         "must be an integer >= 0")
    if preemption_mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode={preemption_mode!r}: choose one of "
                         f"{', '.join(PREEMPTION_MODES)}")
    if (preemption_mode == "swap") != (host_pool is not None):
        raise ValueError("preemption_mode='swap' needs a host_pool (and only it)")
