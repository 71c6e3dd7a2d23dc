"""The block table: one sequence's map from logical blocks to physical blocks.

A sequence sees its KV cache as a contiguous array of positions 0, 1, 2, ... Cut into
blocks of `block_size` positions, position p lies in *logical* block p // block_size at
offset p % block_size. The block table says which *physical* block (an id handed out by the
`BlockAllocator`) stores each logical block:

    table = [7, 2, 9], block_size = 4

    positions   0 1 2 3 | 4 5 6 7 | 8 9
    logical     0       | 1       | 2
    physical    7       | 2       | 9

The flat KV slot of a position (the row `write_kv` scatters into) is

    slot(p) = table[p // block_size] * block_size + p % block_size

so position 5 above goes to slot 2 * 4 + 1 = 9.

The append rule: N tokens need blocks_for_tokens(N) = ceil(N / block_size) blocks, so appending
one token takes a new block if and only if the last block is exactly full (N was a multiple
of block_size). The unused slots of the last block, blocks * block_size - N (at most
block_size - 1), are the sequence's *internal fragmentation*: the only waste paging leaves.

The table does not count tokens (the `Sequence` does) and does not own blocks (the
`KVCacheManager` allocates, shares and frees them); it only does the arithmetic.

Storage: the ids live in a persistent int32 NumPy array that grows by doubling, so an append
is O(1) amortised and `array` (the ids as int32, no copy) is what the model runner copies
into a step's `block_tables` row by one slice, instead of rebuilding it from a Python list.
`slot_mapping(block_ids, positions, block_size)` is the one implementation of the slot
formula; `slot`, `slots` and the model runner all call it.
"""

from __future__ import annotations

import numpy as np


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size): blocks a sequence of `num_tokens` tokens occupies."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}: must be an integer >= 1")
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens!r}: must be an integer >= 0")
    # BEGIN EXERCISE blocks_for_tokens: ceil(num_tokens / block_size) in integers (no floats)
    # -(-a // b) is ceiling division on integers, with no float rounding.
    return -(-num_tokens // block_size)
    # END EXERCISE


def slot_mapping(block_ids: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """slot(p) = block_ids[p // block_size] * block_size + p % block_size, for every p.

    block_ids: one sequence's block table (int array); positions: int array, each p with a
    block (p // block_size < len(block_ids)). Returns int64 slots, the shape of positions.
    """
    positions = np.asarray(positions, dtype=np.int64)
    table = np.asarray(block_ids, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


class BlockTable:
    def __init__(self, block_size: int, block_ids: list[int] | None = None) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r}: must be an integer >= 1")
        self.block_size = block_size
        ids = np.asarray(block_ids if block_ids is not None else [], dtype=np.int32)
        self._ids = np.empty(max(4, 2 * len(ids)), dtype=np.int32)  # capacity, grows x2
        self._ids[:len(ids)] = ids
        self._len = len(ids)

    @property
    def array(self) -> np.ndarray:
        """The block ids as an int32 array [len(self)] (a read-only view, no copy)."""
        view = self._ids[:self._len]
        view.flags.writeable = False
        return view

    @property
    def block_ids(self) -> list[int]:
        """The block ids as a list of Python ints (a copy)."""
        return self._ids[:self._len].tolist()

    # ---- the append rule -----------------------------------------------------------------

    def num_new_blocks(self, num_tokens: int) -> int:
        """Blocks to append so that positions [0, num_tokens) all have a slot."""
        # BEGIN EXERCISE append_rule: blocks needed for num_tokens minus blocks held, never < 0
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - self._len)
        # END EXERCISE

    @property
    def num_slots(self) -> int:
        """Positions the table can hold right now: len(table) * block_size."""
        return self._len * self.block_size

    # ---- slot arithmetic -----------------------------------------------------------------

    def logical_block(self, position: int) -> int:
        """Index into the table of the block holding `position`: position // block_size."""
        return position // self.block_size

    def slot(self, position: int) -> int:
        """table[position // block_size] * block_size + position % block_size."""
        if not 0 <= position < self.num_slots:
            raise IndexError(
                f"position {position} has no slot: the table holds {self._len} "
                f"blocks = positions [0, {self.num_slots})")
        return int(slot_mapping(self.array, position, self.block_size))

    def slots(self, start: int, end: int) -> list[int]:
        """Slots of positions [start, end), in order (the `slot_mapping` of a chunk)."""
        if start > end:
            raise ValueError(f"empty or reversed position range [{start}, {end})")
        if start < 0 or end > self.num_slots:
            raise IndexError(
                f"positions [{start}, {end}) do not all have slots: the table holds "
                f"{self._len} blocks = positions [0, {self.num_slots})")
        return slot_mapping(self.array, np.arange(start, end), self.block_size).tolist()

    def logical_blocks_of_range(self, start: int, end: int) -> range:
        """Logical block indices touched by positions [start, end) (empty if start == end)."""
        if start >= end:
            return range(0)
        return range(start // self.block_size, (end - 1) // self.block_size + 1)

    # ---- edits (done by the KVCacheManager) ----------------------------------------------

    def append(self, block_id: int) -> None:
        if self._len == len(self._ids):
            grown = np.empty(2 * len(self._ids), dtype=np.int32)
            grown[:self._len] = self._ids[:self._len]
            self._ids = grown
        self._ids[self._len] = block_id
        self._len += 1

    def replace(self, logical: int, block_id: int) -> int:
        """Point logical block `logical` at a new physical block (copy-on-write); returns
        the old physical id."""
        if not 0 <= logical < self._len:
            raise IndexError(f"logical block {logical} not in a table of {self._len} blocks")
        old = int(self._ids[logical])
        self._ids[logical] = block_id
        return old

    def copy(self) -> BlockTable:
        return BlockTable(self.block_size, self.array)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, logical: int) -> int:
        if not -self._len <= logical < self._len:
            raise IndexError(f"logical block {logical} not in a table of {self._len} blocks")
        return int(self._ids[logical % self._len])

    def __iter__(self):
        return iter(self.block_ids)

    def __repr__(self) -> str:
        return f"BlockTable(block_size={self.block_size}, block_ids={self.block_ids})"
