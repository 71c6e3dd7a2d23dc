"""vLLM V0's prefill-first schedule (enable_chunked_prefill=False), beside the mixed one.

    mixed (Scheduler)      the decodes go first and prefill chunks fill what is left of the
                           budget, so a long prompt never stalls a running decode for long
                           (with a small budget or long_prefill_token_threshold: chunked)
    prefill-first (here)   a step that schedules prefill work runs prefills only
                           (unfinished prefills of running sequences, then admissions, up
                           to the token budget); every decode waits for a step that
                           schedules no prefill (vLLM V0: no decodes once prefills are
                           scheduled)

TTFT falls (a prompt never shares its step with the decodes), and each running request's next
token waits behind every prefill step: TPOT rises with the arrival rate. Unlike V0, which
refuses a budget below max_model_len, a prompt longer than the budget is still split over
consecutive steps (each of them prefill-only).
"""

from __future__ import annotations

from collections.abc import Mapping

from refserve.scheduler.drafts import NO_PROPOSALS, Proposal
from refserve.scheduler.output import SchedulerOutput
from refserve.scheduler.scheduler import Scheduler


class PrefillFirstScheduler(Scheduler):
    """Prefill-only steps while there is prefill work (see the module docstring)."""

    def schedule(self, proposals: Mapping[int, Proposal] = NO_PROPOSALS) -> SchedulerOutput:
        """First the running sequences whose prefill is unfinished, then ADMIT (not in a
        step that preempted); if that scheduled anything, the decodes wait. Otherwise a
        decode step: ADVANCE every running sequence. A prefill that finds no room preempts
        (maybe itself) and schedules nothing, so the decodes still run: a step always
        schedules something."""
        out = self._begin_step()
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        budget = self._advance(out, self.max_num_batched_tokens, seqs=prefilling)
        if self.waiting and not out.preempted:
            self._admit(out, budget)
        if not out.scheduled:
            self._advance(out, self.max_num_batched_tokens, proposals)
        return self._end_step(out)
