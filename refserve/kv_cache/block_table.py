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
`KVCacheManager` allocates, shares and frees them); it only does the arithmetic, on a plain
Python list of block ids. `slot_mapping(block_ids, positions, block_size)` is the one
implementation of the slot formula (the model runner calls it for every step's rows).
"""

from __future__ import annotations

import numpy as np


def check_block_size(block_size) -> None:
    """ValueError unless `block_size` is an integer >= 1 (the one check: every class that
    takes a block size calls it)."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}: must be an integer >= 1")


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size): blocks a sequence of `num_tokens` tokens occupies."""
    check_block_size(block_size)
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens!r}: must be an integer >= 0")
    # BEGIN EXERCISE blocks_for_tokens: ceil(num_tokens / block_size) in integers (no floats)
    # ... return it (an int)
    # -(-a // b) is ceiling division on integers, with no float rounding.
    return -(-num_tokens // block_size)
    # END EXERCISE


def slot_mapping(block_ids, positions, block_size: int) -> np.ndarray:
    """slot(p) = block_ids[p // block_size] * block_size + p % block_size, for every p.

    block_ids: one sequence's block table (ints); positions: int array, each p with a
    block (p // block_size < len(block_ids)). Returns int64 slots, the shape of positions.
    """
    positions = np.asarray(positions, dtype=np.int64)
    table = np.asarray(block_ids, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


class BlockTable:
    def __init__(self, block_size: int, block_ids=()) -> None:
        check_block_size(block_size)
        self.block_size = block_size
        self._ids: list[int] = [int(b) for b in block_ids]

    @property
    def block_ids(self) -> list[int]:
        """The block ids (a copy)."""
        return list(self._ids)

    # ---- the append rule -----------------------------------------------------------------

    def num_new_blocks(self, num_tokens: int) -> int:
        """Blocks to append so that positions [0, num_tokens) all have a slot."""
        # BEGIN EXERCISE append_rule: blocks needed for num_tokens minus blocks held, never < 0
        # ... return that count (an int)
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - len(self._ids))
        # END EXERCISE

    # ---- edits (done by the KVCacheManager) ----------------------------------------------

    def append(self, block_id: int) -> None:
        self._ids.append(block_id)

    def replace(self, logical: int, block_id: int) -> int:
        """Point logical block `logical` at a new physical block (copy-on-write); returns
        the old physical id."""
        if not 0 <= logical < len(self._ids):
            raise IndexError(f"logical block {logical} not in a table of {len(self._ids)} "
                             "blocks")
        old = self._ids[logical]
        self._ids[logical] = block_id
        return old

    def truncate(self, num_blocks: int) -> list[int]:
        """Keep the first `num_blocks` blocks; returns the ids dropped (in table order)."""
        dropped = self._ids[num_blocks:]
        del self._ids[num_blocks:]
        return dropped

    def copy(self) -> BlockTable:
        return BlockTable(self.block_size, self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, logical: int) -> int:
        return self._ids[logical]

    def __iter__(self):
        return iter(self._ids)

    def __repr__(self) -> str:
        return f"BlockTable(block_size={self.block_size}, block_ids={self._ids})"
