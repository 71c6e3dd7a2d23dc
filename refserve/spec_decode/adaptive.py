"""Don't lose speed to speculation: per request, how many draft tokens to propose next.

A verify step with k' drafts emits on average E(α, k') = (1 - α^(k'+1)) / (1 - α) tokens
(Leviathan et al.; `metrics.expected_tokens_per_pass`) and costs, relative to a plain decode
step, about

    cost(0)  = 1
    cost(k') = 1 + VERIFY_OVERHEAD + k' · (VERIFY_COST_PER_TOKEN + draft_cost_per_token)

VERIFY_OVERHEAD: what going from 1 to several query tokens costs by itself. In theory ~0 (a
small-batch decode is bound by reading the weights, which a verify reads once for all k'+1
tokens); on the NumPy backend it is not: OpenBLAS multiplies a 1-row activation with its
matrix-vector kernel (gemv) but 2-8 rows with its general kernel (sgemm), slower for that
tiny shape. Calibrated end to end on `python -m refserve.bench spec` (SmolLM2-135M, 2-core
SkylakeX, k = 4, adaptive off): n-gram on the quote-heavy prompt needed 0.37 target passes
per output token and ran 2.03x faster, so one verify pass cost about 1 / (0.37 x 2.03) =
1.33 plain passes. (Isolated micro-benchmarks of one forward put it higher, up to 2.5x; they
are noisier on a shared machine.)
VERIFY_COST_PER_TOKEN: each further query token (attention, the logits row, the warp).
draft_cost_per_token: one draft forward per draft token, relative to the target's
(0 for the n-gram proposer; about num_draft_layers / num_layers for a self-draft).

THE RULE. Each sequence keeps a running estimate α̂ of its acceptance, and before each step
proposes k' = argmax over k' in 0..k of E(α̂, k') / cost(k')   (ties: the smaller k'). So k
shrinks as acceptance falls, and at k' = 0 the sequence stops speculating: a low-acceptance
request decodes at plain speed, minus the probes below.

    α̂ = (A + PRIOR_ALPHA · PRIOR_WEIGHT) / (T + PRIOR_WEIGHT)

where T counts the accept tests a verify step ran (accepted drafts + 1 if one was rejected:
drafts after a rejection were never tested) and A the passed ones, both discounted by DECAY
per verify step so the estimate follows a request whose text changes character (a quote ends,
free text starts). The prior lets a fresh request speculate at full k until evidence arrives.

Stopping must not be forever (acceptance changes when, e.g., the model starts quoting), so a
sequence at k' = 0 for PROBE_EVERY consecutive steps probes once with PROBE_TOKENS drafts;
a probe's outcome updates α̂ like any verify step. A probe costs cost(PROBE_TOKENS) - 1 extra
decode steps (0.4 with the constants below), so with PROBE_EVERY = 30 a request whose
drafts are never accepted runs under 2% slower than without speculation.

All constants are here and nowhere else; tests/test_spec_adaptive.py pins the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from refserve.spec_decode.metrics import expected_tokens_per_pass

VERIFY_OVERHEAD = 0.3         # a several-token pass vs a 1-token pass, minus 1 (see above)
VERIFY_COST_PER_TOKEN = 0.05  # extra cost of one more query token in a target pass
PRIOR_ALPHA = 0.8             # α assumed before a request has been tested (optimistic: try)
PRIOR_WEIGHT = 1.0            # ... worth this many accept tests
DECAY = 0.9                   # weight of the past per verify step (≈ last 10 steps count)
PROBE_EVERY = 30              # steps at k' = 0 before one probe
PROBE_TOKENS = 2              # drafts in a probe


def best_num_drafts(alpha: float, k: int, cost_per_draft: float,
                    overhead: float = VERIFY_OVERHEAD) -> int:
    """argmax over k' in 0..k of E(α, k') / cost(k'), cost(0) = 1 and
    cost(k') = 1 + overhead + k' · cost_per_draft; the smaller k' on ties."""
    best, best_rate = 0, 1.0
    for kk in range(1, k + 1):
        rate = expected_tokens_per_pass(alpha, kk) / (1.0 + overhead + kk * cost_per_draft)
        if rate > best_rate + 1e-12:
            best, best_rate = kk, rate
    return best


@dataclass
class _State:
    accepted: float = 0.0    # discounted passed accept tests (A)
    tested: float = 0.0      # discounted accept tests (T)
    idle_steps: int = 0      # consecutive steps at k' = 0

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_ALPHA * PRIOR_WEIGHT) / (self.tested + PRIOR_WEIGHT)


class AdaptiveSpeculation:
    """The rule of the module docstring, per sequence id. `enabled=False`: always k."""

    def __init__(self, k: int, draft_cost_per_token: float = 0.0, enabled: bool = True,
                 overhead: float = VERIFY_OVERHEAD):
        self.k = k
        self.cost_per_draft = VERIFY_COST_PER_TOKEN + draft_cost_per_token
        self.overhead = overhead
        self.enabled = enabled
        self._states: dict[int, _State] = {}

    def alpha(self, seq_id: int) -> float:
        return self._states.get(seq_id, _State()).alpha

    def num_drafts(self, seq_id: int) -> int:
        """How many drafts this sequence should propose now (0: decode plainly). Counts the
        step as idle when the answer is 0."""
        if not self.enabled:
            return self.k
        state = self._states.setdefault(seq_id, _State())
        n = best_num_drafts(state.alpha, self.k, self.cost_per_draft, self.overhead)
        if n > 0:
            state.idle_steps = 0
            return n
        state.idle_steps += 1
        if state.idle_steps > PROBE_EVERY:
            state.idle_steps = 0
            return min(PROBE_TOKENS, self.k)
        return 0

    def observe(self, seq_id: int, num_draft: int, num_accepted: int) -> None:
        """One verify step's result: `num_accepted` of `num_draft` drafts accepted."""
        if num_draft <= 0:
            return
        state = self._states.setdefault(seq_id, _State())
        tests = num_accepted + (1 if num_accepted < num_draft else 0)
        state.accepted = DECAY * state.accepted + num_accepted
        state.tested = DECAY * state.tested + tests

    def forget(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)

    def forget_all_but(self, live: set[int]) -> None:
        for seq_id in [s for s in self._states if s not in live]:
            del self._states[seq_id]


if __name__ == "__main__":
    for overhead in (0.0, VERIFY_OVERHEAD):
        for cost in (0.0, 0.3):
            print(f"verify overhead {overhead}, draft cost per token {cost}: best k' for "
                  f"k = 5 at α = 0.0 .. 1.0")
            print("  ", [best_num_drafts(a / 10, 5, VERIFY_COST_PER_TOKEN + cost, overhead)
                         for a in range(11)])
