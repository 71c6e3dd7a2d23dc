"""The host block pool: where a swapped-out sequence's KV waits (swap preemption).

Preemption by recompute frees a sequence's blocks and later prefills its context again. Swap
preemption copies the blocks to host memory instead and copies them back when the sequence
resumes, so nothing is recomputed:

    recompute  costs the prefill FLOPs of the context again      (compute)
    swap       costs 2 x the context's KV bytes over the host link (out, then in)

(WARMUP.md, "Second policies", derives where one beats the other.)

This module is only the bookkeeping of the host side; the copies are the backend's `swap_out`
/ `swap_in` ops, and the device side (freeing, allocating) stays with the KV-cache manager.
The host pool is a second `BlockAllocator`, over `num_blocks` host blocks of the device
layout, sized from vLLM's `swap_space` (GiB of host memory):

    host blocks = floor(swap_space * 2**30 / KV bytes per block)

State: for every swapped-out sequence, its *host block table* (host block of each logical
block). A host block's ref count is the number of host tables holding it.

Sharing. Sequences that share a device block (forked siblings, prefix-cache hits) and are
swapped out in ONE `swap_out` call share one host block: it is copied once and its ref count
is the number of those sequences. Swapped back in together by one `swap_in` call, they share
one fresh device block again (the caller sets its ref count to the number of tables holding
it), so copy-on-write goes on exactly as before. A sequence swapped alone gets its own copy.
The device ref counts stay the manager's: after swap_out it frees each sequence's blocks as
on a recompute preemption (a block another sequence still holds stays resident for it).

Full pool. `swap_out` raises `HostPoolFullError` and changes nothing when the host pool has
fewer free blocks than it needs; the caller then preempts by recompute instead (and counts
it). With swap_space = 0 the pool has no blocks and every swap_out falls back.

Invariants (`check_invariants`): host ref count of every block == number of host tables that
hold it; free + held == num_blocks; a table never holds a block twice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from refserve.kv_cache.block_allocator import BlockAllocator


class HostPoolFullError(RuntimeError):
    """The host pool cannot hold these blocks; nothing was changed. Preempt by recompute."""


def host_blocks_for_swap_space(swap_space_gib: float, block_bytes: int) -> int:
    """floor(swap_space * 2**30 / block_bytes): host blocks that swap_space GiB hold, with
    block_bytes the KV bytes of one block over all layers (capacity.kv_bytes_per_block)."""
    if isinstance(swap_space_gib, bool) or not isinstance(swap_space_gib, (int, float)) or \
            not swap_space_gib >= 0:
        raise ValueError(f"swap_space={swap_space_gib!r}: must be a number of GiB >= 0")
    if not isinstance(block_bytes, int) or block_bytes < 1:
        raise ValueError(f"block_bytes={block_bytes!r}: must be an integer >= 1")
    return int(swap_space_gib * 2**30) // block_bytes


@dataclass(frozen=True)
class SwapIn:
    """What swap_in hands back: each sequence's new device block table, the (host, device)
    copies for backend.swap_in (each host block once), and the device blocks that several of
    these tables share, with how many tables hold each (ref count to set)."""

    tables: dict[int, list[int]]
    copies: list[tuple[int, int]]
    shared: dict[int, int]


class HostBlockPool:
    """Host blocks for swapped-out sequences, with ref counts (see the module docstring)."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks!r}: must be an integer >= 0")
        self.num_blocks = num_blocks
        self._allocator = BlockAllocator(num_blocks) if num_blocks else None
        self._tables: dict[int, list[int]] = {}
        self.num_swapped_out_blocks = 0  # device -> host block copies, ever
        self.num_swapped_in_blocks = 0  # host -> device block copies, ever

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_available_blocks(self) -> int:
        return self._allocator.num_available_blocks if self._allocator else 0

    def is_swapped_out(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def swapped_out(self) -> list[int]:
        """Ids of the sequences whose KV is in the host pool."""
        return list(self._tables)

    def host_table(self, seq_id: int) -> list[int]:
        """The host block of each logical block of a swapped-out sequence (a copy)."""
        return list(self._table(seq_id))

    def ref_count(self, host_block: int) -> int:
        if self._allocator is None:
            raise ValueError(f"host block {host_block!r} does not exist: the pool is empty")
        return self._allocator.ref_count(host_block)

    def blocks_to_swap_out(self, tables: Mapping[int, SequenceOf[int]]) -> int:
        """Host blocks swap_out(tables) takes: the distinct device blocks among the tables."""
        return len({block for table in tables.values() for block in table})

    def blocks_to_swap_in(self, seq_ids: Collection[int]) -> int:
        """Device blocks swap_in(seq_ids) needs: the distinct host blocks of those tables."""
        return len({block for seq_id in seq_ids for block in self._table(seq_id)})

    # ---- swapping ------------------------------------------------------------------------

    def swap_out(self, tables: Mapping[int, SequenceOf[int]]) -> list[tuple[int, int]]:
        """Give these sequences (seq id -> device block table) host block tables. A device
        block held by k of them gets ONE host block with ref count k.

        Returns the (device, host) copies for backend.swap_out, in first-seen order. The
        caller then runs them and frees the sequences' device blocks. Raises
        HostPoolFullError if the host pool is short, ValueError for a sequence already
        swapped out or a table holding a block twice; either way nothing changed."""
        for seq_id, table in tables.items():
            if seq_id in self._tables:
                raise ValueError(f"swap_out: sequence {seq_id} is already swapped out")
            if len(set(table)) != len(table):
                raise ValueError(f"swap_out: sequence {seq_id}'s table holds a block twice")
        needed = self.blocks_to_swap_out(tables)
        if needed > self.num_available_blocks:
            raise HostPoolFullError(
                f"swap_out needs {needed} host blocks, {self.num_available_blocks} of "
                f"{self.num_blocks} are free: raise swap_space, or preempt by recompute")
        host_of: dict[int, int] = {}
        copies: list[tuple[int, int]] = []
        for seq_id, table in tables.items():
            host_table = []
            for device_block in table:
                host_block = host_of.get(device_block)
                if host_block is None:
                    host_block = host_of[device_block] = self._allocator.allocate()
                    copies.append((device_block, host_block))
                else:
                    self._allocator.incref(host_block)  # shared: copied once
                host_table.append(host_block)
            self._tables[seq_id] = host_table
        self.num_swapped_out_blocks += len(copies)
        return copies

    def swap_in(self, seq_ids: SequenceOf[int], device_blocks: SequenceOf[int]) -> SwapIn:
        """Bring these swapped-out sequences back onto device_blocks: fresh device blocks
        the caller allocated, exactly blocks_to_swap_in(seq_ids) of them, used in order for
        the distinct host blocks in first-seen order. Their host blocks are released (a host
        block shared with a sequence still swapped out stays for it).

        The caller then sets the ref count of each device block to the number of returned
        tables holding it (1, or SwapIn.shared[block]), installs the tables and runs
        backend.swap_in on SwapIn.copies before the next forward."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"swap_in: a sequence appears twice in {list(seq_ids)}")
        needed = self.blocks_to_swap_in(seq_ids)  # KeyError for one not swapped out
        if len(device_blocks) != needed or len(set(device_blocks)) != needed:
            raise ValueError(f"swap_in: {list(seq_ids)} need {needed} distinct device "
                             f"blocks, got {list(device_blocks)}")
        device_of: dict[int, int] = {}
        free_device = iter(device_blocks)
        copies: list[tuple[int, int]] = []
        tables: dict[int, list[int]] = {}
        for seq_id in seq_ids:
            table = []
            for host_block in self._tables.pop(seq_id):
                if host_block not in device_of:
                    device_of[host_block] = next(free_device)
                    copies.append((host_block, device_of[host_block]))
                table.append(device_of[host_block])
                self._allocator.decref(host_block)
            tables[seq_id] = table
        self.num_swapped_in_blocks += len(copies)
        counts = Counter(block for table in tables.values() for block in table)
        return SwapIn(tables, copies, {b: n for b, n in counts.items() if n > 1})

    def release(self, seq_id: int) -> None:
        """Drop a swapped-out sequence's host blocks without swapping it in (it was aborted
        or finished). No-op if it is not swapped out."""
        for host_block in self._tables.pop(seq_id, ()):
            self._allocator.decref(host_block)

    # ---- checks --------------------------------------------------------------------------

    def _table(self, seq_id: int) -> list[int]:
        table = self._tables.get(seq_id)
        if table is None:
            raise KeyError(f"sequence {seq_id} is not swapped out")
        return table

    def check_invariants(self) -> None:
        """Raise AssertionError if the host ref counts and the host tables disagree."""
        holders = Counter()
        for seq_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"host table of {seq_id} holds a block twice: {table}")
            holders.update(table)
        if self._allocator is None:
            assert not holders, "an empty pool holds blocks"
            return
        self._allocator.check_invariants()
        for block in range(self.num_blocks):
            if self._allocator.ref_count(block) != holders[block]:
                raise AssertionError(
                    f"host block {block}: ref count {self._allocator.ref_count(block)} but "
                    f"held by {holders[block]} host tables")

    def __repr__(self) -> str:
        return (f"HostBlockPool(blocks={self.num_blocks}, free={self.num_available_blocks}, "
                f"swapped_out={self._tables})")


if __name__ == "__main__":
    pool = HostBlockPool(num_blocks=6)
    # Sequences 0 and 1 are forked siblings: they share device blocks 4 and 5.
    copies = pool.swap_out({0: [4, 5, 7], 1: [4, 5, 9]})
    print("swap out 0 and 1 together -> copies (device, host)", copies)
    print("   ", pool, "(blocks 0 and 1 are shared: copied once, ref count 2)")
    try:
        pool.swap_out({2: [1, 2, 3]})
    except HostPoolFullError as e:
        print("swap out 2:", e)
    back = pool.swap_in([0, 1], device_blocks=[10, 11, 12, 13])
    print("swap in 0 and 1 onto fresh blocks 10..13 ->", back)
    print("   ", pool)
