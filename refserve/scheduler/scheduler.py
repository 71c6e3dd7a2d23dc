"""Continuous batching (iteration-level scheduling, as in Orca and vLLM): the `Scheduler`.

The batch is rebuilt every step. There are no prefill and decode phases: every sequence's
`num_computed_tokens` chases its `num_tokens`, and a step gives each scheduled sequence its
next query tokens. `schedule()` does, in this order:

    ADVANCE  running sequences, in the order of `running` (oldest first; "priority": most
             urgent first, scheduling_policy.py). Each gets its next row:
                 real  = min(tokens left to compute, budget left, long-prefill cap)
                 n     = real + the drafts that fit (speculative decoding, drafts.py)
             1 for a decode, the next chunk of an unfinished prefill (chunked prefill),
             1 + k for a verify. Its KV slots come from `kv.allocate_slots`.
    PREEMPT  while allocate_slots(...) is None (the pool is short): a verify row first drops
             its drafts; then the LAST running sequence is preempted: the newest
             ("priority": the least urgent), never one already served this step. Its blocks
             are released and it waits at the HEAD of the queue with its tokens kept: by
             recompute its KV is forgotten and prefilled again; by swap
             (preemption_mode="swap", swapping.py) it goes to the host pool and comes back.
             The newest has the least work to lose, so the oldest requests keep progressing.
    ADMIT    waiting sequences in the policy's order (fcfs: the queue as it stands), while
             the seats (max_num_seqs), the token budget (max_num_batched_tokens) and the
             pool allow. The first that does not fit stops admission: nobody skips ahead
             except by the policy's order. Admission never preempts, and a step that had to
             preempt admits nobody (the pool just proved short).

This is vLLM's mixed schedule (enable_chunked_prefill=True): decodes first, prefill chunks in
what is left of the budget; vLLM V0's prefill-first one is prefill_first.py's subclass.

`update()` then applies the computed step (UPDATE) and RETIRES finished sequences, which give
their seats and blocks back in the same step, so the next `schedule()` refills them. `update`
is the ONLY place a sequence finishes (abort, the user's call, is the only other way out) and
the only place `num_computed_tokens` advances (preemption by recompute resets it). Outside a
step, `add_sequence` queues a sequence, `abort` stops one, `fork` gives a parent its children.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping

from refserve.kv_cache.host_pool import HostBlockPool
from refserve.kv_cache.kv_cache_manager import KVCacheManager
from refserve.scheduler.drafts import NO_PROPOSALS, Proposal, count_verified, drafts_that_fit
from refserve.scheduler.fits import check_fits, check_scheduler_args
from refserve.scheduler.output import (
    RowPlan,
    SampledTokens,
    ScheduledSequence,
    SchedulerOutput,
    StepUpdate,
)
from refserve.scheduler.scheduling_policy import SchedulingPolicy, make_policy
from refserve.scheduler.step_retry import admissions_to_undo, carry_over
from refserve.scheduler.swapping import Swapper
from refserve.sequence import Sequence, SequenceStatus, append_tokens


class Scheduler:
    """Continuous batching (see the module docstring). Invariants between calls:
      * `waiting` (head first) holds WAITING sequences, none holding blocks; `running`
        holds RUNNING ones in ADVANCE order, so its last is the preemption victim;
        finished ones are in neither (static batching keeps them in `padding`).
      * seats: sum of seq.num_seats over `running` <= max_num_seqs (a parent of an n > 1
        request holds n until it forks); each step's query tokens <= max_num_batched_tokens.
    """

    batching = "continuous"

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
        self.policy = (scheduling_policy if isinstance(scheduling_policy, SchedulingPolicy)
                       else make_policy(scheduling_policy))
        self.swapper = Swapper(host_pool, kv_cache_manager) if host_pool is not None else None

        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._by_id: dict[int, Sequence] = {}  # every unfinished sequence
        self._pending: SchedulerOutput | None = None  # scheduled, not yet updated
        self._riders: dict[int, list[Sequence]] = {}  # parent id -> children forked mid-step
        self._seq_ids = itertools.count()  # per scheduler: a rerun gives the same ids

        self.num_steps = 0
        self.slot_steps_used = 0    # slot-steps: refserve/metrics.py
        self.slot_steps_wasted = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed tokens whose KV recompute preemption dropped

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
        return next(self._seq_ids)

    # ---- sequences in and out, from outside a step ----------------------------------------

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a new sequence at the tail of `waiting`, with an id if it has none.
        ValueError if it could never run (fits.py)."""
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
        """Raise ValueError if a prompt could never run here (fits.py)."""
        check_fits(self, num_prompt_tokens, num_seats)

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
            self.kv_cache_manager.release(seq)
            self._on_running_left()
        seq.status = SequenceStatus.FINISHED_ABORTED
        return seq

    # ---- one step: schedule ------------------------------------------------------------

    def schedule(self, proposals: Mapping[int, Proposal] = NO_PROPOSALS) -> SchedulerOutput:
        """One step's decision (module docstring). `proposals`: this step's drafts by
        seq_id (they ride the rows they fit, drafts.py)."""
        out = self._begin_step()
        budget = self._advance(out, self.max_num_batched_tokens, proposals)
        if self.waiting and not out.preempted:
            self._admit(out, budget)
        return self._end_step(out)

    def _advance(self, out: SchedulerOutput, budget: int,
                 proposals: Mapping[int, Proposal] = NO_PROPOSALS,
                 seqs: list[Sequence] | None = None) -> int:
        """ADVANCE the running sequences (or `seqs`) while budget is left; returns what is
        left."""
        for seq in list(self.running) if seqs is None else seqs:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            proposal = proposals.get(seq.seq_id)
            plan = self._plan_row(seq, budget, proposal.token_ids if proposal else ())
            while (copies := self.kv_cache_manager.allocate_slots(
                    seq, plan.num_scheduled_tokens, plan.computed_blocks)) is None:
                if plan.drafts:  # speculation is optional: drop the drafts before preempting
                    plan = self._plan_row(seq, budget)
                    continue
                # BEGIN EXERCISE scheduler_preempt: preempt the NEWEST running sequence (maybe seq)
                # ... self._preempt(victim, out); return budget when the victim is seq
                victim = self.running[-1]  # the newest (priority: the least urgent)
                if victim is seq and len(self.running) == 1:
                    raise RuntimeError(
                        f"sequence {seq.seq_id} alone cannot fit its {seq.num_tokens} tokens "
                        f"in the KV pool ({self.kv_cache_manager.num_blocks} blocks of "
                        f"{self.kv_cache_manager.block_size}); the engine must size the pool "
                        f"for max_model_len={self.max_model_len}")
                self._preempt(victim, out)
                if victim is seq:
                    return budget  # seq was the last of the running order: nobody is left
                # END EXERCISE
            self._add_row(seq, plan, copies, out)
            budget -= plan.num_scheduled_tokens
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """ADMIT waiting sequences (module docstring) while the first of the policy's order
        fits; the admitted leave `waiting`, and the policy hears of the round (lpm's guard
        counts it). Called only while some sequence waits."""
        queue = list(self.waiting)
        order = self.policy.order(queue, self.kv_cache_manager.prefix_match_length)
        admitted: list[Sequence] = []
        # BEGIN EXERCISE scheduler_admit: in `order` while seats, budget and blocks allow
        # ... each admitted: its row (_add_row), RUNNING, in `admitted`, in `running` at
        # ... policy.running_index, in out.admitted; seats_used and budget updated
        seats_used = self.num_seats_used
        for seq in order:
            if budget <= 0 or seats_used + seq.num_seats > self.max_num_seqs:
                break
            plan = self._plan_row(seq, budget)
            copies = self._allocate_admitted(seq, plan, out)
            if copies is None:
                break
            self._add_row(seq, plan, copies, out)
            admitted.append(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.insert(self.policy.running_index(self.running, seq), seq)
            seats_used += seq.num_seats
            out.admitted.append(seq.seq_id)
            budget -= plan.num_scheduled_tokens
        # END EXERCISE
        if admitted:
            left = {seq.seq_id for seq in admitted}
            self.waiting = collections.deque(s for s in queue if s.seq_id not in left)
        self.policy.on_admitted(queue, admitted)

    def _plan_row(self, seq: Sequence, budget: int, drafts: tuple[int, ...] = ()) -> RowPlan:
        """`seq`'s next row under `budget` (module docstring, ADVANCE). A sequence that holds
        no blocks (a WAITING one, being admitted) first looks up its prefix-cache hits,
        unless it resumes from swap with its own KV. Changes no sequence and takes no block
        (the radix tree's lookup may split a node and marks the hit path used)."""
        kv = self.kv_cache_manager
        admitting = seq.status is SequenceStatus.WAITING and not self._is_swapped_out(seq)
        computed_blocks, num_hit_tokens = kv.get_computed_blocks(seq) if admitting else ([], 0)
        start = seq.num_computed_tokens + num_hit_tokens
        real_left = seq.num_tokens - start
        if 0 < self.long_prefill_token_threshold < budget:
            budget = self.long_prefill_token_threshold  # a long prefill leaves budget over
        drafts = drafts[:drafts_that_fit(len(drafts), real_left, budget)] if drafts else ()
        num_scheduled_tokens = min(real_left, budget) + len(drafts)
        assert num_scheduled_tokens >= 1, f"{seq} has nothing left to compute"
        return RowPlan(start=start, num_scheduled_tokens=num_scheduled_tokens,
                       computed_blocks=computed_blocks, num_hit_tokens=num_hit_tokens,
                       drafts=drafts)

    def _allocate_admitted(self, seq: Sequence, plan: RowPlan, out: SchedulerOutput
                           ) -> list[tuple[int, int]] | None:
        """allocate_slots, a swapped-out sequence's KV brought back first (swapping.py)."""
        if self._is_swapped_out(seq):
            return self.swapper.swap_in(seq, plan.num_scheduled_tokens, out)
        return self.kv_cache_manager.allocate_slots(seq, plan.num_scheduled_tokens,
                                                    plan.computed_blocks)

    def _add_row(self, seq: Sequence, plan: RowPlan, copies: list[tuple[int, int]],
                 out: SchedulerOutput) -> None:
        """Record seq's row, its slots allocated. Its num_logits (output.py): the positions
        at or after the last real token, once the row reaches the end of token_ids + drafts."""
        last = seq.num_tokens + len(plan.drafts)
        num_logits = plan.end - max(plan.start, seq.num_tokens - 1) if plan.end == last else 0
        if seq.num_cached_tokens is None:  # vLLM's: the hit of the FIRST scheduling
            seq.num_cached_tokens = plan.num_hit_tokens
        out.block_copies.extend(copies)
        out.scheduled.append(ScheduledSequence(
            seq=seq, start=plan.start, num_scheduled_tokens=plan.num_scheduled_tokens,
            num_logits=num_logits, block_ids=self.kv_cache_manager.get_block_ids(seq.seq_id),
            draft_token_ids=plan.drafts))

    def _is_swapped_out(self, seq: Sequence) -> bool:
        return self.swapper is not None and self.swapper.is_swapped_out(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """PREEMPT `seq` (module docstring); swap falls back to recompute when the host pool
        is full."""
        self.running.remove(seq)
        kv = self.kv_cache_manager
        if self.swapper is None or not kv.has_sequence(seq.seq_id) or not self.swapper.defer(seq):
            kv.release(seq)
            self.num_recomputed_tokens += seq.num_computed_tokens
            seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq.seq_id)
        self._on_running_left()

    def _begin_step(self) -> SchedulerOutput:
        """A new output. If the last step was never applied (its forward or sampling
        failed), this step plans its work again (step_retry.py)."""
        out = SchedulerOutput(step=self.num_steps, max_num_seqs=self.max_num_seqs,
                              max_num_batched_tokens=self.max_num_batched_tokens)
        failed = self._pending  # scheduled and never updated: the step failed
        self._pending = None
        self._riders = {}
        if failed is not None:
            for seq in admissions_to_undo(failed):
                self.running.remove(seq)
                self.kv_cache_manager.release(seq)
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)
            carry_over(failed, out, self.kv_cache_manager.allocator,
                       None if self.swapper is None else self.swapper.host_pool)
        return out

    def _end_step(self, out: SchedulerOutput) -> SchedulerOutput:
        """The output completed (swaps, counts, the pool), checked and counted."""
        if self.swapper is not None:
            self.swapper.flush(out)  # this step's victims, in one swap_out
        out.blocks = self.kv_cache_manager.block_counts()
        if not out.scheduled and self.has_unfinished():
            # Cannot happen while add_sequence keeps every prompt within the pool; fail
            # loudly rather than let a caller's `while has_unfinished()` spin forever.
            raise RuntimeError(
                f"the scheduler could schedule nothing with {self.num_waiting} waiting and "
                f"{self.num_running} running sequences and {out.blocks} in the pool")
        out.num_batched_tokens = sum(row.num_scheduled_tokens
                                     for row in out.scheduled + out.padding)
        out.num_seats_used = self.num_seats_used
        assert out.num_batched_tokens <= out.max_num_batched_tokens, f"budget: {out}"
        assert out.num_seats_used <= out.max_num_seqs, f"seats: {out}"
        self.slot_steps_used += len(out.scheduled)
        self.slot_steps_wasted += len(out.padding)
        self.num_steps += 1
        if out.scheduled:
            self._pending = out
        return out

    # ---- one step: update, after the forward ---------------------------------------------

    def update(self, output: SchedulerOutput,
               sampled: SampledTokens | dict[int, list[int]]) -> StepUpdate:
        """UPDATE: apply `output`, the latest `schedule()` result, with `sampled` (or its
        `token_ids` dict); return what it decided. First parallel-sampling children are
        forked (`fork`); then each row's sequence and riders, unless aborted since:

            append the sampled token(s) one by one under the stop rules (sequence.py);
                a stop inside a verify row's run drops the tokens after it
            num_computed_tokens = row.end, after a sampling row at most num_tokens - 1: the
                last appended token has no K/V yet, and neither have the positions past
                it (rejected drafts, tokens after a stop: drafts.py rolls them back)
            newly full blocks go to the prefix cache; a finished sequence is RETIRED: it
                leaves `running` and releases its blocks now (static batching: later)
        """
        if output.scheduled and output is not self._pending:
            raise ValueError(f"update() got step {output.step}, which is not the output of "
                             "the last schedule() or was already applied")
        if not isinstance(sampled, SampledTokens):
            sampled = SampledTokens(token_ids=dict(sampled))
        unsampled = [row.seq.seq_id for row in output.scheduled
                     if row.num_logits and row.seq.status is SequenceStatus.RUNNING
                     and not sampled.token_ids.get(row.seq.seq_id)]
        if unsampled:
            raise ValueError(f"update(): no sampled token for sequence(s) {unsampled}; a "
                             "sampling row appends at least one")
        # Checked: from here on the step is applied.
        result = StepUpdate()
        token_ids, logprobs = dict(sampled.token_ids), dict(sampled.logprobs)
        for parent_id, draws in sampled.children.items():
            parent = self._by_id.get(parent_id)
            if parent is None or parent.status is not SequenceStatus.RUNNING:
                continue  # aborted since schedule(): its children are never born
            for index, draw in enumerate(draws, start=1):
                child = parent.fork(self.new_seq_id(), index, draw.generator)
                self.fork(parent, child)  # rides this step: advanced below like its parent
                token_ids[child.seq_id] = [draw.token_id]
                logprobs[child.seq_id] = draw.logprobs
                result.forked.append(child)
        self._pending = None
        riders, self._riders = self._riders, {}
        for row in output.scheduled:
            for seq in [row.seq, *riders.get(row.seq.seq_id, [])]:
                if seq.status is not SequenceStatus.RUNNING:
                    continue  # aborted since schedule()
                computed = row.end
                status = None
                if row.num_logits:
                    before = seq.num_output_tokens
                    status = append_tokens(seq, token_ids[seq.seq_id], self.eos_token_id,
                                           self.max_model_len, logprobs.get(seq.seq_id))
                    result.appended[seq.seq_id] = seq.output_token_ids[before:]  # up to a stop
                    computed = min(computed, seq.num_tokens - 1)
                    if row.draft_token_ids:
                        result.verified[seq.seq_id] = count_verified(
                            len(row.draft_token_ids), len(token_ids[seq.seq_id]),
                            len(result.appended[seq.seq_id]))
                seq.num_computed_tokens = computed
                if row.draft_token_ids:
                    self.kv_cache_manager.trim(seq, seq.num_tokens)  # the rolled-back slots
                self.kv_cache_manager.cache_full_blocks(seq)
                if status is not None:
                    self._retire(seq, status)
                    result.retired.append(seq)
        return result

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Parallel sampling: `child` (made by `parent.fork()`) shares every block of the
        running `parent` (copy-on-write) and runs right after it and its earlier children;
        the parent's n seats become 1 + one per child. Forked between `schedule()` and
        `update()` (as `update` forks `SampledTokens.children`), the child rides that step
        (`_riders`). Everything is checked before anything changes."""
        if self._by_id.get(parent.seq_id) is not parent or parent not in self.running:
            raise ValueError(f"fork: parent {parent.seq_id} is not running")
        if not self.kv_cache_manager.has_sequence(parent.seq_id):
            raise ValueError(f"fork: parent {parent.seq_id} has not been computed yet")
        if child.seq_id is None:
            child.seq_id = self.new_seq_id()
        if child.seq_id in self._by_id:
            raise ValueError(f"fork: sequence {child.seq_id} is already scheduled")
        rides = self._pending is not None and any(
            row.seq is parent for row in self._pending.scheduled)
        if rides and (child.num_computed_tokens != parent.num_computed_tokens
                      or child.token_ids != parent.token_ids):
            raise ValueError(f"fork between schedule() and update(): child {child.seq_id} "
                             "must copy the parent as scheduled (parent.fork() does)")
        # Validated: from here on nothing can fail.
        self.kv_cache_manager.fork(parent, child)
        parent.awaiting_fork = False
        child.awaiting_fork = False
        child.status = SequenceStatus.RUNNING
        index = self.running.index(parent) + 1
        while (index < len(self.running)
               and self.running[index].request_id == parent.request_id):
            index += 1
        self.running.insert(index, child)
        self._by_id[child.seq_id] = child
        if rides:
            self._riders.setdefault(parent.seq_id, []).append(child)

    def _retire(self, seq: Sequence, status: SequenceStatus) -> None:
        """RETIRE (called by `update` only): a finished sequence leaves the running batch
        in the step it finished."""
        seq.status = status
        self.running.remove(seq)
        del self._by_id[seq.seq_id]
        self._on_retired(seq)
        self._on_running_left()

    def _on_retired(self, seq: Sequence) -> None:
        """Hook: a retired sequence's blocks are released now (static batching: later)."""
        self.kv_cache_manager.release(seq)

    def _on_running_left(self) -> None:
        """Hook: a sequence just left `running` (retired, aborted or preempted)."""
