"""prefix_caching_policy="radix": the radix tree behind the KVCacheManager's interface.

The KV-cache manager offers one interface to the scheduler (get_computed_blocks,
can_allocate, allocate_slots, cache_full_blocks, fork, trim, release) and the same metrics
(hit rate in tokens, evictions) whichever policy finds the hits. With "hash" it asks the hash
chain (prefix_cache.py); with "radix" it asks this class, which runs the holder's protocol of
radix_cache.py for every sequence:

    lookup      tree.match_prefix(tokens): the hit blocks (block-aligned, never the last
                token), one walk from the root
    attach      incref each hit block, lock the node the hit ends at (its path is
                protected from eviction while the sequence holds it)
    cache       after the step, insert the sequence's full computed blocks; the lock moves
                down to the node that ends them. A block that duplicates one the tree
                already holds (the same prefix computed twice: two sequences admitted
                together, or a last prompt token recomputed) is swapped for the tree's in
                the sequence's table and freed at once, as SGLang does: the KV is the same,
                and the sequence then holds exactly the path it locks.
    release     decref each block (head of the free queue: uncached blocks hold nothing
                reusable, and a cached block is still held by the tree), unlock its node
    take_block  a free block if there is one, else evict one block of the least recently
                used unlocked leaf (radix_cache.py: RadixCache.evict)

Reference counts differ from the hash chain in one way: the tree holds one reference on
each block it caches (radix_cache.py), so an evictable block has ref count 1, not 0, and is
not in the allocator's available queue. The manager's three words keep their meaning:

    held       some block table holds it   = allocator-held blocks - tree-only blocks
    evictable  cached, no table holds it   = the tree's unlocked blocks
    free       ref count 0                 = the allocator's available queue

Invariant (checked with the manager's): every cached block a table holds lies on that
sequence's locked path, so the tree's unlocked blocks are exactly the cached blocks no
table holds.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from refserve.kv_cache.block_allocator import BlockAllocator
from refserve.kv_cache.radix_cache import RadixCache, RadixNode


class RadixPolicy:
    """One RadixCache plus, per sequence holding blocks, the node it locked and how many
    of its leading blocks it has inserted (see the module docstring)."""

    def __init__(self, block_size: int, allocator: BlockAllocator) -> None:
        self.block_size = block_size
        self.allocator = allocator
        self.tree = RadixCache(block_size, allocator)
        self._locked: dict[int, RadixNode] = {}  # seq_id -> the node it holds locked
        self._num_inserted: dict[int, int] = {}  # seq_id -> leading blocks inserted

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_evictable_blocks(self) -> int:
        return self.tree.num_evictable_blocks

    @property
    def num_held_blocks(self) -> int:
        """Blocks some table holds: the tree's own reference on an evictable block does
        not count."""
        return self.allocator.num_held_blocks - self.tree.num_evictable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_available_blocks

    def num_inserted(self, seq_id: int) -> int:
        return self._num_inserted.get(seq_id, 0)

    def lookup(self, token_ids: SequenceOf[int]) -> list[int]:
        """The hit blocks of a sequence about to be admitted (match_prefix: splits the node
        the match ends inside and marks the path used; takes no reference)."""
        return self.tree.match_prefix(token_ids).block_ids

    def match_length(self, token_ids: SequenceOf[int]) -> int:
        """Tokens a lookup would hit, changing nothing (what scheduling_policy="lpm" sorts
        by)."""
        return self.tree.match_length(token_ids)

    def revive_cost(self, blocks: SequenceOf[int]) -> int:
        """Blocks attaching these hit blocks takes out of the available ones: those still
        evictable (on unlocked nodes of the path)."""
        return self.tree.evictable_on_path(self.tree.node_of(blocks[-1])) if blocks else 0

    def still_cached(self, token_ids: SequenceOf[int], blocks: SequenceOf[int]) -> bool:
        """Whether `blocks` are still the tree's path for token_ids' first blocks (an
        allocation since the lookup may have evicted and reused one of them)."""
        if not blocks:
            return True
        node = self.tree.node_of(blocks[-1])
        if node is None or node.blocks[-1] != blocks[-1]:
            return False
        if self.tree.path_blocks(node) != list(blocks):
            return False
        keys, n = [], node
        while n is not self.tree.root:
            keys.append(n.key)
            n = n.parent
        tokens = tuple(t for key in reversed(keys) for t in key)
        return tokens == tuple(token_ids[:len(tokens)])

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        """Cached block -> the tokens it holds, for tests and debugging."""
        bs = self.block_size
        return {block: node.key[i * bs:(i + 1) * bs]
                for node in self.tree.nodes() for i, block in enumerate(node.blocks)}

    # ---- the holder's protocol -----------------------------------------------------------

    def attach(self, seq_id: int, blocks: SequenceOf[int]) -> None:
        """A sequence's first allocation: take a reference on each hit block and lock the
        node they end at (the root when there is no hit: a no-op lock)."""
        node = self.tree.node_of(blocks[-1]) if blocks else self.tree.root
        for block_id in blocks:
            self.allocator.incref(block_id)
        self.tree.lock(node)
        self._locked[seq_id] = node
        self._num_inserted[seq_id] = len(blocks)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares the parent's blocks (the manager increfs them), so it takes its
        own lock on the parent's node."""
        node = self._locked[parent_id]
        self.tree.lock(node)
        self._locked[child_id] = node
        self._num_inserted[child_id] = self._num_inserted[parent_id]

    def cache_full_blocks(self, seq_id: int, token_ids: SequenceOf[int],
                          block_ids: SequenceOf[int], num_full: int) -> list[tuple[int, int]]:
        """Insert the sequence's first num_full blocks (full and computed) if some are new
        since its last insert, and move its lock down to the node that ends them.

        Returns the (logical block, tree block) pairs where the sequence's block duplicates
        the tree's: the caller puts the tree's block in the table (this method took the
        reference) and drops its own (decref_duplicate)."""
        if num_full <= self._num_inserted[seq_id]:
            return []
        block_ids = list(block_ids)  # a BlockTable, or any sequence: sliced below
        done = self.tree.insert(token_ids[:num_full * self.block_size], block_ids[:num_full])
        self.tree.lock(done.node)
        self.tree.unlock(self._locked[seq_id])
        self._locked[seq_id] = done.node
        self._num_inserted[seq_id] = num_full
        swaps = [(i, tree_block) for i, tree_block in enumerate(done.block_ids)
                 if block_ids[i] != tree_block]
        for _, tree_block in swaps:
            self.allocator.incref(tree_block)  # locked by this sequence: protected already
        return swaps

    def trim(self, seq_id: int, keep: int, dropped: SequenceOf[int]) -> None:
        """The sequence keeps only its first `keep` blocks (speculative rollback); the
        manager then decrefs `dropped`. Inserted blocks hold computed positions only, which
        a trim keeps: none of `dropped` is in the tree, and nothing is to undo."""
        for block_id in dropped:
            assert not self.tree.is_cached(block_id), \
                f"block {block_id} is cached but holds no computed position of {seq_id}"

    def release(self, seq_id: int, block_ids: SequenceOf[int]) -> None:
        """The sequence lets go: one reference per block (tail first), then its lock."""
        for block_id in reversed(block_ids):
            self.allocator.decref(block_id, to_front=True)
        self.tree.unlock(self._locked.pop(seq_id))
        del self._num_inserted[seq_id]

    def take_block(self) -> tuple[int, bool]:
        """A block for a new or copied position: (block id, whether a cached block was
        evicted for it). Free blocks go first; eviction only when none is left."""
        evicted = False
        if self.allocator.num_available_blocks == 0:
            evicted = bool(self.tree.evict(1))
        return self.allocator.allocate(), evicted

    # ---- checks --------------------------------------------------------------------------

    def check_invariants(self, holders: SequenceOf[int]) -> None:
        """holders[b] = block tables holding b. Checks the tree, ref count = holders + the
        tree's one, and that the unlocked blocks are the cached ones no table holds."""
        self.tree.check_invariants()
        cached = self.cached_blocks()
        for block_id, count in enumerate(holders):
            expected = count + (block_id in cached)
            if self.allocator.ref_count(block_id) != expected:
                raise AssertionError(
                    f"block {block_id}: ref count {self.allocator.ref_count(block_id)}, but "
                    f"{count} block tables{' + the tree' if block_id in cached else ''}")
        unheld = sum(1 for block_id in cached if holders[block_id] == 0)
        if unheld != self.tree.num_evictable_blocks:
            raise AssertionError(f"{unheld} cached blocks no table holds, but the tree "
                                 f"counts {self.tree.num_evictable_blocks} evictable")
        if set(self._locked) != set(self._num_inserted):
            raise AssertionError("locked nodes and insert counts name different sequences")
