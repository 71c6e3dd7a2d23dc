"""prefix_caching_policy="hash" (the default): the hash chain behind the KVCacheManager's
interface.

The manager asks its policy the same questions whichever finds the hits; this class answers
them with the `PrefixCache` hash chain (prefix_cache.py, vLLM's scheme), radix_policy.py with
the radix tree. It is also the policy when prefix caching is disabled: nothing is ever
inserted then, so the cache stays empty and every block is plain held or free.

    lookup      chained keys of seq's leading full blocks, to the first miss (never the
                block holding the last token)
    attach      incref each hit block; a hit on an evictable block (ref count 0) revives it
    cache       after the step, key each newly full, computed block on its predecessor's
                key; a block already cached (shared with a sibling) keeps its key, and a
                prefix cached in another block keeps that one (insert is first-wins)
    release     decref each block, tail first; a cached block goes to the tail of the
                available queue (evicted last, LRU), an uncached one to the head
    take_block  the head of the available queue; if it was cached, evict it there

Counts. Cached blocks with ref count 0 are evictable: in the allocator's available queue,
but still findable. So

    held       = the allocator's held blocks (ref count > 0)
    evictable  = counted exactly in O(1): +1 when release drops a cached block to ref
                 count 0, -1 when attach revives one or take_block evicts one
    free       = available - evictable

Per sequence it keeps the keys of its leading full blocks hashed so far (len = blocks
hashed): the next key chains on the last one, so hashing a sequence is O(new blocks).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from refserve.kv_cache.block_allocator import BlockAllocator
from refserve.kv_cache.prefix_cache import BlockKey, PrefixCache


class HashPolicy:
    """One PrefixCache plus, per sequence holding blocks, the keys of its hashed blocks
    (see the module docstring)."""

    def __init__(self, block_size: int, allocator: BlockAllocator,
                 prefix_cache: PrefixCache) -> None:
        self.block_size = block_size
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self._keys: dict[int, list[BlockKey]] = {}  # seq_id -> keys of its hashed blocks
        self._num_evictable = 0  # available blocks that are cached (kept exact, O(1))

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable

    @property
    def num_held_blocks(self) -> int:
        return self.allocator.num_held_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_available_blocks - self._num_evictable

    def num_inserted(self, seq_id: int) -> int:
        return len(self._keys.get(seq_id, ()))

    def lookup(self, token_ids: SequenceOf[int]) -> list[int]:
        """The hit blocks of a sequence about to be admitted; touches nothing."""
        # BEGIN EXERCISE prefix_cache_lookup: chained keys of full blocks to the first miss
        bs = self.block_size
        max_hit_blocks = max(0, len(token_ids) - 1) // bs
        blocks: list[int] = []
        parent: BlockKey | None = None
        for i in range(max_hit_blocks):
            key = BlockKey(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            block_id = self.prefix_cache.lookup(key)
            if block_id is None:
                break
            blocks.append(block_id)
            # Chain on the stored key object: later equality checks stop at it at once.
            parent = self.prefix_cache.key_of(block_id)
        return blocks
        # END EXERCISE

    def match_length(self, token_ids: SequenceOf[int]) -> int:
        """Tokens a lookup would hit, changing nothing."""
        return len(self.lookup(token_ids)) * self.block_size

    def revive_cost(self, blocks: SequenceOf[int]) -> int:
        """Blocks attaching these hit blocks takes out of the available ones: those with
        ref count 0 (evictable)."""
        return sum(1 for block_id in blocks if self.allocator.ref_count(block_id) == 0)

    def still_cached(self, token_ids: SequenceOf[int], blocks: SequenceOf[int]) -> bool:
        """Whether `blocks` are still cached under token_ids' first blocks' chained keys (an
        allocation since the lookup may have evicted and reused one of them)."""
        bs = self.block_size
        parent = None
        for i, block_id in enumerate(blocks):
            key = self.prefix_cache.key_of(block_id)
            if (key is None or key.parent != parent
                    or key.tokens != tuple(token_ids[i * bs:(i + 1) * bs])):
                return False
            parent = key
        return True

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        """Cached block (held or evictable) -> the tokens whose KV it holds."""
        return {block: key.tokens for block, key in self.prefix_cache.cached_blocks().items()}

    # ---- the holder's protocol -----------------------------------------------------------

    def attach(self, seq_id: int, blocks: SequenceOf[int]) -> None:
        """A sequence's first allocation (or a swap-in, with no blocks): take a reference
        on each hit block; their keys are its first hashed blocks."""
        keys = self._keys[seq_id] = []
        for block_id in blocks:
            if self.allocator.ref_count(block_id) == 0:
                self._num_evictable -= 1  # revived: evictable -> held
            self.allocator.incref(block_id)
            keys.append(self.prefix_cache.key_of(block_id))

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares the parent's blocks (the manager increfs them) and so its keys."""
        self._keys[child_id] = list(self._keys[parent_id])

    def cache_full_blocks(self, seq_id: int, token_ids: SequenceOf[int],
                          block_ids: SequenceOf[int], num_full: int) -> list[tuple[int, int]]:
        """Key the sequence's blocks [hashed so far, num_full) (full and computed). Returns
        no swaps: a duplicate prefix keeps its own block here (the radix policy swaps)."""
        keys = self._keys[seq_id]
        bs = self.block_size
        for i in range(len(keys), num_full):
            parent = keys[-1] if keys else None
            key = BlockKey(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            block_id = block_ids[i]
            existing = self.prefix_cache.key_of(block_id)
            if existing is not None:
                # Already cached (a block shared with a sibling that hashed it first).
                keys.append(existing)
            else:
                # If another block already holds this prefix, insert keeps that one.
                keys.append(self.prefix_cache.insert(key, block_id))
        return []

    def trim(self, seq_id: int, keep: int, dropped: SequenceOf[int]) -> None:
        """The sequence keeps only its first `keep` blocks (speculative rollback); the
        manager then decrefs `dropped`. Hashed blocks hold computed positions only, which a
        trim keeps, so a dropped block is cached only if a sibling sharing it hashed it."""
        for block_id in dropped:
            assert (self.allocator.ref_count(block_id) > 1
                    or not self.prefix_cache.is_cached(block_id)), \
                f"block {block_id} is cached but holds no computed position of {seq_id}"
        del self._keys[seq_id][keep:]

    def release(self, seq_id: int, block_ids: SequenceOf[int]) -> None:
        """The sequence lets go: one reference per block, tail first (its deepest cached
        block is then evicted before its shallower ones)."""
        self._keys.pop(seq_id, None)
        for block_id in reversed(block_ids):
            cached = self.prefix_cache.is_cached(block_id)
            if self.allocator.decref(block_id, to_front=not cached) and cached:
                self._num_evictable += 1  # held -> evictable

    def take_block(self) -> tuple[int, bool]:
        """A block for a new or copied position: (block id, whether a cached block was
        evicted for it). The head of the available queue: uncached blocks were put there,
        so they go before any cached one, and cached ones leave least recently released
        first."""
        block_id = self.allocator.allocate()
        if not self.prefix_cache.is_cached(block_id):
            return block_id, False
        self.prefix_cache.evict(block_id)
        self._num_evictable -= 1
        return block_id, True

    # ---- checks --------------------------------------------------------------------------

    def check_invariants(self, holders: SequenceOf[int]) -> None:
        """holders[b] = block tables holding b. Checks the hash chain, ref count == holders,
        and that the evictable count is exact."""
        self.prefix_cache.check_invariants()
        for block_id, count in enumerate(holders):
            if self.allocator.ref_count(block_id) != count:
                raise AssertionError(
                    f"block {block_id}: ref count {self.allocator.ref_count(block_id)} but "
                    f"held by {count} block tables")
        evictable = sum(1 for b in self.allocator.available_block_ids()
                        if self.prefix_cache.is_cached(b))
        if evictable != self._num_evictable:
            raise AssertionError(f"{evictable} evictable blocks, but counted "
                                 f"{self._num_evictable}")
