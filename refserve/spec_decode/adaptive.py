"""Don't lose speed to speculation: per request, how many draft tokens to propose next.

A verify step with k' drafts emits on average E(α, k') = (1 - α^(k'+1)) / (1 - α) tokens
(Leviathan et al.; refserve/metrics.py, `expected_tokens_per_pass`) and costs, relative to
a plain decode step of the same batch, about

    cost(0)  = 1
    cost(k') = pass(B · (1 + k')) / pass(B) + k' · (VERIFY_COST_PER_TOKEN + draft_cost_per_token)

pass(rows): the seconds of one target forward over `rows` query tokens; B: the sequences
running. A plain step has B rows; a verify step B · (1 + k') when every sequence proposes k',
the case the rule prices (sequences of one workload tend to behave alike).
In theory pass is flat for a few rows: a small-batch step is bound by reading the weights,
which it reads once for all its rows. Measured, it is not quite, and how far depends on the
BLAS kernel and the batch: a 5-row pass of SmolLM2-135M cost 3.2x a 1-row pass as one
OpenBLAS sgemm with the SkylakeX kernel and 3.75x with Haswell, 1.2x with the tuned CPU
backend's compiled kernel over packed weights (refserve/backends/cpu_linear.py; one thread,
loaded machine); at 8 running, 5 rows each are 40 rows, past the bandwidth floor. So pass is
measured when the engine starts (`calibrate`: the target's dense products at
CALIBRATION_ROWS up to the step's token budget, 27 passes, about half a second for SmolLM2
on an idle 2-core CPU; the probe is refserve/spec_decode/cost_probe.py) and interpolated
(`PassCost`). A device backend, whose passes a host clock cannot time, keeps the theory:
flat.
VERIFY_COST_PER_TOKEN: each further query token's cost outside the dense products
(attention, its logits row's warp and accept test), relative to a plain step.
draft_cost_per_token: one draft forward per draft token, relative to the target's
(0 for the n-gram proposer; about num_draft_layers / num_layers for a self-draft).

THE RULE. Each sequence keeps a running estimate α̂ of its acceptance, and before each step
proposes k' = argmax over k' in 0..k of E(α̂, k') / cost(k')   (ties: the smaller k'). So k
shrinks as acceptance falls, and at k' = 0 the sequence stops speculating: a low-acceptance
request decodes at plain speed, minus the probes below.

    α̂ = (A + PRIOR_ALPHA · P) / (T + P)

where T counts the accept tests a verify step ran (accepted drafts + 1 if one was rejected:
drafts after a rejection were never tested) and A the passed ones, both discounted by DECAY
per verify step so the estimate follows a request whose text changes character (a quote ends,
free text starts). The prior, worth P = PRIOR_WEIGHT tests at first, lets a fresh request
speculate at full k until evidence arrives, and is discounted like the evidence: a prior that
kept its weight while the evidence saturates at 1 / (1 - DECAY) = 10 tests would hold α̂ at
PRIOR_ALPHA / 11 = 0.07 for a proposer that is never right, enough to keep one draft a step
alive wherever a verify row costs under 7% of a step.

A draft model's drafts are priced for the batch, not per sequence. Every draft position
is one forward of the draft over all the sequences drafting there, so one sequence that
proposes k' makes the whole step wait for k' draft passes: a fresh request at the prior's
full k, in a batch that had stopped speculating, cost every other sequence k draft passes.
With a draft model (draft_cost_per_token > 0) the batch therefore proposes one k' together:

    k' = argmax over k' in 0..k of  mean_s E(α̂_s, k') / cost(k')

over the running sequences s, the cost being the one above (every sequence proposing k').
The n-gram proposer runs no model: a sequence's drafts cost only its own verify rows, so
each sequence keeps its own k'.

Stopping must not be forever (acceptance changes when, e.g., the model starts quoting), so
while the rule says k' = 0, a sequence probes with PROBE_TOKENS drafts on every
PROBE_EVERY-th engine step, and all stopped sequences probe on the same step; a probe's
outcome updates α̂ like any verify step. `begin_step` is the clock; it restarts when a step
finds none of the sequences of the one before, so a request run alone is probed on the same
steps every time. They probe together because a probe costs the batch, not only its sequence:
with a draft model every draft position is one draft forward over the whole batch, so probes
staggered per sequence (each one's own counter) put a probe in almost every step once
PROBE_EVERY / PROBE_TOKENS sequences had stopped. A probe step costs cost(PROBE_TOKENS) - 1
extra decode steps (0.1-0.4 with the measured pass costs, more with a draft model), so with
PROBE_EVERY = 30 a batch whose drafts are never accepted runs at most
(cost(PROBE_TOKENS) - 1) / PROBE_EVERY, a few percent, slower than without speculation,
whatever its size.

Both measured at GPU scale (`python -m refserve.simulate --model llama-3-8b --gpu
h100-80gb --num-requests 300 --rate 20 --spec-alpha A --speculative-config
'{"method": "draft_model", "model": "self", "num_draft_layers": 8}'`; TPOT p50 without
speculation 7.2 ms): per sequence with staggered probes, 10.3 ms at A = 0.1 and 9.8 ms at
A = 0.5; with both rules, 7.4 ms and 7.1 ms (and 5.4 ms at A = 0.8, where a fixed k = 4
gives 5.6 ms).

All constants are here and nowhere else; tests/test_spec_adaptive.py pins the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refserve.metrics import expected_tokens_per_pass

VERIFY_COST_PER_TOKEN = 0.05  # a further query token's cost outside the dense products
PRIOR_ALPHA = 0.8             # α assumed before a request has been tested (optimistic: try)
PRIOR_WEIGHT = 1.0            # ... worth this many accept tests
DECAY = 0.9                   # weight of the past per verify step (≈ last 10 steps count)
PROBE_EVERY = 30              # while k' = 0: one step in this many is a probe
PROBE_TOKENS = 2              # drafts in a probe
CALIBRATION_ROWS = (1, 2, 3, 5, 8, 16, 24, 40, 64)   # where pass is measured: batch 1 and
CALIBRATION_ROUNDS = 3        # batch 8 with k <= 4; rounds over them, the minimum counts


@dataclass(frozen=True)
class PassCost:
    """pass(rows), the seconds of one target forward over `rows` query tokens, from
    measurements at `rows` (increasing): linear in between, along the last measured slope
    past the last (there the pass is compute-bound and grows with rows). One point: flat."""

    rows: tuple[int, ...] = (1,)
    seconds: tuple[float, ...] = (1.0,)

    def __call__(self, rows: float) -> float:
        r, s = self.rows, self.seconds
        if rows <= r[-1] or len(r) == 1:
            return float(np.interp(rows, r, s))
        slope = max((s[-1] - s[-2]) / (r[-1] - r[-2]), 0.0)
        return s[-1] + slope * (rows - r[-1])

    def ratio(self, batch: int, num_drafts: int) -> float:
        """pass(batch · (1 + num_drafts)) / pass(batch): a verify step over a plain one."""
        return self(batch * (1 + num_drafts)) / self(batch)


FLAT = PassCost()   # the theory: a few-row pass costs what a 1-row pass does


def measure_pass_cost(dense_seconds, max_rows: int) -> PassCost | None:
    """pass at CALIBRATION_ROWS up to `max_rows`, from `dense_seconds(rows, repeats)`
    ({rows: seconds per repeat} of every layer's and the lm_head's products, or None:
    spec_decode/cost_probe.dense_seconds for the target), CALIBRATION_ROUNDS rounds over
    the row counts: the minimum per row count (a shared machine only ever adds time), made
    non-decreasing (more rows never cost less). All layers are timed: a slice of them
    scaled up is cheaper but amplifies the noise (a 5-row pass came out 2.2x a 1-row
    pass where whole forwards measured 1.4x). None if the passes cannot be timed (a device
    backend)."""
    rows = [r for r in CALIBRATION_ROWS if r <= max(max_rows, 1)]
    times = dense_seconds(rows, repeats=CALIBRATION_ROUNDS)
    if times is None:
        return None
    seconds = np.maximum.accumulate([min(times[r]) for r in rows])
    return PassCost(tuple(rows), tuple(float(s) for s in seconds))


def best_num_drafts(alpha, k: int, cost_per_draft: float, pass_ratio=lambda n: 1.0) -> int:
    """argmax over k' in 0..k of E(α, k') / cost(k'), cost(0) = 1 and
    cost(k') = pass_ratio(k') + k' · cost_per_draft; the smaller k' on ties. `alpha` may be
    a list (a batch drafting one k' together): E is then the mean of E(α_s, k')."""
    alphas = [alpha] if np.isscalar(alpha) else list(alpha)
    if not alphas:
        return 0
    best, best_rate = 0, 1.0
    for kk in range(1, k + 1):
        gain = sum(expected_tokens_per_pass(a, kk) for a in alphas) / len(alphas)
        rate = gain / (pass_ratio(kk) + kk * cost_per_draft)
        if rate > best_rate + 1e-12:
            best, best_rate = kk, rate
    return best


@dataclass
class _State:
    accepted: float = 0.0    # discounted passed accept tests (A)
    tested: float = 0.0      # discounted accept tests (T)
    prior: float = PRIOR_WEIGHT   # the prior's discounted weight (P)

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_ALPHA * self.prior) / (self.tested + self.prior)


class AdaptiveSpeculation:
    """The rule of the module docstring, per sequence id. `enabled=False`: always k."""

    def __init__(self, k: int, draft_cost_per_token: float = 0.0, enabled: bool = True,
                 pass_cost: PassCost = FLAT):
        self.k = k
        self.cost_per_draft = VERIFY_COST_PER_TOKEN + draft_cost_per_token
        self.shared = draft_cost_per_token > 0   # a draft model: the batch's one k'
        self._batch_k = 0        # that k', set by begin_step
        self.enabled = enabled
        self.pass_cost = pass_cost
        self.batch = 1           # sequences running, as of the last begin_step
        self.steps = 0           # the probes' clock: steps since the batch was last empty
        self._states: dict[int, _State] = {}

    def calibrate(self, dense_seconds, max_rows: int) -> None:
        """Measure pass (the module docstring) up to `max_rows` rows with the target's
        `dense_seconds(rows, repeats)` (`measure_pass_cost`): the engine calls this once at
        start-up. Nothing to do when the rule is off."""
        if self.enabled and self.k > 0:
            self.pass_cost = measure_pass_cost(dense_seconds, max_rows) or FLAT

    def cost(self, num_drafts: int, batch: int | None = None) -> float:
        """cost(k') at `batch` running (default: the current batch)."""
        if num_drafts == 0:
            return 1.0
        ratio = self.pass_cost.ratio(batch or self.batch, num_drafts)
        return ratio + num_drafts * self.cost_per_draft

    def best(self, alpha, batch: int | None = None) -> int:
        """k' for acceptance `alpha` (or the mean over a list) at `batch` running (default:
        the current batch)."""
        b = batch or self.batch
        return best_num_drafts(alpha, self.k, self.cost_per_draft,
                               lambda n: self.pass_cost.ratio(b, n))

    def alpha(self, seq_id: int) -> float:
        return self._states.get(seq_id, _State()).alpha

    def num_drafts(self, seq_id: int) -> int:
        """How many drafts this sequence should propose now (0: decode plainly): its own k',
        or with a draft model the batch's (set by begin_step). When that is 0:
        PROBE_TOKENS on a probe step (every PROBE_EVERY-th begin_step, the same step for
        every sequence), else 0."""
        if not self.enabled:
            return self.k
        state = self._states.setdefault(seq_id, _State())
        n = self._batch_k if self.shared else self.best(state.alpha)
        if n > 0:
            return n
        return min(PROBE_TOKENS, self.k) if self.is_probe_step else 0

    @property
    def is_probe_step(self) -> bool:
        return self.steps > 0 and self.steps % PROBE_EVERY == 0

    def observe(self, seq_id: int, num_draft: int, num_accepted: int) -> None:
        """One verify step's result: `num_accepted` of `num_draft` drafts accepted."""
        if num_draft <= 0:
            return
        state = self._states.setdefault(seq_id, _State())
        tests = num_accepted + (1 if num_accepted < num_draft else 0)
        state.accepted = DECAY * state.accepted + num_accepted
        state.tested = DECAY * state.tested + tests
        state.prior *= DECAY

    def forget(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)

    def begin_step(self, live: set[int], drafting: set[int] | None = None) -> None:
        """Once per engine step, before its num_drafts calls, with the running sequences'
        ids: advances the probes' clock, sets the batch the rule prices (len(live)), drops
        the state of sequences no longer running and, with a draft model, sets the batch's
        one k' (the module docstring) from the sequences that may draft this step
        (`drafting`, default all of `live`: one prefilling, or asking for logprobs, has no
        say)."""
        if not any(seq_id in live for seq_id in self._states):
            self.steps = 0   # a new busy period: a request run alone probes on the same steps
        self.steps += 1
        self.batch = max(len(live), 1)
        for seq_id in [s for s in self._states if s not in live]:
            del self._states[seq_id]
        if self.shared and self.enabled:
            self._batch_k = self.best([self.alpha(s) for s in
                                       (live if drafting is None else drafting)])


if __name__ == "__main__":
    for name, cost in (("flat", FLAT), ("a 5-row pass = 3.2 1-row passes",
                                        PassCost((1, 5), (1.0, 3.2)))):
        rule = AdaptiveSpeculation(5, pass_cost=cost)
        print(f"pass cost {name}: best k' for k = 5 at α = 0.0 .. 1.0")
        print("  ", [rule.best(a / 10) for a in range(11)])
