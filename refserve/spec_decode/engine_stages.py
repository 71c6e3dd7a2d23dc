"""The engine's speculative-decoding stages, kept apart from the rest of `LLMEngine`.

    engine.propose()        first stage of a step: drafts into seq.spec_token_ids
    engine.num_drafts(seq)  how many drafts a sequence may get now (the k cap)
    engine._count_passes()  after update: target passes, proposed / accepted, adaptive k

`LLMEngine` inherits these; they read the engine's scheduler, proposer, adaptive rule,
requests and max_model_len.
"""

from __future__ import annotations

from refserve.scheduler.output import SampledTokens, SchedulerOutput
from refserve.sequence import Sequence
from refserve.spec_decode.proposer import Proposal


class SpeculationStages:
    def propose(self) -> dict[int, Proposal]:
        """The proposal stage (speculative decoding only; a no-op otherwise): fill
        `seq.spec_token_ids` of every running, decode-ready sequence (num_computed_tokens ==
        num_tokens - 1) with the proposer's drafts; returns them by seq_id. How many: see
        `num_drafts`. The scheduler then schedules them after the real token (a verify
        row), or drops those that do not fit the step's token budget or the pool; drafts of
        preempted or retired sequences are dropped by the scheduler, and their proposer
        state (a draft model's shadow sequence) is released here, on the next call."""
        self._proposals = {}
        if self.proposer is None:
            return {}
        running = self.scheduler.running
        live = {seq.seq_id for seq in running}
        self.proposer.release(live)
        self.adaptive.forget_all_but(live)
        seqs, counts = [], []
        for seq in running:
            seq.spec_token_ids.clear()  # drafts a step never scheduled are stale
            n = self.num_drafts(seq)
            if n > 0:
                seqs.append(seq)
                counts.append(n)
        if not seqs:
            return {}
        for seq, proposal in zip(seqs, self.proposer.propose(seqs, counts)):
            if proposal.token_ids:
                seq.spec_token_ids.extend(proposal.token_ids)
                self._proposals[seq.seq_id] = proposal
        return self._proposals

    def num_drafts(self, seq: Sequence) -> int:
        """How many drafts `seq` may get now: 0 unless it is decode-ready and its params
        allow speculation (no penalties, no logprobs, min_tokens already reached: those
        need per-position logits processing the verify step does not do; a parent about to
        fork samples its first token plainly). Otherwise the adaptive rule's k' (at most k),
        capped so that the k' drafts and the recovered or bonus token exceed neither the
        remaining max_tokens nor max_model_len: k' <= remaining - 1."""
        sp = seq.sampling_params
        if (seq.num_computed_tokens != seq.num_tokens - 1 or seq.awaiting_fork
                or sp.has_penalties or sp.logprobs is not None
                or seq.num_output_tokens < sp.min_tokens):
            return 0
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.max_model_len
        room = min(max_tokens - seq.num_output_tokens,
                   self.max_model_len - seq.num_tokens) - 1
        if room < 1:
            return 0
        return min(self.adaptive.num_drafts(seq.seq_id), room)

    def _count_passes(self, out: SchedulerOutput, sampled: SampledTokens) -> None:
        """Per-request metrics of the step just applied: one target pass per sampling row;
        for a verify row, drafts proposed (num_logits - 1) and accepted (tokens emitted - 1),
        which also feed the adaptive rule."""
        for row in out.scheduled:
            seq = row.seq
            tokens = sampled.token_ids.get(seq.seq_id)
            req = self.requests.get(seq.request_id)
            if row.is_padding or not row.samples or tokens is None or req is None:
                continue
            m = req.metrics
            m.num_target_passes += 1
            if row.num_logits > 1:
                proposed, accepted = row.num_logits - 1, len(tokens) - 1
                m.num_spec_verify_steps += 1
                m.num_spec_proposed += proposed
                m.num_spec_accepted += accepted
                self.adaptive.observe(seq.seq_id, proposed, accepted)
