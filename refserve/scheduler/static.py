"""Static (request-level) batching, as served before iteration-level scheduling; kept so the
difference can be measured in slot-steps used vs wasted.

* A batch forms only when none is running: up to max_num_seqs seats of waiting sequences,
  first come first served, as many as the pool can hold for their whole generation
  (prompt + max_tokens, since static systems reserved it up front), at least one.
* Its members are prefilled (token budget and chunking as in continuous batching) and
  decoded together. Nobody joins until the whole batch has finished.
* A finished member is retired (returned by `update`) but keeps its seat and its blocks: it
  sits in `padding` and is still computed each step as a wasted decode row
  (`SchedulerOutput.padding`: its last cached token recomputed, its K/V written nowhere, by
  static_runner.py) until the batch ends, when all its blocks are freed.
"""

from __future__ import annotations

from collections.abc import Mapping

from refserve.capacity import blocks_for_tokens
from refserve.kv_cache.kv_cache_manager import KVCacheManager
from refserve.scheduler.drafts import NO_PROPOSALS, Proposal
from refserve.scheduler.output import ScheduledSequence, SchedulerOutput
from refserve.scheduler.scheduler import Scheduler
from refserve.sequence import Sequence, SequenceStatus


class StaticScheduler(Scheduler):
    """Request-level (static) batching (see the module docstring)."""

    batching = "static"

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int,
                 kv_cache_manager: KVCacheManager, max_model_len: int,
                 eos_token_id: int | None = None,
                 long_prefill_token_threshold: int = 0) -> None:
        super().__init__(max_num_seqs, max_num_batched_tokens, kv_cache_manager,
                         max_model_len, eos_token_id, long_prefill_token_threshold)
        self.padding: list[Sequence] = []  # finished members of the current batch

    @property
    def num_seats_used(self) -> int:
        return sum(seq.num_seats for seq in self.running) + len(self.padding)

    def schedule(self, proposals: Mapping[int, Proposal] = NO_PROPOSALS) -> SchedulerOutput:
        out = self._begin_step()
        if not self.running and not self.padding:
            self._form_batch(out)
        budget = self._advance(out, self.max_num_batched_tokens, proposals)
        kv = self.kv_cache_manager
        for seq in self.padding:
            if budget == 0 or seq.num_computed_tokens == 0:
                continue
            out.padding.append(ScheduledSequence(
                seq=seq, start=seq.num_computed_tokens - 1, num_scheduled_tokens=1,
                num_logits=0, block_ids=kv.get_block_ids(seq.seq_id)))  # a copy already
            budget -= 1
        return self._end_step(out)

    def _form_batch(self, out: SchedulerOutput) -> None:
        """Take waiting sequences, head first, while seats last and the pool can reserve
        blocks for their whole generation (the first one always joins)."""
        free_blocks = self.kv_cache_manager.num_available_blocks
        block_size = self.kv_cache_manager.block_size
        reserved = 0
        seats = 0
        while self.waiting:
            seq = self.waiting[0]
            final_len = seq.num_prompt_tokens + seq.sampling_params.max_output_tokens(
                seq.num_prompt_tokens, self.max_model_len)
            need = seq.num_seats * blocks_for_tokens(final_len, block_size)
            if seats + seq.num_seats > self.max_num_seqs:
                break
            if self.running and reserved + need > free_blocks:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq.seq_id)
            seats += seq.num_seats
            reserved += need

    def _on_retired(self, seq: Sequence) -> None:
        self.padding.append(seq)  # keeps its seat and its blocks until the batch ends

    def _on_running_left(self) -> None:
        if not self.running:  # the batch has ended
            for seq in self.padding:
                self.kv_cache_manager.release(seq)
            self.padding.clear()
