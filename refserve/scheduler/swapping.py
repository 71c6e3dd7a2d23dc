"""preemption_mode="swap": the scheduler's side of swap preemption (vLLM v0's, with
`swap_space` GiB of host memory).

Recompute preemption frees a victim's blocks and prefills its context again later. Swap
preemption keeps the victim's computed KV: its blocks are copied to the host block pool
(kv_cache/host_pool.py) and back when it is readmitted, so nothing is recomputed:

    recompute  costs the prefill FLOPs of the context again         (compute)
    swap       costs 2 x the context's KV bytes over the host link  (out, then in)

The scheduler PLANS the copies; the engine's copy_blocks stage RUNS them before the forward
(backend.swap_out / swap_in), in this order: swap-out, swap-in, copy-on-write. A device
block freed by a swap-out can be handed to another sequence in the same step, but every
write of the step (swap-in, copy-on-write, the forward) runs after the swap-out read it.

The life of a swapped sequence:

    preempt   `defer(seq, table)`: the device blocks are released at once (the manager's
              release: a block another sequence shares stays resident for it), the table is
              remembered; the sequence keeps num_computed_tokens and waits at the head of
              the queue like a recompute victim
    end of    `flush(out)`: ONE host_pool.swap_out over all of this step's victims, so a
    schedule  device block two victims share (forked siblings, prefix hits) is copied once
              and its host block gets ref count 2
    readmit   `swap_in(seq, n, out)`: fresh device blocks, host -> device copies, and the
              slots of its next n tokens; the sequence resumes where it stopped (no
              prefix lookup: its own KV comes back)

Full host pool. A victim whose blocks (with this step's other victims') do not fit the host
blocks left is preempted by recompute instead; `num_fallbacks` counts those. A sequence
swapped in alone gets its own device copy of a host block it shared with a sibling still
swapped out (the host block stays for the sibling): correct KV, one block more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refserve.capacity import blocks_for_tokens
from refserve.kv_cache.host_pool import HostBlockPool
from refserve.scheduler.step_retry import last_per_destination

if TYPE_CHECKING:
    from refserve.kv_cache.kv_cache_manager import KVCacheManager
    from refserve.scheduler.output import SchedulerOutput
    from refserve.sequence import Sequence


class Swapper:
    """The host pool, this step's victims, and the swap counters (module docstring)."""

    def __init__(self, host_pool: HostBlockPool, kv: KVCacheManager) -> None:
        self.host_pool = host_pool
        self.kv = kv
        self._pending: dict[int, list[int]] = {}  # this step's victims: seq_id -> table
        self.num_swapped_out = 0  # sequences
        self.num_swapped_in = 0
        self.num_fallbacks = 0  # victims preempted by recompute: the host pool was full

    def is_swapped_out(self, seq: Sequence) -> bool:
        return seq.seq_id in self._pending or self.host_pool.is_swapped_out(seq.seq_id)

    def defer(self, seq: Sequence) -> bool:
        """Preempt `seq` by swap if the host pool holds its blocks together with this
        step's other victims: release its device blocks now, copy them at flush. False (and
        nothing changed) if the host pool is too full: preempt it by recompute instead."""
        table = self.kv.get_block_ids(seq.seq_id)
        wanted = {**self._pending, seq.seq_id: table}
        if self.host_pool.blocks_to_swap_out(wanted) > self.host_pool.num_available_blocks:
            self.num_fallbacks += 1
            return False
        self._pending[seq.seq_id] = table
        self.kv.release(seq)
        return True

    def flush(self, out: SchedulerOutput) -> None:
        """Give this step's victims host tables in one call; their (device, host) copies
        go to out.swap_out, for the copy_blocks stage. A copy carried from a step never
        applied (step_retry.py) whose destination this step reused is moot: the last of a
        destination's copies wins."""
        if self._pending:
            out.swap_out.extend(self.host_pool.swap_out(self._pending))
            self.num_swapped_out += len(self._pending)
            self._pending = {}
        out.swap_out[:] = last_per_destination(out.swap_out)
        out.swap_in[:] = last_per_destination(out.swap_in)

    def blocks_to_resume(self, seq: Sequence, num_new_tokens: int) -> int:
        """Device blocks readmitting a swapped-out seq with num_new_tokens takes: one per
        host block of its table, plus the new blocks its next tokens reach."""
        host = self.host_pool.blocks_to_swap_in([seq.seq_id])
        end = seq.num_computed_tokens + num_new_tokens
        return max(host, blocks_for_tokens(end, self.kv.block_size))

    def swap_in(self, seq: Sequence, num_new_tokens: int, out: SchedulerOutput
                ) -> list[tuple[int, int]] | None:
        """Readmit with `num_new_tokens` to compute: if the pool holds its swapped blocks
        back plus its new ones, the manager gives seq fresh blocks for its host blocks' KV
        (the (host, device) copies go to out.swap_in) and slots for the new tokens, whose
        copy-on-write pairs are returned; None (nothing changed) if the pool is short."""
        if self.blocks_to_resume(seq, num_new_tokens) > self.kv.num_available_blocks:
            return None
        out.swap_in.extend(self.kv.swap_in(seq, self.host_pool))
        self.num_swapped_in += 1
        copies = self.kv.allocate_slots(seq, num_new_tokens)
        assert copies is not None, "blocks_to_resume covers the new tokens' blocks"
        return copies

    def release(self, seq: Sequence) -> None:
        """An aborted sequence drops its host blocks (or its pending swap-out)."""
        self._pending.pop(seq.seq_id, None)
        self.host_pool.release(seq.seq_id)


def swap_stats(swapper: Swapper | None, bytes_per_block: int) -> dict:
    """Swap preemption's counters for the engine's stats() (zeros without a swapper:
    preemption_mode="recompute")."""
    if swapper is None:
        return {"swap_outs": 0, "swap_ins": 0, "swap_fallbacks_to_recompute": 0,
                "swap_bytes": 0}
    host = swapper.host_pool
    return {"swap_outs": swapper.num_swapped_out, "swap_ins": swapper.num_swapped_in,
            "swap_fallbacks_to_recompute": swapper.num_fallbacks,
            "swap_bytes": (host.num_swapped_out_blocks + host.num_swapped_in_blocks)
            * bytes_per_block}
