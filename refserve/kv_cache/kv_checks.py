"""The paged KV cache's invariants checked against its state: what the tests (the Hypothesis
stateful machine above all), the notebooks and a debugging student call, never the serving
path. Each object's `check_invariants` method calls the function for it here; the radix
tree's are in radix_checks.py.

    allocator   every ref count >= 0; a block is in the available queue iff its count is 0;
                available + held == num_blocks
    hash chain  every ref count == the block tables holding the block; the key -> block and
                block -> key maps are inverse; the evictable count is the cached blocks in
                the available queue
    manager     no table holds a block twice; a sequence has no more cached blocks than
                blocks; nothing is cached with prefix caching off; the recorded peak is a
                peak; and the two above, with the holders counted from the tables
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf


def check_allocator(allocator) -> None:
    """Raise AssertionError if the available queue and the ref counts disagree."""
    available = allocator._available
    for block_id, count in enumerate(allocator._ref_counts):
        if count < 0:
            raise AssertionError(f"block {block_id} has negative ref count {count}")
        if (count == 0) != (block_id in available):
            raise AssertionError(
                f"block {block_id}: ref count {count} but "
                f"{'in' if block_id in available else 'not in'} the available queue")
    held = sum(1 for count in allocator._ref_counts if count > 0)
    if len(available) + held != allocator.num_blocks:
        raise AssertionError(
            f"available {len(available)} + held {held} != {allocator.num_blocks}")


def check_ref_counts(cache, holders: SequenceOf[int]) -> None:
    """holders[b] = block tables holding b: each block's ref count must equal it."""
    for block_id, count in enumerate(holders):
        if cache.allocator.ref_count(block_id) != count:
            raise AssertionError(f"block {block_id}: ref count "
                                 f"{cache.allocator.ref_count(block_id)} but held by "
                                 f"{count} block tables")


def check_hash_chain(cache, holders: SequenceOf[int]) -> None:
    """A HashChainCache (hash_chain.py) against its allocator and the holders."""
    check_ref_counts(cache, holders)
    if len(cache._block_of_key) != len(cache._key_of_block) or any(
            cache._key_of_block.get(b) is not k for k, b in cache._block_of_key.items()):
        raise AssertionError("the hash chain's key and block maps are not inverse")
    evictable = sum(1 for b in cache.allocator.available_block_ids() if cache.is_cached(b))
    if evictable != cache._num_evictable:
        raise AssertionError(f"{evictable} evictable blocks, but counted "
                             f"{cache._num_evictable}")


def check_manager(manager) -> None:
    """A KVCacheManager (kv_cache_manager.py): its allocator, tables and prefix cache."""
    manager.allocator.check_invariants()
    holders = [0] * manager.num_blocks
    for seq_id, table in manager._tables.items():
        if len(set(table.block_ids)) != len(table):
            raise AssertionError(f"sequence {seq_id} holds a block twice: {table}")
        for block_id in table:
            holders[block_id] += 1
        if manager.prefix_cache.num_cached_blocks_of(seq_id) > len(table):
            raise AssertionError(f"sequence {seq_id} has more cached blocks than blocks")
    manager.prefix_cache.check_invariants(holders)
    if not manager.enable_prefix_caching and len(manager.prefix_cache):
        raise AssertionError("prefix caching is disabled but blocks are cached")
    if manager.num_held_blocks > manager.num_held_blocks_peak:
        raise AssertionError("more blocks held than the recorded peak")
