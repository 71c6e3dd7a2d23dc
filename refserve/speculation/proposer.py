"""The proposal stage's interface, and the n-gram proposer behind it.

The engine's first stage of a step (`LLMEngine.propose`, through speculation/speculator.py)
asks a proposer for draft tokens for every running, decode-ready sequence
(num_computed_tokens == num_tokens - 1: its next step would be a one-token decode):

    proposals = proposer.propose(seqs, num_drafts)      # at most num_drafts[i] for seqs[i]

A `Proposal` (scheduler/drafts.py, where a draft's whole life is told) carries the draft
tokens x_1..x_n and the draft distributions q_1..q_n they were drawn from, already warped
with the request's temperature / top-k / top-p (the rejection test must see the q the tokens
really came from), or None when q is one-hot at each draft (n-gram). A proposer may keep
state per sequence (a draft model's KV cache); `release` tells it which sequences are still
alive, so it frees the rest (finished, aborted, preempted).

    draft_cost_per_token   what one draft token costs, relative to one target decode step;
                           the adaptive rule (spec_decode/adaptive.py) weighs it against
                           acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING

from refserve.scheduler.drafts import Proposal
from refserve.spec_decode import ngram_proposer

if TYPE_CHECKING:
    from refserve.sequence import Sequence


class Proposer:
    """Interface: see the module docstring."""

    method = ""
    draft_cost_per_token = 0.0

    def propose(self, seqs: SequenceOf[Sequence], num_drafts: SequenceOf[int]
                ) -> list[Proposal]:
        raise NotImplementedError

    def release(self, live_seq_ids: set[int]) -> None:
        """Forget every sequence not in `live_seq_ids`. Stateless proposers keep nothing."""


class NgramProposer(Proposer):
    """Prompt lookup (ngram_proposer.py): copies what followed the latest earlier occurrence
    of the context's suffix. Costs no model pass, so draft_cost_per_token = 0."""

    method = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, seqs, num_drafts) -> list[Proposal]:
        return [Proposal(ngram_proposer.propose(seq.token_ids, n, self.min_n, self.max_n)
                         if n > 0 else [])
                for seq, n in zip(seqs, num_drafts)]
