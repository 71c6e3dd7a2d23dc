"""The row plan: how many tokens a sequence computes in its next row, and how many of them
need logits. Pure arithmetic over a sequence's counters, shared by ADVANCE (base.py) and
ADMIT (continuous.py, static.py); nothing here changes a sequence or the pool.

For a sequence under a step's `budget` (tokens left of max_num_batched_tokens):

    real_left   = num_tokens - num_computed_tokens - hit_tokens
                  (hit_tokens: the prefix-cache hit of a sequence's first allocation after
                  (re)admission; a held or swapped-out sequence looks nothing up)
    budget      = min(budget, long_prefill_token_threshold)   when that cap is set (> 0)
    verify      = the leading drafts that fit: drafts.drafts_that_fit(k, real_left, budget)
    num_tokens  = min(real_left, budget) + len(verify)        >= 1

A row computes positions [start, end) of token_ids + its drafts; it needs logits for the
positions at or after the last real token, once it reaches the end of token_ids + drafts:

    num_logits  = end - max(start, num_tokens_of_seq - 1)   if end == num_tokens_of_seq + k
                = 0                                          otherwise (a prefill chunk)

so 1 for a decode or the last prefill chunk, k + 1 for a verify of k drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from refserve.scheduler.drafts import drafts_that_fit

if TYPE_CHECKING:
    from refserve.kv_cache.kv_cache_manager import KVCacheManager
    from refserve.sequence import Sequence


class RowPlan(NamedTuple):
    num_tokens: int               # query tokens of the row, drafts included
    computed_blocks: list[int]    # prefix-cache hit blocks to attach (first allocation)
    verify: tuple[int, ...]       # the drafts the row verifies after its real tokens


def plan_row(seq: Sequence, budget: int, drafts: tuple[int, ...], kv: KVCacheManager, *,
             look_up: bool, long_prefill_token_threshold: int) -> RowPlan:
    """The next row of `seq` under `budget` (module docstring). `look_up`: whether this is
    the sequence's first allocation since (re)admission, so its prefix-cache hits count."""
    computed_blocks: list[int] = []
    hit_tokens = 0
    if look_up:
        computed_blocks, hit_tokens = kv.get_computed_blocks(seq)
    real_left = seq.num_tokens - seq.num_computed_tokens - hit_tokens
    if 0 < long_prefill_token_threshold < budget:
        budget = long_prefill_token_threshold  # a long prefill leaves budget over
    verify = drafts[:drafts_that_fit(len(drafts), real_left, budget)]
    num_tokens = min(real_left, budget) + len(verify)
    assert num_tokens >= 1, f"{seq} has nothing left to compute"
    return RowPlan(num_tokens, computed_blocks, verify)


def num_logits(start: int, end: int, seq_num_tokens: int, num_drafts: int) -> int:
    """Positions of the row [start, end) that need logits (module docstring)."""
    if end != seq_num_tokens + num_drafts:
        return 0
    return end - max(start, seq_num_tokens - 1)
