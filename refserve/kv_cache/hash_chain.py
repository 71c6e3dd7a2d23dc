"""The hash chain: prefix_caching_policy="hash" (vLLM's), one implementation of the
`PrefixCache` interface (prefix_cache.py holds the interface and the words held /
evictable / free).

THE HASH CHAIN. A full block is named by everything up to and including its tokens:

    key(block 0) = hash((None,        tokens of block 0))
    key(block i) = hash((key(i - 1),  tokens of block i))

so equal keys mean equal prefixes. A lookup walks a sequence's blocks from the start and
reuses every block found under its key, stopping at the first miss.

Collision guard. A 64-bit hash can collide, so a `BlockKey` carries its tokens and its parent
key, and two keys are equal only if their whole chains hold the same tokens: a collision costs
a longer comparison, never a wrong hit. The comparison stops where both chains reach the same
parent object, the common case, since a sequence chains each key on the key object stored here.

Eviction (least recently used). A cached block whose ref count drops to 0 is evictable: it
joins the allocator's available queue at the TAIL but stays findable, so a hit revives it.
Uncached blocks go to the HEAD, so they are reused before any cached block is evicted; when
`take_block` pops a cached block from the head it is dropped from the cache there: the block
released longest ago goes first. A sequence releases tail first, so its deepest block (the
least reusable: only a prefix that long can hit it) is evicted before its shallower ones.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from refserve.kv_cache import kv_checks
from refserve.kv_cache.block_allocator import BlockAllocator
from refserve.kv_cache.prefix_cache import PrefixCache


def hash_block(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """The chained hash: hash((hash of the previous block's key, tokens of this block)).
    Python's hash of ints and tuples of ints is the same in every run. Tests replace this
    function with a constant to show that collisions cannot produce a wrong hit."""
    return hash((parent_hash, tokens))


class BlockKey:
    """The identity of a full block: its tokens plus the key of the block before it.
    `value` is the chained hash; equality compares the whole token chain. Immutable."""

    __slots__ = ("value", "parent", "tokens")

    def __init__(self, parent: BlockKey | None, tokens: tuple[int, ...]) -> None:
        self.parent = parent
        self.tokens = tuple(tokens)
        self.value = hash_block(None if parent is None else parent.value, self.tokens)

    def __hash__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockKey):
            return NotImplemented
        a, b = self, other
        # A loop, not recursion: chains can be thousands of blocks long.
        while a is not b:
            if a is None or b is None or a.value != b.value or a.tokens != b.tokens:
                return False
            a, b = a.parent, b.parent
        return True

    def __repr__(self) -> str:
        return f"BlockKey({self.value:#x}, tokens={self.tokens})"


class HashChainCache(PrefixCache):
    """prefix_caching_policy="hash": BlockKey <-> block id for every cached block, and per
    holding sequence the keys of its cached leading blocks (the next key chains on the last,
    so caching a sequence's blocks is O(new blocks)).

    Invariants: the two maps are inverse; a block is cached under at most one key and a key
    names at most one block (two sequences that computed the same prefix independently: the
    first one cached keeps it, the other block stays uncached); the evictable count, kept in
    O(1), equals the cached blocks in the allocator's available queue.
    """

    def __init__(self, block_size: int, allocator: BlockAllocator) -> None:
        super().__init__(block_size, allocator)
        self._block_of_key: dict[BlockKey, int] = {}
        self._key_of_block: dict[int, BlockKey] = {}
        self._keys: dict[int, list[BlockKey]] = {}  # seq_id -> keys of its cached blocks
        self._num_evictable = 0

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable

    @property
    def num_free_blocks(self) -> int:
        """The available blocks but the evictable ones, which wait in the same queue."""
        return self.allocator.num_available_blocks - self._num_evictable

    def __len__(self) -> int:
        return len(self._key_of_block)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._key_of_block

    def num_cached_blocks_of(self, seq_id: int) -> int:
        return len(self._keys.get(seq_id, ()))

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        return {block: key.tokens for block, key in self._key_of_block.items()}

    def lookup(self, token_ids: SequenceOf[int]) -> list[int]:
        # BEGIN EXERCISE prefix_cache_lookup: chained keys of full blocks to the first miss
        # ... return the hit block ids, in order (never the last token's block)
        bs = self.block_size
        max_hit_blocks = max(0, len(token_ids) - 1) // bs
        blocks: list[int] = []
        parent: BlockKey | None = None
        for i in range(max_hit_blocks):
            key = BlockKey(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            block_id = self._block_of_key.get(key)
            if block_id is None:
                break
            blocks.append(block_id)
            # Chain on the stored key object: later equality checks stop at it at once.
            parent = self._key_of_block[block_id]
        return blocks
        # END EXERCISE

    def match_length(self, token_ids: SequenceOf[int]) -> int:
        return len(self.lookup(token_ids)) * self.block_size

    def revive_cost(self, blocks: SequenceOf[int]) -> int:
        return sum(1 for block_id in blocks if self.allocator.ref_count(block_id) == 0)

    def still_cached(self, token_ids: SequenceOf[int], blocks: SequenceOf[int]) -> bool:
        bs, parent = self.block_size, None
        for i, block_id in enumerate(blocks):
            key = self._key_of_block.get(block_id)
            if (key is None or key.parent != parent
                    or key.tokens != tuple(token_ids[i * bs:(i + 1) * bs])):
                return False
            parent = key
        return True

    def attach(self, seq_id: int, blocks: SequenceOf[int]) -> None:
        """Take a reference on each hit block (an evictable one is revived); their keys are
        the sequence's first cached blocks."""
        for block_id in blocks:
            if self.allocator.ref_count(block_id) == 0:
                self._num_evictable -= 1
        super().attach(seq_id, blocks)
        self._keys[seq_id] = [self._key_of_block[block_id] for block_id in blocks]

    def fork(self, parent_id: int, child_id: int) -> None:
        self._keys[child_id] = list(self._keys[parent_id])

    def cache_full_blocks(self, seq_id: int, token_ids: SequenceOf[int],
                          block_ids: SequenceOf[int], num_full: int) -> list[tuple[int, int]]:
        """Key blocks [cached so far, num_full). A block already cached (shared with a
        sibling that cached it first) keeps its key; a prefix already cached in another
        block keeps that block, and this one stays uncached (first wins). No swaps."""
        keys = self._keys[seq_id]
        bs = self.block_size
        for i in range(len(keys), num_full):
            block_id = block_ids[i]
            key = self._key_of_block.get(block_id)
            if key is None:
                key = BlockKey(keys[-1] if keys else None,
                               tuple(token_ids[i * bs:(i + 1) * bs]))
                if key in self._block_of_key:
                    key = self._key_of_block[self._block_of_key[key]]
                else:
                    self._block_of_key[key] = block_id
                    self._key_of_block[block_id] = key
            keys.append(key)
        return []

    def trim(self, seq_id: int, keep: int, dropped: SequenceOf[int]) -> None:
        """Cached blocks hold computed positions only, which a trim keeps, so a dropped block
        is cached only if a sibling sharing it cached it."""
        for block_id in dropped:
            assert self.allocator.ref_count(block_id) > 1 or not self.is_cached(block_id), \
                f"block {block_id} is cached but holds no computed position of {seq_id}"
        del self._keys[seq_id][keep:]

    def release(self, seq_id: int, block_ids: SequenceOf[int]) -> None:
        """Tail first; a cached block goes to the TAIL of the available queue (evicted last),
        an uncached one to the head."""
        self._keys.pop(seq_id, None)
        for block_id in reversed(block_ids):
            cached = block_id in self._key_of_block
            if self.allocator.decref(block_id, to_front=not cached) and cached:
                self._num_evictable += 1

    def take_block(self) -> tuple[int, bool]:
        """The head of the available queue; if it is cached, evict it there (LRU)."""
        block_id = self.allocator.allocate()
        key = self._key_of_block.pop(block_id, None)
        if key is None:
            return block_id, False
        del self._block_of_key[key]
        self._num_evictable -= 1
        return block_id, True

    def check_invariants(self, holders: SequenceOf[int]) -> None:
        kv_checks.check_hash_chain(self, holders)

    def __repr__(self) -> str:
        return f"HashChainCache({self.cached_blocks()})"
