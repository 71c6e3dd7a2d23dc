"""What the simulated "model" emits: the request's own next tokens, and with speculative
decoding a drawn number of accepted drafts (the real draft bookkeeping around it).

`SyntheticOutputs` is the simulator's only stand-in for the forward pass and the sampler:
each sampling row appends the request's next output token. `SimulatedSpeculation`
replaces it when the engine config has a speculative_config.

The model's tokens are not simulated, so neither is whether a draft matches them. Instead
each request has an acceptance rate alpha (`SimRequest.spec_alpha`, else the engine's
default, `--spec-alpha`), and every draft of a verify row is accepted independently with
probability alpha until the first rejection (Leviathan et al.). With n drafts in the row

    P(A >= i) = alpha^i  (i <= n),  A = min(G, n),  G ~ Geometric: accepts before a reject

and the row emits A + 1 tokens: the accepted drafts and one recovered token, or the bonus
token when all n passed. On average (1 - alpha^(n+1)) / (1 - alpha) tokens per verify row
(`metrics.expected_tokens_per_pass`).

Everything else is the real engine's: `Speculator` (spec_decode/speculator.py) decides who
proposes and how many (decode-ready sequences, k capped by max_tokens and max_model_len,
the adaptive rule of spec_decode/adaptive.py); `scheduler.schedule(proposals)` trims the
drafts to the token budget and records them on the row (scheduler/drafts.py);
`scheduler.update` appends the emitted tokens, rolls back the rejected positions' KV slots
and counts (proposed, accepted). The drafts "proposed" here are the request's own next
output tokens (their ids matter to nobody: drafts are never hashed or stored).

Cost. The verify row is priced by the cost model like any row (q = n + 1 query tokens,
n + 1 logits rows). The drafts themselves cost nothing for "ngram" (prompt lookup runs no
model); a "draft_model" runs n passes of the draft over the proposing rows before the step:

    draft seconds = sum_{i=1..n_max} draft_cost.time(one decode row per sequence still
                                                     drafting at position i, no scheduler
                                                     call: the passes run inside the step)

with the draft's own cost model: "self" is the target's first num_draft_layers layers (and
its lm_head), any other `model` a capacity preset or HF config.json (refserve.simulator
.hardware.load_model). The adaptive rule's pass cost comes from the target's cost model, as
the real engine measures it at start-up (`AdaptiveSpeculation.calibrate`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from refserve.scheduler.drafts import Proposal, Proposals
from refserve.simulator.cost_model import CostModel, StepComposition
from refserve.spec_decode.adaptive import CALIBRATION_ROWS, AdaptiveSpeculation, PassCost
from refserve.spec_decode.proposer import Proposer
from refserve.spec_decode.registry import resolve as resolve_proposer
from refserve.spec_decode.speculator import Speculator

PASS_COST_CONTEXT = 512  # context length of the decode rows the adaptive rule's pass is priced at


def accepted_drafts(rng: np.random.Generator, alpha: float, num_drafts: int) -> int:
    """A ~ min(Geometric, n): drafts accepted before the first rejection (module docstring)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"spec_alpha={alpha!r}: must be in [0, 1]")
    if alpha == 1.0:
        return num_drafts
    # numpy's geometric counts trials up to and including the first success (a rejection,
    # probability 1 - alpha): minus one is the accepted run.
    return min(int(rng.geometric(1.0 - alpha)) - 1, num_drafts)


def draft_model_shape(spec, target):
    """The draft's ModelShape for a proposer that runs a model (registry: runs_a_model): the
    target's first num_draft_layers layers (model "self", whose weights are the target's),
    else the preset / config.json `model`. Raises ValueError if it cannot be loaded or its
    vocabulary differs from the target's."""
    model = spec.options["model"]
    if model == "self":
        d = spec.options["num_draft_layers"]
        if d > target.num_layers:
            raise ValueError(f"speculative_config.num_draft_layers={d}: the target has only "
                             f"{target.num_layers} layers")
        layer_params = target.layer_params * d // target.num_layers
        return dataclasses.replace(
            target, name=f"{target.name} (first {d} layers)", num_layers=d,
            layer_params=layer_params,
            total_params=target.total_params - target.layer_params + layer_params)
    from refserve.simulator.hardware import load_model

    draft = load_model(model)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model {model!r}: vocabulary "
                         f"{draft.vocab_size} differs from the target's {target.vocab_size}")
    return draft


class SyntheticOutputs:
    """No speculation: each sampling row appends the request's next output token.

    The engine calls, per step: `propose(running, request_of)` before schedule() ->
    (proposals, seconds the drafts took), `sample(row, request)` for each sampling row,
    `observe(update)` after scheduler.update."""

    def propose(self, running, request_of) -> tuple[Proposals, float]:
        return {}, 0.0

    def sample(self, row, request) -> list[int]:
        return [request.output_token_ids[row.seq.num_output_tokens]]

    def observe(self, update) -> None:
        """Nothing to learn without speculation."""


class _NextTokensProposer(Proposer):
    """Drafts = the request's own next output tokens (their ids are never checked)."""

    method = "simulated"

    def __init__(self, draft_cost_per_token: float) -> None:
        self.draft_cost_per_token = draft_cost_per_token
        self.request_of: dict = {}  # seq_id -> SimRequest, the engine's (set each step)

    def propose(self, seqs, num_drafts) -> list[Proposal]:
        proposals = []
        for seq, n in zip(seqs, num_drafts):
            i = seq.num_output_tokens
            proposals.append(Proposal(self.request_of[seq.seq_id].output_token_ids[i:i + n]))
        return proposals


class SimulatedSpeculation(SyntheticOutputs):
    """The simulator's outputs with speculative decoding (module docstring)."""

    def __init__(self, spec, cost_model: CostModel, max_model_len: int,
                 max_num_batched_tokens: int, alpha: float = 0.7, seed: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"spec_alpha={alpha!r}: must be in [0, 1]")
        self.spec, self.alpha = spec, alpha
        self.cost_model = cost_model
        self.draft_cost = None
        draft_cost_per_token = 0.0
        if resolve_proposer(spec)[0].runs_a_model:
            self.draft_model = draft_model_shape(spec, cost_model.model)
            self.draft_cost = CostModel(self.draft_model, cost_model.gpu, cost_model.dtype,
                                        cost_model.tp, cost_model.eff)
            # A draft pass runs inside the target's step: no scheduler call of its own.
            one = StepComposition.from_rows([(1, PASS_COST_CONTEXT, 1)])
            draft_pass = StepComposition.from_rows([(1, PASS_COST_CONTEXT, 1)], scheduled=False)
            draft_cost_per_token = self.draft_cost.time(draft_pass) / cost_model.time(one)
        rows = [r for r in CALIBRATION_ROWS if r <= max_num_batched_tokens]
        pass_cost = PassCost(tuple(rows), tuple(
            cost_model.time(StepComposition.from_rows([(1, PASS_COST_CONTEXT, 1)] * r))
            for r in rows))
        adaptive = AdaptiveSpeculation(spec.k, draft_cost_per_token, enabled=spec.adaptive,
                                       pass_cost=pass_cost)
        self.proposer = _NextTokensProposer(draft_cost_per_token)
        self.speculator = Speculator(self.proposer, adaptive, max_model_len)
        self.rng = np.random.default_rng([seed, 18])

    def propose(self, running, request_of) -> tuple[Proposals, float]:
        self.proposer.request_of = request_of
        proposals = self.speculator.propose(running)
        return proposals, self._draft_seconds(running, proposals)

    def sample(self, row, request) -> list[int]:
        i = row.seq.num_output_tokens
        n = len(row.draft_token_ids)
        if n == 0:
            return [request.output_token_ids[i]]
        alpha = self.alpha if request.spec_alpha is None else request.spec_alpha
        return request.output_token_ids[i:i + accepted_drafts(self.rng, alpha, n) + 1]

    def observe(self, update) -> None:
        self.speculator.observe(update)

    def _draft_seconds(self, running, proposals: Proposals) -> float:
        if self.draft_cost is None or not proposals:
            return 0.0
        by_id = {seq.seq_id: seq for seq in running}
        lengths = [(by_id[sid].num_tokens, len(p.token_ids)) for sid, p in proposals.items()]
        seconds = 0.0
        for i in range(max(n for _, n in lengths)):  # draft pass i: one row per drafter
            rows = [(1, ctx + i, 1) for ctx, n in lengths if n > i]
            seconds += self.draft_cost.time(StepComposition.from_rows(rows, scheduled=False))
        return seconds
