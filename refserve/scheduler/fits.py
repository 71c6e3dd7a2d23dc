"""The two rules of a sequence's length, one place each:

    check_fits     could this request ever run? Checked before anything is queued or
                   allocated (the scheduler's add_sequence, the engine's validate_request).
    append_tokens  the stop rules, applied as sampled tokens are appended (update()).
"""

from __future__ import annotations

from refserve.capacity import blocks_for_tokens
from refserve.sequence import Sequence, SequenceStatus


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


def append_tokens(seq: Sequence, token_ids: list[int], eos_token_id: int | None,
                  max_model_len: int) -> SequenceStatus | None:
    """Append sampled tokens until one of them finishes the sequence; returns the finish
    status, or None if it runs on.

    Stop rules, checked after each token (a stop token wins over a length limit):
      FINISHED_STOPPED  the token is in stop_token_ids, or is eos and not ignore_eos
      FINISHED_LENGTH   num_output_tokens >= max_tokens (None: max_model_len) or
                        num_tokens >= max_model_len
    """
    params = seq.sampling_params
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
    for token_id in token_ids:
        seq.append_token(token_id)
        if token_id in params.stop_token_ids or (
                token_id == eos_token_id and not params.ignore_eos):
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= max_tokens or seq.num_tokens >= max_model_len:
            return SequenceStatus.FINISHED_LENGTH
    return None
