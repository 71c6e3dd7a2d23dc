"""Continuous batching (iteration-level scheduling, as in Orca and vLLM).

The batch is rebuilt every step. There are no prefill and decode phases: every sequence's
`num_computed_tokens` chases its `num_tokens`, and a step gives each scheduled sequence its
next query tokens. One step of `Scheduler.schedule()` does, in this order:

    ADVANCE  running sequences, oldest first, preempting the newest when the pool is
             short (`SchedulerBase._advance`).
    ADMIT    waiting sequences in the scheduling policy's order (policy.py: fcfs, the
             queue as it stands; lpm, longest cached prefix first; priority, lowest value
             first), while the seats (max_num_seqs) and the token budget
             (max_num_batched_tokens) allow and the pool can hold their first chunk. The
             first sequence of that order that does not fit stops admission: nobody skips
             ahead except by the policy's order. Admission never preempts, and a step that
             had to preempt admits nobody (the pool just proved short).

`update()` (in the base) then retires finished sequences and frees their blocks in the same
step, so their seats are refilled by the very next `schedule()`.

Two schedules, vLLM's `enable_chunked_prefill`:

    True (mixed)     as above: the decodes go first and prefill chunks fill what is left of
                     the budget, so a long prompt never stalls a running decode for long
                     (with a small budget or long_prefill_token_threshold: chunked).
    False            PREFILL-FIRST, vLLM V0's default schedule: a step that has prefill
                     work runs prefills only: unfinished prefills of running sequences,
                     then admissions, up to the token budget; every decode waits for a step
                     without prefill work. TTFT falls (a prompt never shares its step with
                     the decodes), and each running request's next token waits behind every
                     prefill step: TPOT rises with the arrival rate. Unlike V0, which refuses
                     a budget below max_model_len, a prompt longer than the budget is still
                     split over consecutive steps (each of them prefill-only).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

from refserve.scheduler.base import NO_PROPOSALS, SchedulerBase
from refserve.scheduler.drafts import Proposal
from refserve.scheduler.output import SchedulerOutput
from refserve.sequence import SequenceStatus


class Scheduler(SchedulerBase):
    """Continuous batching: the batch is rebuilt every step (see the module docstring)."""

    batching = "continuous"

    def __init__(self, *args, enable_chunked_prefill: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.enable_chunked_prefill = enable_chunked_prefill

    def schedule(self, proposals: Mapping[int, Proposal] = NO_PROPOSALS) -> SchedulerOutput:
        """ADVANCE running sequences (preempting the newest when the pool is short), then
        ADMIT waiting ones, unless this step preempted. `proposals`: this step's drafts by
        seq_id (speculative decoding; they ride the rows they fit, scheduler/drafts.py).
        With enable_chunked_prefill=False: `_schedule_prefill_first`."""
        out = self._begin_step()
        if not self.enable_chunked_prefill:
            return self._end_step(self._schedule_prefill_first(out, proposals))
        budget = self._advance(out, self.max_num_batched_tokens, proposals)
        if not out.preempted:
            self._admit(out, budget)
        return self._end_step(out)

    def _schedule_prefill_first(self, out: SchedulerOutput,
                                proposals: Mapping[int, Proposal]) -> SchedulerOutput:
        """The prefill-first step (module docstring): first the running sequences whose
        prefill is unfinished (more than one token left to compute), then ADMIT; if that
        scheduled or preempted anything, the step is done and the decodes wait. Otherwise
        a decode step: ADVANCE every running sequence, admitting nobody."""
        budget = self.max_num_batched_tokens
        for seq in self.policy.running_order(self.running):
            if budget <= 0:
                break
            if (seq.status is not SequenceStatus.RUNNING
                    or seq.num_tokens - seq.num_computed_tokens <= 1):
                continue  # preempted earlier in this loop, or decoding: it waits
            num_tokens = self._schedule_or_preempt(seq, budget, out)
            if num_tokens is None:
                break  # seq preempted itself: it was the last of the order
            budget -= num_tokens
        if not out.preempted:
            self._admit(out, budget)
        if not out.scheduled and not out.preempted:
            self._advance(out, self.max_num_batched_tokens, proposals)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """ADMIT waiting sequences in the policy's order (fcfs: from the head).

        The admission rule: the FIRST of `order` joins `running` if
          * a seat is free:      seats used + seq.num_seats <= max_num_seqs,
          * budget is left:      it gets min(tokens to compute, budget_left) > 0 tokens,
          * the pool holds them: kv.can_allocate (after prefix-cache hits).
        Otherwise admission stops for this step; nobody after it is considered. The
        admitted leave `waiting`, and the policy hears of the round (lpm's guard counts it).
        """
        if not self.waiting:
            return
        queue = list(self.waiting)
        order = self.policy.order(queue, self.kv_cache_manager.prefix_match_length)
        admitted: list = []
        # BEGIN EXERCISE scheduler_admit: in `order` while seats, budget and blocks allow
        seats_used = self.num_seats_used
        for seq in order:
            if budget <= 0 or seats_used + seq.num_seats > self.max_num_seqs:
                break
            num_tokens, computed_blocks, _ = self._plan_row(seq, budget)
            if not self._can_allocate(seq, num_tokens, computed_blocks):  # swap-aware
                break
            self._schedule_row(seq, num_tokens, computed_blocks, out)
            admitted.append(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seats_used += seq.num_seats
            out.admitted.append(seq.seq_id)
            budget -= num_tokens
        # END EXERCISE
        if admitted:
            left = {seq.seq_id for seq in admitted}
            self.waiting = collections.deque(s for s in queue if s.seq_id not in left)
        self.policy.on_admitted(queue, admitted)
