"""The prefix cache: find blocks whose KV was already computed for the same prefix.

Two requests that start with the same tokens (a system prompt, a few-shot header, the
previous turns of a chat) compute the same keys and values for that prefix, because K/V of a
token depend only on the tokens up to it. So a *full* block can be identified by everything
up to and including its tokens, via a hash chain:

    key(block 0) = hash((None,        tokens of block 0))
    key(block i) = hash((key(i - 1),  tokens of block i))

Equal keys mean equal prefixes, so a new sequence walks its blocks from the start and reuses
every block found under its key (a "prefix cache hit"), stopping at the first miss. Only full
blocks are keyed: a partly filled block will still change.

Collision guard. A Python hash is 64 bits; two different prefixes can collide. We do not
trust the hash alone: a `BlockKey` carries its tokens and its parent key, and two keys are
equal only if their whole chains hold the same tokens (the hash is just the fast path of the
dict lookup). This makes the cache collision-free: a collision costs a longer comparison,
never a wrong hit. The comparison stops as soon as both chains reach the same parent object,
which is the common case, because a sequence builds each key on top of the key object
stored in the cache.

Lifetime and eviction (least recently used). A cached block is *held* while some block
table holds it, and *evictable* once its ref count drops to 0: it then sits in the
allocator's available queue but stays findable here, so a later hit can revive it. Only
when the allocator hands the block out again (from the head of the available queue) does
the KVCacheManager call `evict`, dropping it from the cache. Released cached blocks join the
available queue at the tail, so the block evicted first is the one released longest ago:
LRU. A sequence releases its blocks tail-first, so its deepest block (the least reusable:
only a prefix that long can hit it) is evicted before the shallower ones.
"""

from __future__ import annotations


def hash_block(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """The chained hash: hash((key of the previous block, tokens of this block)).

    Python's hash of ints and tuples of ints is deterministic across runs. Tests replace this
    function with a constant to show that collisions cannot produce a wrong hit.
    """
    return hash((parent_hash, tokens))


class BlockKey:
    """The identity of a full block: its tokens plus the key of the block before it.

    `value` is the chained hash; equality compares the full token chain (see the module
    docstring: collision-free). Immutable.
    """

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
        # Walk both chains towards block 0. A loop, not recursion: chains can be thousands
        # of blocks long. Identical objects below this point are equal, so stop there.
        while a is not b:
            if a is None or b is None:
                return False  # different depths
            if a.value != b.value or a.tokens != b.tokens:
                return False
            a, b = a.parent, b.parent
        return True

    def __repr__(self) -> str:
        return f"BlockKey({self.value:#x}, tokens={self.tokens})"


class PrefixCache:
    """BlockKey <-> physical block id, for full blocks whose KV has been written.

    Invariants: the two maps are inverse to each other; a physical block is cached under at
    most one key, and a key names at most one block (if two sequences computed the same
    block independently, the first one cached is kept and the other block stays uncached).
    """

    def __init__(self) -> None:
        self._block_of_key: dict[BlockKey, int] = {}
        self._key_of_block: dict[int, BlockKey] = {}

    def lookup(self, key: BlockKey) -> int | None:
        """The physical block cached under `key`, or None (a miss). Changes nothing."""
        return self._block_of_key.get(key)

    def key_of(self, block_id: int) -> BlockKey | None:
        """The key a block is cached under, or None if it is not cached."""
        return self._key_of_block.get(block_id)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._key_of_block

    def insert(self, key: BlockKey, block_id: int) -> BlockKey:
        """Cache `block_id` under `key` unless that key or that block is already cached.

        Returns the key object now stored for these tokens (the existing one if the prefix
        was already cached), so that callers can chain their next key on top of it.
        """
        existing = self._block_of_key.get(key)
        if existing is not None:
            return self._key_of_block[existing]
        if block_id in self._key_of_block:
            # The block is already cached under another key: it would mean the block holds
            # two different prefixes, which the manager never lets happen.
            raise ValueError(f"block {block_id} is already cached under another key")
        self._block_of_key[key] = block_id
        self._key_of_block[block_id] = key
        return key

    def evict(self, block_id: int) -> bool:
        """Forget `block_id` (its KV is about to be overwritten). Returns True if it was
        cached."""
        key = self._key_of_block.pop(block_id, None)
        if key is None:
            return False
        del self._block_of_key[key]
        return True

    def cached_blocks(self) -> dict[int, BlockKey]:
        """A copy of block id -> key, for tests and debugging."""
        return dict(self._key_of_block)

    def check_invariants(self) -> None:
        if len(self._block_of_key) != len(self._key_of_block):
            raise AssertionError("prefix cache maps have different sizes")
        for key, block_id in self._block_of_key.items():
            if self._key_of_block.get(block_id) is not key:
                raise AssertionError(f"block {block_id}: key maps are not inverse")

    def __len__(self) -> int:
        return len(self._key_of_block)

    def __repr__(self) -> str:
        blocks = {b: k.tokens for b, k in self._key_of_block.items()}
        return f"PrefixCache({blocks})"


if __name__ == "__main__":
    cache = PrefixCache()
    k0 = BlockKey(None, (1, 2, 3, 4))
    k1 = BlockKey(k0, (5, 6, 7, 8))
    cache.insert(k0, 10)
    cache.insert(k1, 11)
    print(cache)
    # Same tokens at a different depth are a different block:
    print("lookup (5,6,7,8) as block 0 ->", cache.lookup(BlockKey(None, (5, 6, 7, 8))))
    print("lookup chain 1,2,3,4 | 5,6,7,8 ->",
          cache.lookup(BlockKey(BlockKey(None, (1, 2, 3, 4)), (5, 6, 7, 8))))
    cache.evict(11)
    print("after evict(11):", cache)
