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

The append rule: N tokens need blocks_needed(N) = ceil(N / block_size) blocks, so appending
one token takes a new block if and only if the last block is exactly full (N was a multiple
of block_size). The unused slots of the last block, blocks * block_size - N (at most
block_size - 1), are the sequence's *internal fragmentation*: the only waste paging leaves.

The table does not count tokens (the `Sequence` does) and does not own blocks (the
`KVCacheManager` allocates, shares and frees them); it only does the arithmetic.
"""

from __future__ import annotations

from refserve.capacity import blocks_for_tokens


class BlockTable:
    def __init__(self, block_size: int, block_ids: list[int] | None = None) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r}: must be an integer >= 1")
        self.block_size = block_size
        self.block_ids: list[int] = list(block_ids or [])

    # ---- the append rule -----------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return blocks_for_tokens(num_tokens, self.block_size)

    def num_new_blocks(self, num_tokens: int) -> int:
        """Blocks to append so that positions [0, num_tokens) all have a slot."""
        return max(0, self.blocks_needed(num_tokens) - len(self.block_ids))

    @property
    def num_slots(self) -> int:
        """Positions the table can hold right now: len(table) * block_size."""
        return len(self.block_ids) * self.block_size

    # ---- slot arithmetic -----------------------------------------------------------------

    def logical_block(self, position: int) -> int:
        """Index into the table of the block holding `position`: position // block_size."""
        return position // self.block_size

    def slot(self, position: int) -> int:
        """table[position // block_size] * block_size + position % block_size."""
        if not 0 <= position < self.num_slots:
            raise IndexError(
                f"position {position} has no slot: the table holds {len(self.block_ids)} "
                f"blocks = positions [0, {self.num_slots})")
        block_id = self.block_ids[position // self.block_size]
        return block_id * self.block_size + position % self.block_size

    def slots(self, start: int, end: int) -> list[int]:
        """Slots of positions [start, end), in order (the `slot_mapping` of a chunk)."""
        if start > end:
            raise ValueError(f"empty or reversed position range [{start}, {end})")
        if start < 0 or end > self.num_slots:
            raise IndexError(
                f"positions [{start}, {end}) do not all have slots: the table holds "
                f"{len(self.block_ids)} blocks = positions [0, {self.num_slots})")
        # Walk block by block: within one block the slots are consecutive.
        out: list[int] = []
        position = start
        while position < end:
            logical, offset = divmod(position, self.block_size)
            run = min(self.block_size - offset, end - position)
            first = self.block_ids[logical] * self.block_size + offset
            out.extend(range(first, first + run))
            position += run
        return out

    def logical_blocks_of_range(self, start: int, end: int) -> range:
        """Logical block indices touched by positions [start, end) (empty if start == end)."""
        if start >= end:
            return range(0)
        return range(start // self.block_size, (end - 1) // self.block_size + 1)

    # ---- edits (done by the KVCacheManager) ----------------------------------------------

    def append(self, block_id: int) -> None:
        self.block_ids.append(block_id)

    def replace(self, logical: int, block_id: int) -> int:
        """Point logical block `logical` at a new physical block (copy-on-write); returns
        the old physical id."""
        old = self.block_ids[logical]
        self.block_ids[logical] = block_id
        return old

    def copy(self) -> BlockTable:
        return BlockTable(self.block_size, self.block_ids)

    def __len__(self) -> int:
        return len(self.block_ids)

    def __getitem__(self, logical: int) -> int:
        return self.block_ids[logical]

    def __iter__(self):
        return iter(self.block_ids)

    def __repr__(self) -> str:
        return f"BlockTable(block_size={self.block_size}, block_ids={self.block_ids})"


if __name__ == "__main__":
    table = BlockTable(block_size=4, block_ids=[7, 2, 9])
    print(table)
    for p in range(10):
        print(f"position {p}: logical block {table.logical_block(p)}, slot {table.slot(p)}")
    print("slots(3, 9) =", table.slots(3, 9))
    for n in (10, 12, 13):
        print(f"{n} tokens need {table.blocks_needed(n)} blocks -> "
              f"{table.num_new_blocks(n)} new")
