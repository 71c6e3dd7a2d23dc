"""A draft token's life, from proposal to rollback, in one place (speculative decoding).

Draft tokens never live on a `Sequence`: `seq.token_ids` holds accepted tokens only, so
prefix hashing, the stop rules and the n-gram lookup only ever see accepted tokens. A draft
exists for exactly one engine step, and travels through it as a value:

    1. PROPOSE   engine.propose() -> Proposals          refserve/spec_decode/speculator.py
                 {seq_id: Proposal(token_ids, draft_probs)} for each decode-ready sequence
    2. TRIM      scheduler.schedule(proposals)           scheduler/scheduler.py: _plan_row
                 `drafts_that_fit` says how many drafts the row's token budget leaves room
                 for (it changes nothing); `_add_row` records them on the row:
                 row.draft_token_ids = the first n drafts, row.num_logits = n + 1. A draft
                 that did not fit is simply never computed; a row whose slots do not fit
                 drops its drafts before anyone is preempted.
    3. VERIFY    engine.sample(out, logits, proposals)   refserve/sampling/verify.py
                 the target's n + 1 distributions p and the drafts' q (`verify_inputs`)
                 go to backend.rejection_sample: accepted drafts + one recovered or bonus
                 token come back in SampledTokens.token_ids.
    4. KEEP / ROLL BACK   scheduler.update(out, sampled)   scheduler/scheduler.py
                 the emitted tokens are appended one by one under the stop rules (a stop
                 inside the accepted run drops the rest); then the roll back: every query
                 position past the last appended token (rejected drafts, tokens after a
                 stop) stays un-computed (num_computed_tokens = num_tokens - 1) and the
                 blocks that held only such slots go back to the pool (kv.trim).
                 `count_verified` turns the row into the metrics' proposed / accepted
                 counts.

Nothing else reads or writes draft tokens; the runner reads `row.draft_token_ids` to build
the row's query tokens (model_runner.py: `prepare`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from refserve.scheduler.output import ScheduledSequence


@dataclass(frozen=True)
class Proposal:
    """Draft tokens x_1..x_n for one sequence, and q: [n, V] float32 warped draft
    distributions (row i is the q x_{i+1} was drawn from), or None = one-hot q (n-gram)."""

    token_ids: tuple[int, ...]
    draft_probs: np.ndarray | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))

    def truncated(self, n: int) -> Proposal:
        """The first n drafts (and their q rows)."""
        q = None if self.draft_probs is None else self.draft_probs[:n]
        return Proposal(self.token_ids[:n], q)


Proposals = dict  # seq_id -> Proposal: one step's drafts, the propose stage's result
NO_PROPOSALS: Proposals = {}  # a step without speculative decoding


def drafts_that_fit(num_drafts: int, real_left: int, budget: int) -> int:
    """2. TRIM: how many of a sequence's `num_drafts` drafts its row can verify, when
    `real_left` real tokens remain to be computed and `budget` tokens are left in the step.

    Drafts ride after the real tokens, so they get what the budget leaves:
    min(num_drafts, max(0, budget - real_left)). Pure: changes nothing."""
    return min(num_drafts, max(0, budget - real_left))


def verify_inputs(row: ScheduledSequence, proposals: Proposals
                  ) -> tuple[tuple[int, ...], np.ndarray | None]:
    """3. VERIFY: the drafts the row computed and the q they were drawn from (None: one-hot
    q). The row verifies a prefix of its sequence's proposal, never anything else."""
    proposal = proposals[row.seq.seq_id].truncated(len(row.draft_token_ids))
    assert proposal.token_ids == row.draft_token_ids, "a verify row's drafts are its proposal's"
    return proposal.token_ids, proposal.draft_probs


def count_verified(num_drafts: int, num_emitted: int, num_kept: int) -> tuple[int, int]:
    """4. The metrics of one verify row: (drafts proposed, drafts accepted).

    A verify row of `num_drafts` drafts emits `num_emitted` = accepted + 1 tokens, of which
    the stop rules kept `num_kept`. Normally all are kept: (num_drafts, num_emitted - 1).
    A stop inside the run keeps fewer; the drafts past the stop were never needed, so the
    row counts as a verify of num_kept - 1 drafts, all accepted. Either way

        tokens kept = 1 + drafts accepted          (one target pass, plus its accepted drafts)

    so a request's output tokens = target passes + drafts accepted, exactly."""
    if num_kept >= num_emitted:
        return num_drafts, num_emitted - 1
    return num_kept - 1, num_kept - 1
