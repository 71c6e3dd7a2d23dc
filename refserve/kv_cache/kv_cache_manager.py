"""The KV-cache manager: the one object the scheduler asks for KV-cache space.

It owns the `BlockAllocator` (physical blocks and ref counts), one `BlockTable` per sequence
that holds blocks, and the prefix cache in use (prefix_cache.py's interface: the hash chain,
the radix tree, or nothing when prefix caching is off). The backend never sees any of this: it only
receives `slot_mapping`, `block_tables` and the copy-on-write pairs.

Who writes what. The manager only *reads* `seq.num_computed_tokens` and `seq.token_ids`; it
never writes to a Sequence. "Does this sequence hold blocks?" is `has_sequence` here, asked
by everyone, kept nowhere else.

A typical life:

    blocks, hit_tokens = manager.get_computed_blocks(seq)     # admission: cache lookup
    copies = manager.allocate_slots(seq, n, blocks)            # None: the pool is short
    ... backend.copy_blocks(copies); the forward writes K/V at positions
        [num_computed + hit_tokens, ... + n) through the block table ...
    manager.cache_full_blocks(seq)                             # after the step
    manager.release(seq)                                       # finished or preempted

One allocation, one plan (vLLM's shape: the scheduler reads "while allocate_slots(...) is
None: preempt the victim"). For a sequence asking for n more positions (bs = block_size):

    attach  = the hit blocks, on its first call only (else [])
    start   = seq.num_computed_tokens + len(attach) * bs          first position written
    end     = start + n
    new     = max(0, ceil(end / bs) - blocks held)                 fresh blocks appended
    cow     = held blocks in [start // bs, ceil(end / bs)) with ref count > 1: each is
              written, so each needs a private copy first
    needed  = revived + new + len(cow)      (revived: attached hits that are evictable now)

`allocate_slots` computes this once; if needed > available blocks it returns None and
changes nothing, else it carries the plan out and cannot fail.

Copy-on-write. Blocks are shared (ref count > 1) after `fork` (parallel sampling: children
share the prompt) and after prefix-cache hits. A shared block must never be written, or the
other holders would see the new K/V. So before a sequence writes a position in a shared
block, `allocate_slots` gives it a private block, returns the pair (src, dst) for the backend
to copy, and drops one reference from the old block. The last holder (ref count 1) writes in
place. Hit blocks are never written (writes start after them), so in practice a copy happens
for the partly filled last block of a forked sequence.

Invariants (`check_invariants`):
    * held + evictable + free == num_blocks, and the evictable count is exact
    * ref count of a block == number of block tables that hold it (+ the radix tree's own)
    * a table never holds the same block twice
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING, NamedTuple

from refserve.config import PREFIX_CACHING_POLICIES
from refserve.kv_cache import kv_checks
from refserve.kv_cache.block_allocator import BlockAllocator, NoFreeBlocksError
from refserve.kv_cache.block_table import (
    BlockTable,
    blocks_for_tokens,
    check_block_size,
    slot_mapping,
)
from refserve.kv_cache.hash_chain import HashChainCache
from refserve.kv_cache.host_pool import HostBlockPool
from refserve.kv_cache.prefix_cache import PrefixCache
from refserve.kv_cache.radix_cache import RadixCache

if TYPE_CHECKING:
    from refserve.sequence import Sequence

__all__ = ["KVCacheManager", "NoFreeBlocksError"]


class BlockCounts(NamedTuple):
    """The pool at one moment: held + evictable + free == total."""

    held: int
    evictable: int
    free: int
    total: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True,
                 prefix_caching_policy: str = "hash") -> None:
        check_block_size(block_size)
        if prefix_caching_policy not in PREFIX_CACHING_POLICIES:
            raise ValueError(f"prefix_caching_policy={prefix_caching_policy!r}: choose one "
                             f"of {', '.join(PREFIX_CACHING_POLICIES)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_caching_policy = prefix_caching_policy
        self.allocator = BlockAllocator(num_blocks)
        # Who finds the hits and evicts: the hash chain, the radix tree, or nobody. Only
        # the one in use is built.
        cache = PrefixCache
        if enable_prefix_caching:
            cache = RadixCache if prefix_caching_policy == "radix" else HashChainCache
        self.prefix_cache: PrefixCache = cache(block_size, self.allocator)
        self._tables: dict[int, BlockTable] = {}
        # Prefix-cache hit rate, counted in tokens. A sequence is counted when it gets its
        # first blocks (its admission): queried += its num_tokens, hit += tokens found in
        # the cache. A sequence preempted (recompute) and readmitted is counted again: it
        # really queries the cache again, and a hit then saves real recomputation.
        # Nothing is counted when prefix caching is disabled.
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        # The most blocks held at once, since start-up and since the last `reset_peak` (one
        # generate() call). Held blocks only grow in allocate_slots and swap_in: exact.
        self.num_held_blocks_peak = 0
        self.num_held_blocks_peak_since_reset = 0
        self.num_evictions = 0  # cached blocks whose KV was dropped to reuse the block

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_held_blocks(self) -> int:
        """Blocks some block table holds: what evictable and free blocks leave."""
        return self.num_blocks - self.num_evictable_blocks - self.num_free_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks no table holds whose KV is still cached: a prefix hit can revive them."""
        return self.prefix_cache.num_evictable_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no table holds and the cache does not need."""
        return self.prefix_cache.num_free_blocks

    def block_counts(self) -> BlockCounts:
        """The pool now, in one call (a step's summary)."""
        return BlockCounts(held=self.num_held_blocks, evictable=self.num_evictable_blocks,
                           free=self.num_free_blocks, total=self.num_blocks)

    @property
    def num_available_blocks(self) -> int:
        """What an allocation can take: free + evictable blocks."""
        return self.num_free_blocks + self.num_evictable_blocks

    @property
    def radix_tree(self):
        """The RadixCache under prefix_caching_policy="radix" (to print or draw it with
        radix_draw.draw_radix_tree); None under "hash" or with caching off."""
        return self.prefix_cache if isinstance(self.prefix_cache, RadixCache) else None

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        """Every cached block (held or evictable) -> the tokens whose KV it holds."""
        return self.prefix_cache.cached_blocks()

    def prefix_match_length(self, seq: Sequence) -> int:
        """Tokens of seq a lookup would hit now, changing nothing (what the lpm scheduling
        policy sorts by); 0 when caching is off."""
        return self.prefix_cache.match_length(seq.token_ids)

    def reset_peak(self) -> None:
        """Start a new window for `num_held_blocks_peak_since_reset`."""
        self.num_held_blocks_peak_since_reset = self.num_held_blocks

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def get_block_ids(self, seq_id: int) -> list[int]:
        """The sequence's block table (a copy): physical block id of each logical block."""
        return self._table(seq_id).block_ids

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat KV slots of positions [start, end) (block_table.slot_mapping)."""
        return slot_mapping(self._table(seq_id).block_ids, range(start, end),
                            self.block_size).tolist()

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Prefix-cache lookup for a sequence about to be admitted. Takes no block and no
        reference (the radix tree's lookup may split a node, and marks the hit path as just
        used: its LRU clock).

        Walks the leading full blocks of seq.token_ids and returns the cached ones up to the
        first miss, as (block ids, tokens they cover = len(blocks) * block_size). The block
        holding the last token is never included, even when it is full and cached: the last
        token must be computed to get the logits that sample the next token. So at most
        (num_tokens - 1) // block_size blocks hit; a prompt of exactly 3 full blocks gets at
        most 2. Returns ([], 0) when prefix caching is disabled or seq already has blocks.
        """
        if seq.seq_id in self._tables:
            return [], 0
        blocks = self.prefix_cache.lookup(seq.token_ids)
        return blocks, len(blocks) * self.block_size

    # ---- allocation ----------------------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: SequenceOf[int] = ()) -> list[tuple[int, int]] | None:
        """Give seq slots for its next `num_new_tokens` positions (the plan in the module
        docstring); `computed_blocks` (the hits of get_computed_blocks) are attached on the
        sequence's first call only.

        Returns the copy-on-write pairs (src, dst) to run with backend.copy_blocks before the
        forward, or None when the pool is short: then nothing changed. Raises ValueError on
        a bad argument or on computed_blocks that are no longer the cache's hits.
        """
        if seq.seq_id is None:
            raise ValueError(f"{seq} has no seq_id: queue it with Scheduler.add_sequence, or "
                             "give Sequence(..., seq_id=...) when using the manager alone")
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens!r}: must be an integer >= 0")
        bs = self.block_size
        table = self._tables.get(seq.seq_id)
        attach: list[int] = []
        if table is None:  # the first call: the hits become the table's first blocks
            attach = list(computed_blocks)
            self._check_computed_blocks(seq, attach)
        plan = table if table is not None else BlockTable(bs, attach)
        start = seq.num_computed_tokens + len(attach) * bs
        end = start + num_new_tokens
        new = plan.num_new_blocks(end)
        written = (range(start // bs, min(len(plan), blocks_for_tokens(end, bs))) if end > start
                   else ())
        cow = [logical for logical in written if self.allocator.ref_count(plan[logical]) > 1]
        needed = new + len(cow) + (self.prefix_cache.revive_cost(attach) if attach else 0)
        if needed and needed > self.num_available_blocks:
            return None
        # From here on nothing can fail: the plan fits in the available blocks.

        if table is None:
            table = plan
            self._tables[seq.seq_id] = table
            self.prefix_cache.attach(seq.seq_id, attach)  # increfs (radix: locks the path)
            if self.enable_prefix_caching:
                self.prefix_cache_queried_tokens += seq.num_tokens
                self.prefix_cache_hit_tokens += len(attach) * bs

        copies: list[tuple[int, int]] = []
        for logical in cow:
            # BEGIN EXERCISE copy_on_write: private block for a shared one; drop a ref; (src, dst)
            # ... table[logical] becomes the new block; append (old, new) to `copies`
            new_block = self._take_block()
            old_block = table.replace(logical, new_block)
            self.allocator.decref(old_block)  # ref count > 1: the others still hold it
            copies.append((old_block, new_block))
            # END EXERCISE

        # Writes never reach a cached block: cached blocks hold only computed positions
        # (start is past them), and `trim` refuses to un-compute a cached position.
        for _ in range(new):
            table.append(self._take_block())
        if needed:
            self._record_peak()
        return copies

    def _check_computed_blocks(self, seq: Sequence, blocks: list[int]) -> None:
        """computed_blocks must still be what get_computed_blocks found: another sequence's
        allocation in between may have evicted and reused one of them."""
        if not blocks:
            return
        if seq.num_computed_tokens != 0:
            raise ValueError(f"sequence {seq.seq_id}: computed_blocks given but "
                             f"num_computed_tokens is {seq.num_computed_tokens}, not 0")
        if len(blocks) * self.block_size > max(0, seq.num_tokens - 1):
            raise ValueError(f"sequence {seq.seq_id}: computed_blocks cover the last token")
        if not self.prefix_cache.still_cached(seq.token_ids, blocks):
            raise ValueError(
                f"sequence {seq.seq_id}: computed blocks {blocks} are no longer cached for "
                "these tokens; call get_computed_blocks again right before allocate_slots")

    def _record_peak(self) -> None:
        """After held blocks grew (allocate_slots, swap_in: the only places they do)."""
        held = self.num_held_blocks
        self.num_held_blocks_peak = max(self.num_held_blocks_peak, held)
        self.num_held_blocks_peak_since_reset = max(self.num_held_blocks_peak_since_reset,
                                                    held)

    def _take_block(self) -> int:
        """Allocate a block (the policy's choice); if a cached block had to be evicted for
        it, count the eviction. Hash: the head of the available queue, least recently
        released first; radix: a free block first, else the least recently used unlocked
        leaf's block."""
        block_id, evicted = self.prefix_cache.take_block()
        self.num_evictions += evicted
        return block_id

    # ---- sharing and release -------------------------------------------------------------

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child shares every block of the parent (ref count += 1 each). The first of
        them to write into a shared block gets a private copy (see allocate_slots)."""
        if child_seq.seq_id is None:
            raise ValueError("fork: the child has no seq_id")
        if child_seq.seq_id in self._tables:
            raise ValueError(f"sequence {child_seq.seq_id} already has blocks")
        parent_table = self._table(parent_seq.seq_id)
        for block_id in parent_table:
            self.allocator.incref(block_id)
        self._tables[child_seq.seq_id] = parent_table.copy()
        self.prefix_cache.fork(parent_seq.seq_id, child_seq.seq_id)

    def release(self, seq: Sequence) -> None:
        """Give back the sequence's blocks (finished, aborted or preempted): each loses one
        reference. No-op if it holds none.

        Tail-first: the last logical block is released first, so among this sequence's
        cached blocks the deepest one (least reusable) is nearest the head of the available
        queue and evicted first. Uncached blocks hold nothing reusable and go to the head,
        so they are reused before any cached block is evicted.
        """
        table = self._tables.pop(seq.seq_id, None)
        if table is not None:
            self.prefix_cache.release(seq.seq_id, table.block_ids)

    def swap_in(self, seq: Sequence, host_pool: HostBlockPool) -> list[tuple[int, int]]:
        """Swap preemption, resuming: give a swapped-out sequence (no device blocks) fresh
        blocks, one per host block of its host table, and return the (host, device) copies
        for backend.swap_in (run before the next forward). The new blocks are private and
        uncached: cache_full_blocks offers them to the prefix cache again (hash: an equal
        prefix already cached keeps its block; radix: duplicates are swapped for the
        tree's). Atomic: NoFreeBlocksError if the pool is short, nothing changed."""
        if seq.seq_id in self._tables:
            raise ValueError(f"swap_in: sequence {seq.seq_id} already has device blocks")
        needed = host_pool.blocks_to_swap_in([seq.seq_id])
        if needed > self.num_available_blocks:
            raise NoFreeBlocksError(f"swap_in: sequence {seq.seq_id} needs {needed} blocks, "
                                    f"only {self.num_available_blocks} are free or evictable")
        device = [self._take_block() for _ in range(needed)]
        back = host_pool.swap_in([seq.seq_id], device)
        table = BlockTable(self.block_size)
        self._tables[seq.seq_id] = table
        for block_id in back.tables[seq.seq_id]:
            table.append(block_id)
        self.prefix_cache.attach(seq.seq_id, [])
        self._record_peak()
        return back.copies

    def trim(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Speculative rollback: release the sequence's trailing blocks beyond
        blocks_for_tokens(num_tokens), tail first; returns their ids.

        After a verify step the rejected drafts' K/V slots are dead (the scheduler already
        un-computed them), and a block holding only such slots would sit unused. Rules:
          * num_tokens must be >= seq.num_computed_tokens: a block holding a computed
            position is never released;
          * a released block was never hashed (only computed full blocks are, and it holds
            no computed position), so the prefix cache never advertises rejected K/V; it
            goes to the head of the available queue, to be reused first;
          * a block shared with a sibling (ref count > 1) only loses this reference.
        """
        if num_tokens < seq.num_computed_tokens:
            raise ValueError(f"trim: sequence {seq.seq_id} has {seq.num_computed_tokens} "
                             f"computed tokens; cannot keep only {num_tokens}")
        table = self._table(seq.seq_id)
        keep = blocks_for_tokens(num_tokens, self.block_size)
        if len(table) <= keep:
            return []
        dropped = table.truncate(keep)
        self.prefix_cache.trim(seq.seq_id, keep, dropped)  # checks none of them is cached
        for block_id in reversed(dropped):  # tail first
            self.allocator.decref(block_id, to_front=True)
        return dropped

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Make the sequence's newly full, computed blocks findable by the prefix cache.

        Hashes logical blocks i with (i + 1) * block_size <= seq.num_computed_tokens not yet
        hashed: a block is cacheable only once it is full *and* its K/V have been written.
        Call it after the scheduler advanced num_computed_tokens. No-op when prefix caching
        is disabled.
        """
        if not self.enable_prefix_caching:
            return
        table = self._table(seq.seq_id)
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        # The table itself, not a copy: the hash chain reads only its new blocks.
        swaps = self.prefix_cache.cache_full_blocks(seq.seq_id, seq.token_ids, table, num_full)
        for logical, tree_block in swaps:  # radix: duplicates of the tree's KV: use the tree's
            self.allocator.decref(table.replace(logical, tree_block), to_front=True)

    # ---- checks --------------------------------------------------------------------------

    def _table(self, seq_id: int) -> BlockTable:
        table = self._tables.get(seq_id)
        if table is None:
            raise KeyError(f"sequence {seq_id} has no KV-cache blocks")
        return table

    def check_invariants(self) -> None:
        """Raise AssertionError if the allocator, the block tables and the prefix cache
        disagree (kv_checks.py)."""
        kv_checks.check_manager(self)

    def __repr__(self) -> str:
        tables = {seq_id: t.block_ids for seq_id, t in self._tables.items()}
        return (f"KVCacheManager(blocks={self.num_blocks}, block_size={self.block_size}, "
                f"held={self.num_held_blocks}, evictable={self.num_evictable_blocks}, "
                f"free={self.num_free_blocks}, tables={tables})")
