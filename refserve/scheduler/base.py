"""What both schedulers share: the queues, advancing with preemption, update and retire.

Continuous batching (`continuous.py`) and static batching (`static.py`) differ only in who
joins the running batch and when a finished sequence gives its seat back; everything else
lives here:

    ADVANCE  running sequences, oldest first (scheduling_policy="priority": highest
             priority first, policy.py). Each gets
                 n = min(tokens left to compute, budget_left)
             tokens: 1 for a decode, the next chunk of an unfinished prefill (chunked
             prefill), 1 + k for a speculative verify (the drafts of this step's proposals
             that fit the budget: scheduler/drafts.py). Its KV slots come from
             `kv_cache_manager.allocate_slots`.
    PREEMPT  while the pool cannot serve a running sequence (`kv.can_allocate` is False),
             the NEWEST running sequence is preempted ("priority": the lowest priority,
             newest among equals; always the last of the ADVANCE order, so never one
             already served this step) (recompute: its blocks are freed, it
             goes back to the HEAD of the waiting queue with its tokens kept, and is
             prefilled again when readmitted; preemption_mode="swap": its KV goes to the
             host pool and comes back on readmission, swapping.py). The newest may be the
             sequence itself. Why
             the newest: it has the least computed work to lose and arrived last, so the
             oldest requests keep making progress and nobody starves.
    UPDATE   (after the model ran) advance num_computed_tokens, append sampled tokens one
             by one under the stop rules (stop_rules.py), roll back what was not kept,
             hash newly full blocks for the prefix cache and RETIRE finished sequences,
             which leave the running batch in the same step. `update` is the ONLY place a
             sequence finishes (abort, the user's call, is the only other way out).

Limits of one step (both hold for every `SchedulerOutput`):

    token budget  sum of scheduled query tokens <= max_num_batched_tokens
    seats         sum of seq.num_seats over running sequences <= max_num_seqs
                  (a parent of an n > 1 request that has not forked yet holds n seats)

Slot-steps measure how well the batch is used: one slot-step is one seat for one step. It is
*used* when a real sequence is computed in it and *wasted* when a finished sequence is still
computed as padding (only static batching does that).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping

from refserve.kv_cache.host_pool import HostBlockPool
from refserve.kv_cache.kv_cache_manager import KVCacheManager
from refserve.scheduler.drafts import Proposal, count_verified, roll_back
from refserve.scheduler.fits import check_fits, check_scheduler_args
from refserve.scheduler.forking import Forking
from refserve.scheduler.output import (
    SampledTokens,
    ScheduledSequence,
    SchedulerOutput,
    StepUpdate,
)
from refserve.scheduler.policy import SchedulingPolicy, make_policy
from refserve.scheduler.row_plan import RowPlan, num_logits, plan_row
from refserve.scheduler.step_retry import carry_over, last_per_destination
from refserve.scheduler.stop_rules import append_tokens
from refserve.scheduler.swapping import Swapper
from refserve.sequence import Sequence, SequenceStatus

NO_PROPOSALS: Mapping[int, Proposal] = {}


class SchedulerBase(Forking):
    """The queues, advancing with preemption, update and retire (see the module docstring).

    Invariants between calls:
      * `waiting` (FIFO, head first) holds WAITING sequences; none of them holds blocks.
      * `running` (oldest first) holds RUNNING sequences; sum of num_seats <= max_num_seqs.
      * a sequence holds blocks in the KV-cache manager iff its id is in `_holding`.
      * finished sequences are in neither queue (static batching keeps them in `padding`
        until their batch ends).
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int,
                 kv_cache_manager: KVCacheManager, max_model_len: int,
                 eos_token_id: int | None = None,
                 long_prefill_token_threshold: int = 0,
                 scheduling_policy: str | SchedulingPolicy = "fcfs",
                 preemption_mode: str = "recompute",
                 host_pool: HostBlockPool | None = None) -> None:
        check_scheduler_args(max_num_seqs, max_num_batched_tokens, max_model_len,
                             long_prefill_token_threshold, preemption_mode, host_pool)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        # vLLM's cap on the tokens one prefill takes per step (0: none), so a long prompt
        # leaves budget for the requests behind it.
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # The admission order of `waiting` and the preemption victim (policy.py).
        self.policy = (scheduling_policy if isinstance(scheduling_policy, SchedulingPolicy)
                       else make_policy(scheduling_policy))
        self.preemption_mode = preemption_mode
        self.swapper = Swapper(host_pool, kv_cache_manager) if host_pool is not None else None

        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._by_id: dict[int, Sequence] = {}  # every unfinished sequence
        self._holding: set[int] = set()  # ids of sequences that hold KV blocks
        self._pending: SchedulerOutput | None = None  # scheduled, not yet updated
        self._riders: dict[int, list[Sequence]] = {}  # parent id -> children forked mid-step
        # Sequence ids are per scheduler (so per engine): re-running a notebook cell or a
        # test gives the same ids.
        self._seq_ids = itertools.count()

        self.num_steps = 0
        self.slot_steps_used = 0
        self.slot_steps_wasted = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed tokens whose KV recompute preemption dropped

    # ---- queries ------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_seats_used(self) -> int:
        return sum(seq.num_seats for seq in self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def new_seq_id(self) -> int:
        """The next sequence id of this scheduler (0, 1, 2, ...)."""
        return next(self._seq_ids)

    # ---- requests in and out ------------------------------------------------------------

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a new sequence at the tail of `waiting`; give it an id if it has none.

        Raises ValueError if it could never run (see `check_fits`).
        """
        if seq.seq_id is not None and seq.seq_id in self._by_id:
            raise ValueError(f"sequence {seq.seq_id} is already scheduled")
        if seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"sequence {seq.seq_id} is {seq.status.value}, not waiting")
        self.check_fits(seq.num_tokens, seq.num_seats)
        if seq.seq_id is None:
            seq.seq_id = self.new_seq_id()
        self._by_id[seq.seq_id] = seq
        self.waiting.append(seq)

    def check_fits(self, num_prompt_tokens: int, num_seats: int = 1) -> None:
        """Raise ValueError if a prompt could never run here (see `fits.check_fits`)."""
        kv = self.kv_cache_manager
        check_fits(num_prompt_tokens, num_seats, max_model_len=self.max_model_len,
                   max_num_seqs=self.max_num_seqs, num_blocks=kv.num_blocks,
                   block_size=kv.block_size)

    def abort(self, seq_id: int) -> Sequence | None:
        """Stop a waiting, preempted or running sequence now; its blocks are freed at once.
        Returns the sequence, or None if no unfinished sequence has this id."""
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            if self.swapper is not None:
                self.swapper.release(seq)
        else:
            self.running.remove(seq)
            self._release_blocks(seq)
            self._on_running_left()
        seq.status = SequenceStatus.FINISHED_ABORTED
        return seq

    # ---- one step -----------------------------------------------------------------------

    def schedule(self, proposals: Mapping[int, Proposal] = NO_PROPOSALS) -> SchedulerOutput:
        """One step's decision. `proposals`: this step's drafts by seq_id (the propose
        stage's result; empty without speculation)."""
        raise NotImplementedError

    def update(self, output: SchedulerOutput,
               sampled: SampledTokens | dict[int, list[int]]) -> StepUpdate:
        """Apply one computed step; return what it decided (a `StepUpdate`).

        `output` must be the latest `schedule()` result; one that was never applied (its
        forward or sampling failed) is abandoned by the next `schedule()`, which redoes its
        work. `sampled` is a `SampledTokens` (or just its `token_ids` dict).

        First the children of parallel-sampling parents are forked (`fork_token_ids`); they
        are listed in `StepUpdate.forked`. Then, for each scheduled, non-padding sequence:

            num_computed_tokens += num_tokens        (a chunk, a decode or a verify)
            append the sampled token(s) one by one under the stop rules (stop_rules.py):
                a stop inside a verify row's run drops the tokens after it
            num_computed_tokens = min(that, num_tokens - 1)   after a sampling row: the
                last appended token has no K/V yet; after a verify row `drafts.roll_back`
                also drops the K/V of what was not kept (rejected drafts, tokens after a
                stop) and the blocks that held only those slots

        newly full blocks go to the prefix cache, and a retired sequence leaves `running`
        and (continuous batching) releases its blocks now. Sequences aborted after
        `schedule()` are skipped.
        """
        if output.scheduled and output is not self._pending:
            raise ValueError(f"update() got step {output.step}, which is not the output of "
                             "the last schedule() or was already applied")
        if not isinstance(sampled, SampledTokens):
            sampled = SampledTokens(token_ids=dict(sampled))
        sampled.check_covers(output)
        token_ids = dict(sampled.token_ids)
        # Checked: from here on the step is applied.
        result = StepUpdate()
        for parent_id, child_tokens in sampled.fork_token_ids.items():
            parent = self._by_id.get(parent_id)
            if parent is None or parent.status is not SequenceStatus.RUNNING:
                continue  # aborted since schedule(): its children are never born
            for index, token in enumerate(child_tokens, start=1):
                child = parent.fork(seq_id=self.new_seq_id())
                child.child_index = index
                self.fork(parent, child)
                token_ids[child.seq_id] = [token]
                result.forked.append(child)
        self._pending = None
        riders, self._riders = self._riders, {}
        for row in output.scheduled:
            if row.is_padding:
                continue
            for seq in [row.seq, *riders.get(row.seq.seq_id, [])]:
                if seq.status is not SequenceStatus.RUNNING:
                    continue  # aborted since schedule()
                seq.num_computed_tokens += row.num_tokens
                status = None
                if row.samples:
                    emitted = token_ids[seq.seq_id]
                    before = seq.num_output_tokens
                    status = append_tokens(seq, emitted, self.eos_token_id, self.max_model_len)
                    kept = seq.output_token_ids[before:]
                    result.appended[seq.seq_id] = kept
                    if row.draft_token_ids:
                        roll_back(seq, self.kv_cache_manager)
                        result.verified[seq.seq_id] = count_verified(
                            len(row.draft_token_ids), len(emitted), len(kept))
                    else:  # the token just sampled has no K/V yet
                        seq.num_computed_tokens = min(seq.num_computed_tokens,
                                                      seq.num_tokens - 1)
                self.kv_cache_manager.cache_full_blocks(seq)
                if status is not None:
                    self._retire(seq, status)
                    result.retired.append(seq)
        return result

    # ---- building blocks of schedule() --------------------------------------------------

    def _begin_step(self) -> SchedulerOutput:
        out = SchedulerOutput(step=self.num_steps)
        if self._pending is not None:
            # The last step was never applied (its forward or sampling failed): this step
            # schedules the same work again, with the copies that still stand (step_retry.py).
            carry_over(self._pending, out, self.kv_cache_manager.allocator,
                       self.swapper.host_pool if self.swapper is not None else None)
            self._pending = None
            self._riders = {}
        return out

    def _end_step(self, out: SchedulerOutput) -> SchedulerOutput:
        kv = self.kv_cache_manager
        if self.swapper is not None:
            self.swapper.flush(out)  # this step's victims, in one swap_out
            # A carried copy whose destination this step reused is moot: the last wins.
            out.swap_out[:] = last_per_destination(out.swap_out)
            out.swap_in[:] = last_per_destination(out.swap_in)
        if not out.scheduled and self.has_unfinished():
            # Cannot happen while add_sequence keeps every prompt within the pool; fail
            # loudly rather than let a caller's `while has_unfinished()` spin forever.
            raise RuntimeError(
                f"the scheduler could schedule nothing with {self.num_waiting} waiting and "
                f"{self.num_running} running sequences ({kv.num_available_blocks} of "
                f"{kv.num_blocks} blocks free or evictable)")
        out.num_batched_tokens = sum(row.num_tokens for row in out.scheduled)
        assert out.num_batched_tokens <= self.max_num_batched_tokens
        assert self.num_seats_used <= self.max_num_seqs
        dsts = [dst for _, dst in out.block_copies]
        assert len(set(dsts)) == len(dsts), f"copy-on-write destinations repeat: {dsts}"
        out.max_num_batched_tokens = self.max_num_batched_tokens
        out.num_seats_used = self.num_seats_used
        out.max_num_seqs = self.max_num_seqs
        out.num_held_blocks = kv.num_held_blocks
        out.num_evictable_blocks = kv.num_evictable_blocks
        out.num_free_blocks = kv.num_free_blocks
        out.num_blocks = kv.num_blocks
        padding = sum(row.is_padding for row in out.scheduled)
        self.slot_steps_used += len(out.scheduled) - padding
        self.slot_steps_wasted += padding
        self.num_steps += 1
        if out.scheduled:
            self._pending = out
        return out

    def _advance(self, out: SchedulerOutput, budget: int,
                 proposals: Mapping[int, Proposal] = NO_PROPOSALS) -> int:
        """ADVANCE every running sequence in the policy's running order (oldest first) while
        budget is left; a sequence the pool cannot serve preempts the policy's victims (the
        newest). Returns the budget left."""
        for seq in self.policy.running_order(self.running):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            proposal = proposals.get(seq.seq_id)
            drafts = proposal.token_ids if proposal is not None else ()
            num_tokens = self._schedule_or_preempt(seq, budget, out, drafts)
            if num_tokens is None:
                break  # seq preempted itself: it was the last of the order, nobody is left
            budget -= num_tokens
        return budget

    def _schedule_or_preempt(self, seq: Sequence, budget: int, out: SchedulerOutput,
                             drafts: tuple[int, ...] = ()) -> int | None:
        """Give running `seq` its next tokens (and the `drafts` that fit), preempting the
        policy's victim (fcfs, lpm: the NEWEST running sequence) while the pool is short.
        Returns the tokens scheduled (>= 1), or None if seq itself was the one preempted."""
        num_tokens, computed_blocks, verify = self._plan_row(seq, budget, drafts)
        while not self.kv_cache_manager.can_allocate(seq, num_tokens, computed_blocks):
            if verify:
                # Speculation is optional: verify no drafts before preempting anyone.
                num_tokens, computed_blocks, verify = self._plan_row(seq, budget)
                continue
            # BEGIN EXERCISE scheduler_preempt: preempt the NEWEST running sequence (maybe seq)
            victim = self.policy.preemption_victim(self.running)  # fcfs: the newest
            if victim is seq and self._holding <= {seq.seq_id}:
                raise RuntimeError(
                    f"sequence {seq.seq_id} alone cannot fit its {seq.num_tokens} tokens "
                    f"in the KV pool ({self.kv_cache_manager.num_blocks} blocks of "
                    f"{self.kv_cache_manager.block_size}); the engine must size the pool "
                    f"for max_model_len={self.max_model_len}")
            self._preempt(victim, out)
            if victim is seq:
                return None
            # END EXERCISE
        return self._schedule_row(seq, num_tokens, computed_blocks, out, verify)

    def _plan_row(self, seq: Sequence, budget: int, drafts: tuple[int, ...] = ()
                  ) -> RowPlan:
        """How many tokens `seq` computes next under `budget`, the prefix-cache hit blocks
        it reuses (first allocation after (re)admission only) and the `drafts` it verifies
        (row_plan.py). Pure: changes nothing."""
        look_up = seq.seq_id not in self._holding and not self._is_swapped_out(seq)
        return plan_row(seq, budget, drafts, self.kv_cache_manager, look_up=look_up,
                        long_prefill_token_threshold=self.long_prefill_token_threshold)

    def _schedule_row(self, seq: Sequence, num_tokens: int, computed_blocks: list[int],
                      out: SchedulerOutput, drafts: tuple[int, ...] = ()) -> int:
        """Allocate KV slots for seq's next `num_tokens` tokens (the pool was checked) and
        add its row, verifying `drafts` after the real tokens. Prefix-cache hit tokens count
        as computed and are not scheduled."""
        kv = self.kv_cache_manager
        if self._is_swapped_out(seq):  # resumes with its own KV, copied back in
            self.swapper.swap_in(seq, out)
            self._holding.add(seq.seq_id)
        first = seq.seq_id not in self._holding
        copies = kv.allocate_slots(seq, num_tokens, computed_blocks=computed_blocks)
        if first:
            hit_tokens = len(computed_blocks) * kv.block_size
            self._holding.add(seq.seq_id)
            seq.num_computed_tokens += hit_tokens
            if seq.num_cached_tokens is None:  # vLLM's: the hit of the FIRST scheduling
                seq.num_cached_tokens = hit_tokens
        start = seq.num_computed_tokens
        end = start + num_tokens
        out.block_copies.extend(copies)
        out.scheduled.append(ScheduledSequence(
            seq, num_tokens, start, num_logits=num_logits(start, end, seq.num_tokens,
                                                          len(drafts)),
            block_ids=kv.get_block_ids(seq.seq_id), draft_token_ids=tuple(drafts)))
        return num_tokens

    def _can_allocate(self, seq: Sequence, num_tokens: int, computed_blocks: list[int]
                      ) -> bool:
        """kv.can_allocate, or for a swapped-out sequence: whether the pool holds its
        swapped blocks back plus the new blocks of its next tokens."""
        kv = self.kv_cache_manager
        if self._is_swapped_out(seq):
            return self.swapper.blocks_to_resume(seq, num_tokens) <= kv.num_available_blocks
        return kv.can_allocate(seq, num_tokens, computed_blocks)

    def _is_swapped_out(self, seq: Sequence) -> bool:
        return self.swapper is not None and self.swapper.is_swapped_out(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preemption by recompute: release every block, forget the computed KV, and put
        the sequence at the HEAD of the waiting queue. Its tokens (prompt and output so far)
        stay in seq.token_ids and are prefilled again on readmission. By swap (when the
        host pool has room): the blocks are released too, but their KV is copied to the
        host pool first and num_computed_tokens is kept (swapping.py)."""
        self.running.remove(seq)
        swapped = (self.swapper is not None and seq.seq_id in self._holding
                   and self.swapper.defer(seq))
        if swapped:
            self._holding.discard(seq.seq_id)
        else:
            self._release_blocks(seq)
            self.num_recomputed_tokens += seq.num_computed_tokens
            seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq.seq_id)
        self._on_running_left()

    def _retire(self, seq: Sequence, status: SequenceStatus) -> None:
        """RETIRE (called by `update` only): a finished sequence leaves the running batch
        in the step it finished."""
        seq.status = status
        self.running.remove(seq)
        del self._by_id[seq.seq_id]
        self._on_retired(seq)
        self._on_running_left()

    def _on_retired(self, seq: Sequence) -> None:
        """Hook: what happens to a retired sequence's blocks. Continuous batching releases
        them now (static batching keeps them until its batch ends)."""
        self._release_blocks(seq)

    def _on_running_left(self) -> None:
        """Hook: a sequence just left `running` (retired, aborted or preempted)."""

    def _release_blocks(self, seq: Sequence) -> None:
        if seq.seq_id in self._holding:
            self._holding.discard(seq.seq_id)
            self.kv_cache_manager.release(seq)
