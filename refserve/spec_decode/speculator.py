"""The engine's speculative-decoding stage: who gets drafts, how many, and what each verify
step teaches the adaptive rule.

    proposals = speculator.propose(scheduler.running)   # engine.propose(): the first stage
    ...  schedule(proposals) / prepare / forward / sample(out, logits, proposals) / update
    speculator.observe(step_update)                     # engine.finish_step(): adaptive k

The drafts themselves are values that live for one step (refserve/scheduler/drafts.py has
their whole life). The speculator keeps only what must outlive a step: the proposer's
per-sequence state (a draft model's shadow sequences) and the adaptive rule's acceptance
estimates, both forgotten for sequences that are no longer running.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from refserve.scheduler.drafts import Proposals
from refserve.scheduler.output import StepUpdate
from refserve.sequence import Sequence
from refserve.spec_decode.adaptive import AdaptiveSpeculation
from refserve.spec_decode.cost_probe import dense_seconds
from refserve.spec_decode.proposer import Proposer


class Speculator:
    """A proposer, the adaptive rule and the k cap (see the module docstring)."""

    def __init__(self, proposer: Proposer, adaptive: AdaptiveSpeculation,
                 max_model_len: int) -> None:
        self.proposer = proposer
        self.adaptive = adaptive
        self.max_model_len = max_model_len

    @classmethod
    def create(cls, proposer_cls: type[Proposer], spec, loaded, target, backend,
               num_blocks: int, block_size: int, max_model_len: int,
               max_num_batched_tokens: int) -> Speculator:
        """The speculator of an engine: its proposer (`loaded` = what `proposer_cls.load`
        returned: the draft model and its cost per token) and the adaptive rule, calibrated
        on the target's dense products up to the step's token budget (a verify step's
        cost, adaptive.py)."""
        proposer = proposer_cls.create(spec, loaded, backend, num_blocks, block_size)
        adaptive = AdaptiveSpeculation(spec.k, loaded[1], enabled=spec.adaptive)
        adaptive.calibrate(lambda rows, repeats: dense_seconds(target, rows, repeats),
                           max_num_batched_tokens)
        return cls(proposer, adaptive, max_model_len)

    def propose(self, running: SequenceOf[Sequence]) -> Proposals:
        """The proposal stage: drafts for every running sequence that may get some
        (`room`, then the adaptive rule), by seq_id. Sequences not running any more are
        forgotten first (a draft model's shadow gives back its blocks). Changes no
        Sequence."""
        live = {seq.seq_id for seq in running}
        self.proposer.release_all_except(live)
        rooms = [(seq, self.room(seq)) for seq in running]
        self.adaptive.begin_step(live, drafting={seq.seq_id for seq, r in rooms if r > 0})
        seqs, counts = [], []
        for seq, room in rooms:
            n = min(self.adaptive.num_drafts(seq.seq_id), room) if room > 0 else 0
            if n > 0:
                seqs.append(seq)
                counts.append(n)
        if not seqs:
            return {}
        return {seq.seq_id: proposal
                for seq, proposal in zip(seqs, self.proposer.propose(seqs, counts))
                if proposal.token_ids}

    def room(self, seq: Sequence) -> int:
        """The most drafts `seq` may get now: 0 unless it is decode-ready and its params
        allow speculation (no penalties, logit_bias, allowed_token_ids or bad_words
        (`rewrites_logits`), no logprobs, and min_tokens already reached: those
        need per-position logits processing the verify step does not do; a parent about to
        fork samples its first token plainly). Otherwise as many as keep the drafts and the
        recovered or bonus token within the remaining max_tokens and max_model_len:
        remaining - 1. The adaptive rule's k' (at most k) is then capped by it."""
        sp = seq.sampling_params
        if (seq.num_computed_tokens != seq.num_tokens - 1 or seq.awaiting_fork
                or sp.rewrites_logits or sp.logprobs is not None
                or seq.num_output_tokens < sp.min_tokens):
            return 0
        room = sp.max_output_tokens(seq.num_prompt_tokens, self.max_model_len)
        return max(room - seq.num_output_tokens - 1, 0)

    def observe(self, update: StepUpdate) -> None:
        """After update: each verify row's (proposed, accepted) feeds the adaptive rule."""
        for seq_id, (proposed, accepted) in update.verified.items():
            self.adaptive.observe(seq_id, proposed, accepted)
