"""Could this request ever run? Checked before anything is queued or allocated (the
scheduler's add_sequence, the engine's validate_request). The other rule of a sequence's
length, when it stops, is stop_rules.py's.
"""

from __future__ import annotations

from refserve.capacity import blocks_for_tokens


def check_fits(num_prompt_tokens: int, num_seats: int, *, max_model_len: int,
               max_num_seqs: int, num_blocks: int, block_size: int) -> None:
    """Raise ValueError if a prompt could never run: empty, longer than max_model_len, more
    blocks than the whole pool (prompt + the first sampled token), or more seats
    (SamplingParams.n) than max_num_seqs. Changes nothing."""
    if num_prompt_tokens == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if num_prompt_tokens > max_model_len:
        raise ValueError(f"the prompt has {num_prompt_tokens} tokens, more than "
                         f"max_model_len={max_model_len}")
    needed = blocks_for_tokens(num_prompt_tokens + 1, block_size)
    if needed > num_blocks:
        raise ValueError(f"the prompt has {num_prompt_tokens} tokens and needs {needed} KV "
                         f"blocks, more than the whole KV pool: the whole pool is "
                         f"{num_blocks} blocks of {block_size} tokens; give it more "
                         "memory (kv_cache_memory_bytes / num_gpu_blocks_override)")
    if num_seats > max_num_seqs:
        raise ValueError(f"SamplingParams.n={num_seats} is more than max_num_seqs="
                         f"{max_num_seqs} batch seats")
