"""Redoing a step that was never applied: its admissions undone, the copies that still stand.

If a stage after `schedule()` fails (the forward or sampling raised), `update()` never runs
for that output. Nothing was computed, and the next `schedule()` plans the same work again
(`Scheduler._begin_step`). The sequences the failed step admitted computed nothing: they go
back to the head of the waiting queue and give their blocks back (their prefix-cache hits
are found again), unless they came back from swap, whose KV lives on their device blocks
now. The others keep their blocks. The failed step's copies may not have run, so they are
carried over, but only while their destination is still held:

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

from refserve.sequence import SequenceStatus

if TYPE_CHECKING:
    from refserve.kv_cache.block_allocator import BlockAllocator
    from refserve.kv_cache.host_pool import HostBlockPool
    from refserve.scheduler.output import SchedulerOutput
    from refserve.sequence import Sequence


def admissions_to_undo(failed: SchedulerOutput) -> list[Sequence]:
    """The sequences the unapplied step `failed` admitted that must wait again (module
    docstring), newest first: each goes back to the head of the waiting queue in turn, so
    they keep their order. Not a sequence aborted since, nor one that came back from swap
    (its KV lives on its device blocks now)."""
    admitted = set(failed.admitted)
    return [row.seq for row in reversed(failed.scheduled)
            if row.seq.seq_id in admitted and row.seq.status is SequenceStatus.RUNNING
            and row.seq.num_computed_tokens == 0]


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
