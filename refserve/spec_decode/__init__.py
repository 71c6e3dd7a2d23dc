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

Modules:
    rejection_sampler.py   the accept / residual-resample step (a backend op)
    warping.py             temperature, top-k, top-p applied to both p and q before the test
    ngram_proposer.py      prompt lookup: drafts copied from earlier in the context
    proposer.py            the proposal stage's interface (Proposal: drafts + q) and the
                           n-gram proposer behind it
    draft_model.py         the draft-model proposer: a smaller model, or the target's first N
                           layers ("self"), run with its own paged KV cache
    verify.py              the engine's verify step: warp p, draw uniforms in a documented
                           order from the sequence's generator, call rejection_sample
    adaptive.py            how many drafts to propose per request (k adapts; 0 = stop)
    config.py              SpeculativeConfig: vLLM's speculative_config dict, validated
    metrics.py             proposed / accepted counts, acceptance rate, tokens per target pass

In the engine (refserve/engine.py) one step with speculation is

    engine.propose()        drafts into seq.spec_token_ids (decode-ready sequences only)
    schedule / prepare / copy_blocks / forward    a verify row is k + 1 query tokens
    engine.sample           verify rows go through verify.py
    scheduler.update        append accepted + 1 tokens, un-compute rejected drafts, trim
                            blocks that hold only rejected slots (KVCacheManager.trim)
"""
