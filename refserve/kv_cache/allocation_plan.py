"""The allocation plan: what `KVCacheManager.allocate_slots` would do, computed without
doing it, so that `can_allocate` and `allocate_slots` share one rule and an allocation is
atomic (it checks the whole plan against the available blocks before changing anything).

For a sequence asking for `num_new_tokens` more positions (bs = block_size):

    attach  = computed_blocks on the sequence's first call (prefix-cache hits), else []
    start   = seq.num_computed_tokens + len(attach) * bs      first position written
    end     = start + num_new_tokens
    new     = max(0, ceil(end / bs) - blocks held)            fresh blocks appended
    cow     = logical blocks in [start // bs, ceil(end / bs)) already held and shared
              (ref count > 1): each is written, so each needs a private copy first
    needed  = revived + new + len(cow)

where `revived` counts the hit blocks that are evictable now: they are counted in the
manager's available blocks, so attaching them takes them out (policy.revive_cost).

Invariant: allocate_slots succeeds exactly when needed <= manager.num_available_blocks.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING, NamedTuple

from refserve.capacity import blocks_for_tokens

if TYPE_CHECKING:
    from refserve.kv_cache.block_allocator import BlockAllocator
    from refserve.kv_cache.block_table import BlockTable
    from refserve.kv_cache.hash_policy import HashPolicy
    from refserve.kv_cache.radix_policy import RadixPolicy
    from refserve.sequence import Sequence


class AllocationPlan(NamedTuple):
    attach: list[int]  # hit blocks to attach (first call only)
    start: int         # first position written
    end: int           # one past the last position written
    cow: list[int]     # logical blocks needing a copy-on-write
    needed: int        # available blocks the plan takes


def plan_allocation(seq: Sequence, num_new_tokens: int, computed_blocks: SequenceOf[int],
                    table: BlockTable | None, block_size: int, allocator: BlockAllocator,
                    policy: HashPolicy | RadixPolicy) -> AllocationPlan:
    """The plan for allocate_slots(seq, num_new_tokens, computed_blocks), `table` being the
    sequence's block table (None before its first allocation). Raises ValueError on a bad
    argument or on computed_blocks that are no longer the cache's hits."""
    if seq.seq_id is None:
        raise ValueError(f"{seq} has no seq_id: queue it with Scheduler.add_sequence, or "
                         "give Sequence(..., seq_id=...) when using the manager alone")
    if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
        raise ValueError(f"num_new_tokens={num_new_tokens!r}: must be an integer >= 0")
    if table is None:
        attach = list(computed_blocks)
        if attach:
            check_computed_blocks(seq, attach, block_size, policy)
        held = attach
    else:
        attach = []  # computed blocks are attached on the first call only
        held = table  # len() and [i] only: no copy of a long table, twice a step
    start = seq.num_computed_tokens + len(attach) * block_size
    end = start + num_new_tokens
    blocks_after = blocks_for_tokens(end, block_size)
    num_new_blocks = max(0, blocks_after - len(held))

    # Existing blocks that positions [start, end) write into and someone else also holds:
    # each needs a private copy first. (New blocks are private already.)
    written = range(start // block_size, blocks_after) if end > start else range(0)
    cow = [logical for logical in written
           if logical < len(held) and allocator.ref_count(held[logical]) > 1]
    needed = policy.revive_cost(attach) + num_new_blocks + len(cow)
    return AllocationPlan(attach, start, end, cow, needed)


def check_computed_blocks(seq: Sequence, blocks: list[int], block_size: int,
                          policy: HashPolicy | RadixPolicy) -> None:
    """computed_blocks must still be what get_computed_blocks found: another sequence's
    allocation in between may have evicted and reused one of them."""
    if seq.num_computed_tokens != 0:
        raise ValueError(
            f"sequence {seq.seq_id}: computed_blocks given but num_computed_tokens is "
            f"{seq.num_computed_tokens}, not 0")
    if len(blocks) * block_size > max(0, seq.num_tokens - 1):
        raise ValueError(f"sequence {seq.seq_id}: computed_blocks cover the last token")
    if not policy.still_cached(seq.token_ids, blocks):
        raise ValueError(
            f"sequence {seq.seq_id}: computed blocks {blocks} are no longer cached for these "
            "tokens; call get_computed_blocks again right before allocate_slots")
