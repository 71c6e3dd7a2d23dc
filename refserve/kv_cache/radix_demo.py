"""The radix tree's worked example, the one WARMUP §13 prints: two sequences share a
prefix, the shared node is split, locks walk up, and eviction takes only an unlocked leaf.

    python -m refserve.kv_cache.radix_demo
"""

from __future__ import annotations

from refserve.kv_cache.block_allocator import BlockAllocator
from refserve.kv_cache.radix_cache import RadixCache


def main() -> RadixCache:
    """Run the example, printing the tree after each event; returns the final tree."""
    allocator = BlockAllocator(8)
    tree = RadixCache(block_size=2, allocator=allocator)

    # a computes [1 2 3 4 5 6] in 3 blocks, caches them and locks its node.
    a_blocks = [allocator.allocate() for _ in range(3)]
    a = tree.insert([1, 2, 3, 4, 5, 6], a_blocks)
    tree.lock(a.node)
    print("a cached [1 2 3 4 5 6]:\n" + str(tree))

    # b = [1 2 3 4 9 9 7] hits a's first 2 blocks (the node is split there), attaches them,
    # computes [9 9] in a block of its own and caches it: the tree branches.
    b_tokens = [1, 2, 3, 4, 9, 9, 7]
    hit = tree.match_prefix(b_tokens)
    for block_id in hit.block_ids:
        allocator.incref(block_id)
    tree.lock(hit.node)
    b_blocks = hit.block_ids + [allocator.allocate()]
    b = tree.insert(b_tokens[:6], b_blocks)
    tree.lock(b.node)
    tree.unlock(hit.node)
    print(f"\nb = {b_tokens} hit {hit.num_tokens} tokens {hit.block_ids}, then cached its "
          f"own block ({b.num_cached_tokens} of its 6 tokens were cached already):\n"
          + str(tree))

    for block_id in a_blocks:
        allocator.decref(block_id)
    tree.unlock(a.node)
    print("\na retired: its own block stays cached, now evictable:\n" + str(tree))
    print(f"\nevict(2) frees {tree.evict(2)}: only the unlocked leaf can go, so 1 block:\n"
          + str(tree))
    tree.check_invariants()
    return tree


if __name__ == "__main__":
    main()
