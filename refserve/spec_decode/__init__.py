"""Speculative decoding, in the notation of Leviathan et al. (2023), "Fast Inference from
Transformers via Speculative Decoding":

    p      the target model's next-token distribution (the one the output must follow)
    q      the draft's next-token distribution (one-hot for the n-gram proposer)
    k      the number of draft tokens proposed per verify step
    α      the acceptance rate: the probability that one draft token is accepted,
           α = E_x~q[min(1, p(x)/q(x))] = Σ_x min(p(x), q(x))

One verify step runs the target once over the k draft tokens x_1..x_k and emits, per request:

    accepted tokens   the leading draft tokens that pass the test u_i · q(x_i) < p(x_i)
    recovered token   at the first rejection, a token drawn from the residual distribution
                      norm(max(0, p - q)) of that position (it replaces the rejected draft)
    bonus token       when all drafts are accepted, a token drawn from the target's
                      distribution at the position after the last draft (free: the target
                      computed it in the same pass)

so every verify step emits accepted + 1 tokens, and those tokens are distributed exactly as if
the target had sampled them one at a time.

This package is the MATH, NumPy only, below the backends (a backend's rejection_sample op
is rejection_sampler.py's contract):
    rejection_sampler.py   the accept / residual-resample step (a backend op)
    warping.py             temperature, top-k, top-p applied to both p and q before the test
    adaptive.py            how many drafts to propose per request (k adapts; 0 = stop)
    metrics.py             proposed / accepted counts, acceptance rate, tokens per target pass

The engine's use of it (orchestration, above the model runner) is refserve/speculation/:
the proposers (n-gram prompt lookup, draft model; registry.py lists them), the propose stage
and the verify step. A draft token's
whole life, from proposal to rollback, is refserve/scheduler/drafts.py, and vLLM's
`speculative_config` dict is refserve/speculative_config.py. One engine step with
speculation is

    proposals = engine.propose()             drafts for decode-ready sequences (values)
    out = scheduler.schedule(proposals)      a verify row: the real token + the drafts that fit
    prepare / copy_blocks / forward          a verify row is k + 1 query tokens
    sampled = engine.sample(out, logits, proposals)   verify rows through speculation/verify.py
    update = scheduler.update(out, sampled)  append accepted + 1 under the stop rules, roll
                                             back the rest
"""
