"""Redoing a step that was never applied: which of its planned copies still stand.

If a stage after `schedule()` fails (the forward or sampling raised), `update()` never runs
for that output. Nothing was computed, every sequence keeps its blocks, and the next
`schedule()` plans the same work again (`Scheduler._begin_step`). The failed step's
copies may not have run, so they are carried over, but only while their destination is
still held:

    copy-on-write (src, dst)   while ref_count(dst) > 0 in the device pool
    swap-out (device, host)    while the host block is still held by a host table
    swap-in (host, device)     while the device block is still held by a block table

A request aborted in between gave its private destination back to its pool, and a later
copy may take that block again: copying into it twice would be wrong and would break the
"distinct destinations" rule of copy_blocks. Running a still-valid copy twice is harmless:
no forward wrote to either block since.

Invariant after `last_per_destination`: each destination appears once, with its last copy
(a carried copy whose destination this step reused is moot: the last one wins).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refserve.kv_cache.block_allocator import BlockAllocator
    from refserve.kv_cache.host_pool import HostBlockPool
    from refserve.scheduler.output import SchedulerOutput


def carry_over(failed: SchedulerOutput, out: SchedulerOutput, allocator: BlockAllocator,
               host_pool: HostBlockPool | None) -> None:
    """Append to `out` the copies of the unapplied step `failed` whose destination is still
    held (module docstring). `host_pool`: None without swap preemption."""
    out.block_copies.extend((src, dst) for src, dst in failed.block_copies
                            if allocator.ref_count(dst) > 0)
    if host_pool is not None:
        out.swap_out.extend((d, h) for d, h in failed.swap_out if host_pool.ref_count(h) > 0)
        out.swap_in.extend((h, d) for h, d in failed.swap_in if allocator.ref_count(d) > 0)


def last_per_destination(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(src, dst) pairs keeping, for each dst, only its last copy (in their order)."""
    last = {dst: i for i, (_, dst) in enumerate(pairs)}
    return [pair for i, pair in enumerate(pairs) if last[pair[1]] == i]
