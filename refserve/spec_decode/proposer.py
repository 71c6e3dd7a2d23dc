"""The proposal stage's interface: what every speculative decoding proposer is.

The engine's first stage of a step (`LLMEngine.propose`, through spec_decode/speculator.py)
asks its proposer for draft tokens for every running, decode-ready sequence
(num_computed_tokens == num_tokens - 1: its next step would be a one-token decode):

    proposals = proposer.propose(seqs, num_drafts)      # at most num_drafts[i] for seqs[i]

A `Proposal` (scheduler/drafts.py, where a draft's whole life is told) carries the draft
tokens x_1..x_n and the draft distributions q_1..q_n they were drawn from, already warped
with the request's temperature / top-k / top-p (the rejection test must see the q the tokens
really came from), or None when q is one-hot at each draft (n-gram). A proposer may keep
state per sequence (a draft model's KV cache); `release_all_except` tells it which sequences
are still alive, so it frees the rest (finished, aborted, preempted).

A proposer is one file: a subclass that names its speculative_config `method` and its own
`options` (keys with their defaults), checks them (`check_options`), and builds itself
(`load`, before the KV pool is sized, then `create`); registry.py lists the subclasses.

    draft_cost_per_token   what one draft token costs, relative to one target decode step;
                           the adaptive rule (spec_decode/adaptive.py) weighs it against
                           acceptance.
    runs_a_model           whether each draft position is one pass of a draft model (what
                           the simulator prices: simulator/outputs.py)
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING, ClassVar

from refserve.scheduler.drafts import Proposal

if TYPE_CHECKING:
    from refserve.sequence import Sequence


class Proposer:
    """Interface: see the module docstring."""

    method: ClassVar[str] = ""
    options: ClassVar[dict] = {}       # its speculative_config keys -> defaults
    runs_a_model: ClassVar[bool] = False
    draft_cost_per_token = 0.0

    @classmethod
    def check_options(cls, options: dict, config=None) -> dict:
        """The method's options (every key of `options`, the user's value or the default),
        checked: a ValueError names the key and what to write. `config`: the EngineConfig,
        for rules that involve other settings."""
        return dict(options)

    @classmethod
    def load(cls, spec, target, backend, dtype, tokenizer, max_model_len: int):
        """What must exist before the KV pool is sized: (draft model or None, its cost per
        token relative to the target). Nothing for a proposer that runs no model."""
        return None, 0.0

    @classmethod
    def create(cls, spec, loaded, backend, num_blocks: int, block_size: int
               ) -> Proposer:
        """The proposer of an engine whose KV pool has `num_blocks` blocks; `loaded` is what
        `load` returned."""
        raise NotImplementedError

    @classmethod
    def describe(cls, spec) -> str:
        """How the start-up line names it."""
        return cls.method

    def propose(self, seqs: SequenceOf[Sequence], num_drafts: SequenceOf[int]
                ) -> list[Proposal]:
        raise NotImplementedError

    def release_all_except(self, live_seq_ids: set[int]) -> None:
        """Forget every sequence not in `live_seq_ids`. Stateless proposers keep nothing."""
