"""Prefix caching: find blocks whose KV was already computed for the same prefix.

Two requests that start with the same tokens (a system prompt, a few-shot header, the previous
turns of a chat) compute the same keys and values for that prefix, because the K/V of a token
depend only on the tokens up to it. A prefix cache remembers which full, computed blocks hold
which prefix, so a new sequence reuses them instead of computing them again (a "prefix cache
hit"). Only full blocks are ever cached: a partly filled block will still change.

One interface, `PrefixCache`, asked only by the KVCacheManager; its implementations:

    PrefixCache      this base class: caches nothing (enable_prefix_caching=False)
    HashChainCache   prefix_caching_policy="hash" (vLLM's), hash_chain.py
    RadixCache       prefix_caching_policy="radix" (SGLang's), radix_cache.py

The holder's protocol, the same for every implementation:

    lookup(tokens)        the hit blocks, to the first miss (never the block holding the
                          last token: its logits must be computed)
    attach(seq, hits)     a sequence takes a reference on its hit blocks (revives them)
    cache_full_blocks     after a step, newly full computed blocks become findable
    release(seq, blocks)  the sequence lets go, tail first
    take_block()          a block for new KV; when only cached ones are left, evict one

The pool, in three words (one meaning each):
    held       some block table holds it
    evictable  no table holds it, but its KV is still cached: a hit revives it
    free       no table holds it and nothing reusable is in it
    held + evictable + free == num_blocks; an allocation may take evictable + free blocks.

The hash chain (vLLM's) is hash_chain.py; the radix tree (SGLang's) is radix_cache.py.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from refserve.kv_cache import kv_checks
from refserve.kv_cache.block_allocator import BlockAllocator
from refserve.kv_cache.block_table import check_block_size


class PrefixCache:
    """The prefix cache interface (see the module docstring); this base caches nothing, so
    every block is plain held or free."""

    def __init__(self, block_size: int, allocator: BlockAllocator) -> None:
        check_block_size(block_size)
        self.block_size = block_size
        self.allocator = allocator

    # ---- counts --------------------------------------------------------------------------

    @property
    def num_evictable_blocks(self) -> int:
        return 0

    @property
    def num_free_blocks(self) -> int:
        """Nothing is cached: every available block is free. (Held blocks are what the
        other two leave: the manager counts them.)"""
        return self.allocator.num_available_blocks

    def __len__(self) -> int:
        """Cached blocks, held or evictable."""
        return 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self)

    def is_cached(self, block_id: int) -> bool:
        return False

    def num_cached_blocks_of(self, seq_id: int) -> int:
        """Leading blocks of the sequence that are cached (its attached hits, then the
        blocks cache_full_blocks made findable)."""
        return 0

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        """Every cached block (held or evictable) -> the tokens whose KV it holds."""
        return {}

    # ---- lookups (change nothing a holder can see) ----------------------------------------

    def lookup(self, token_ids: SequenceOf[int]) -> list[int]:
        """The hit blocks of a sequence about to be admitted, in order."""
        return []

    def match_length(self, token_ids: SequenceOf[int]) -> int:
        """Tokens a lookup would hit now (what scheduling_policy="lpm" sorts by)."""
        return 0

    def revive_cost(self, blocks: SequenceOf[int]) -> int:
        """Available blocks that attaching these hits takes: the evictable ones."""
        return 0

    def still_cached(self, token_ids: SequenceOf[int], blocks: SequenceOf[int]) -> bool:
        """Whether `blocks` are still the hits for token_ids (an allocation since the lookup
        may have evicted and reused one of them)."""
        return not blocks

    # ---- the holder's protocol ------------------------------------------------------------

    def attach(self, seq_id: int, blocks: SequenceOf[int]) -> None:
        """A sequence's first allocation (or a swap-in, with no hits): take a reference on
        each hit block."""
        for block_id in blocks:
            self.allocator.incref(block_id)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares the parent's blocks (the manager increfs them)."""

    def cache_full_blocks(self, seq_id: int, token_ids: SequenceOf[int],
                          block_ids: SequenceOf[int], num_full: int) -> list[tuple[int, int]]:
        """Make the sequence's first `num_full` blocks (full and computed) findable. Returns
        (logical block, cached block) pairs where the sequence's block duplicates one the
        cache already holds and the caller should swap it for the cached one (radix)."""
        return []

    def trim(self, seq_id: int, keep: int, dropped: SequenceOf[int]) -> None:
        """The sequence keeps only its first `keep` blocks (speculative rollback); the
        manager then lets go of `dropped`, which hold no computed position."""

    def release(self, seq_id: int, block_ids: SequenceOf[int]) -> None:
        """The sequence lets go of its blocks, tail first; worthless blocks go to the head
        of the available queue, to be reused first."""
        for block_id in reversed(block_ids):
            self.allocator.decref(block_id, to_front=True)

    def take_block(self) -> tuple[int, bool]:
        """A block for new KV, and whether a cached block was evicted for it."""
        return self.allocator.allocate(), False

    def check_invariants(self, holders: SequenceOf[int]) -> None:
        """holders[b] = block tables holding b; raise AssertionError on a disagreement
        (kv_checks.py)."""
        kv_checks.check_ref_counts(self, holders)
