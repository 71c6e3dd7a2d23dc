"""The block allocator: a fixed pool of physical KV-cache blocks with reference counts.

PagedAttention splits the KV cache into `num_blocks` physical blocks of `block_size` token
slots each (see docs/architecture.md, "KV cache layout"). The allocator knows nothing about
tokens or sequences; it only hands out block ids and counts who holds them.

State
    ref_count[b]     how many block tables hold physical block b (0 = nobody).
    available queue  every block with ref_count 0, in the order they should be reused:
                     the head is taken first by `allocate`.

A block is HELD while its ref count is > 0, and AVAILABLE when it is 0; the prefix cache
splits the available ones into evictable and free (prefix_cache.py, "three words").

Invariants (checked by `check_invariants`)
    * block b is in the available queue  <=>  ref_count[b] == 0
    * len(available queue) + #{b : ref_count[b] > 0} == num_blocks

A prefix-cache hit revives an evictable block by `incref`, which has to pull it out of the
*middle* of the queue. So the available queue must support three O(1) operations:

    allocate      pop the head
    decref        at ref count 0, push to the tail (or the head: `decref(..., to_front=True)`)
    incref        remove an arbitrary block from the middle

A Python list or `collections.deque` cannot remove from the middle in O(1) (`deque.remove`
scans). We use an `OrderedDict` keyed by block id: CPython implements it as a hash table plus
a doubly linked list, so `popitem(last=False)`, insertion, `move_to_end` and `del` are all
O(1). Order in the dict = order in the queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from numbers import Integral

from refserve.kv_cache import kv_checks


class NoFreeBlocksError(RuntimeError):
    """The pool has no free block left to serve a request; nothing was changed."""


class BlockAllocator:
    """Fixed pool of physical block ids 0 .. num_blocks-1 with reference counts.

    Complexity: `allocate`, `decref`, `incref`, `ref_count` and `num_available_blocks` are
    all O(1).
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r}: must be an integer >= 1")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # Every block starts available. The value is unused; only the key order matters.
        self._available: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_available_blocks(self) -> int:
        """Blocks with ref count 0 (evictable cached ones included): what allocate can take."""
        return len(self._available)

    @property
    def num_held_blocks(self) -> int:
        """Blocks with ref count > 0."""
        return self.num_blocks - len(self._available)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def available_block_ids(self) -> Iterator[int]:
        """The available queue from head (reused first) to tail (reused last)."""
        return iter(self._available)

    # ---- mutations -----------------------------------------------------------------------

    def allocate(self) -> int:
        """Take the block at the head of the available queue; its ref count becomes 1.

        The caller must drop the block from the prefix cache if it was cached (its old KV
        is about to be overwritten): that is how least-recently-used eviction happens.
        """
        if not self._available:
            raise NoFreeBlocksError(f"all {self.num_blocks} KV-cache blocks are in use")
        block_id, _ = self._available.popitem(last=False)
        self._ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        """One more block table holds `block_id` (sharing: fork or a prefix-cache hit).

        If the block was available (a cached, evictable block being revived) it leaves the
        available queue here, in O(1), wherever it sits in the queue.
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            del self._available[block_id]
        self._ref_counts[block_id] += 1

    def decref(self, block_id: int, to_front: bool = False) -> bool:
        """One block table lets go of `block_id`. Returns True if it became available.

        When the ref count reaches 0 the block joins the available queue: at the tail by
        default (reused last, so a cached block stays findable as long as possible), or at
        the head with `to_front=True` (for blocks whose content is worthless, so they are
        reused before any cached block is evicted).
        """
        self._check_id(block_id)
        # BEGIN EXERCISE allocator_decref: refuse a decref at 0; decref; at 0 join the queue's tail
        # ... the head when to_front; return True iff the ref count reached 0
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is not held (ref count 0): a double release")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] > 0:
            return False
        self._available[block_id] = None  # appended at the tail
        if to_front:
            self._available.move_to_end(block_id, last=False)
        return True
        # END EXERCISE

    # ---- checks --------------------------------------------------------------------------

    def _check_id(self, block_id: int) -> None:
        # type() first: plain ints are the hot path, and an ABC isinstance costs ~1 us.
        if (type(block_id) is not int and not isinstance(block_id, Integral)) \
                or not 0 <= block_id < self.num_blocks:
            raise ValueError(
                f"block {block_id!r} does not exist (valid ids: 0..{self.num_blocks - 1})")

    def check_invariants(self) -> None:
        """Raise AssertionError if the available queue and the ref counts disagree
        (kv_checks.py)."""
        kv_checks.check_allocator(self)

    def __repr__(self) -> str:
        return (f"BlockAllocator(num_blocks={self.num_blocks}, "
                f"available={list(self._available)}, ref_counts={self._ref_counts})")
