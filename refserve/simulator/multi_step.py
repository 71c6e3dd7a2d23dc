"""vLLM V0's multi-step scheduling (--num-scheduler-steps n), around the real scheduler.

vLLM 0.6 (V0 engine) can call its scheduler once and then run the same batch for n
forward passes, each feeding its sampled token to the next on the GPU. Why: the
scheduler, the input preparation and the output processing leave the GPU idle for 5-13 ms
per decode step (the multi-step design's own measurement, cited in bounds.toml), and
multi-step pays them once per n steps.
As vLLM 0.6.0 runs it:

    a round     one scheduler call, then n decode steps of the batch it chose; no sequence
                joins the batch until the round ends (a new request waits in the queue)
    a prefill   a step with prefill rows runs alone, one step (vLLM 0.6.0's scheduler
                gives a prompt's sequence group no lookahead slots, so prompts do not
                join a round)
    outputs     the tokens of a round reach the client together when the round ends (the
                outputs are turned into Python objects once per round): a client sees its
                tokens in bursts of n, one inter-token gap per round

The real scheduler stays unchanged: on a round's continuation steps the waiting queue is
held back (`schedule`), so the running batch decodes and nobody is admitted; a sequence
that finishes mid-round leaves at once (vLLM computes it to the round's end and drops the
extra tokens: a few decode rows this simulation does not price).
"""

from __future__ import annotations

import collections


class MultiStepRounds:
    """Rounds of `num_scheduler_steps` decode steps (module docstring); 1: every step calls
    the scheduler, as without multi-step."""

    def __init__(self, num_scheduler_steps: int = 1) -> None:
        if not isinstance(num_scheduler_steps, int) or num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps={num_scheduler_steps!r}: must be an "
                             "integer >= 1")
        self.num_scheduler_steps = num_scheduler_steps
        self.left = 0  # continuation steps left in the current round

    @property
    def in_round(self) -> bool:
        return self.left > 0

    def schedule(self, sched, proposals):
        """(SchedulerOutput, scheduled): the next step, and whether it called the scheduler
        (False on a round's continuation steps)."""
        if self.left and sched.running:
            held, sched.waiting = sched.waiting, collections.deque()
            try:
                out = sched.schedule(proposals)
            finally:  # preempted sequences went to the head of the (empty) queue
                sched.waiting.extend(held)
            self.left -= 1
            return out, False
        self.left = 0
        out = sched.schedule(proposals)
        if self.num_scheduler_steps > 1 and out.scheduled and all(
                row.num_logits == row.num_scheduled_tokens for row in out.scheduled):
            self.left = self.num_scheduler_steps - 1  # a decode round starts
        return out, True

    def round_ends(self, sched) -> bool:
        """Whether the step just run ends its round (its tokens are delivered now)."""
        if self.left and not sched.running:
            self.left = 0
        return self.left == 0


__all__ = ["MultiStepRounds"]
