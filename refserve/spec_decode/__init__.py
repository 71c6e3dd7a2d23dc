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

Two packages share the work, as in vLLM v1 (vllm/v1/spec_decode/ proposes,
vllm/v1/sample/rejection_sampler.py verifies):

    refserve/spec_decode/   the PROPOSE stage (this package, above the model runner)
        speculator.py   who gets drafts and how many; the adaptive rule learns from every
                        verify step
        adaptive.py     how many drafts to propose per request (k adapts; 0 = stop)
        proposer.py     the proposer interface (what a new proposer provides)
        registry.py     every proposer by speculative_config method: the engine and the
                        simulator ask it
        ngram.py        prompt lookup: drafts copied from earlier in the context
        draft_model.py  the draft-model proposer: a smaller model, or the target's first N
                        layers ("self"), with its own paged KV cache
        cost_probe.py   what a dense forward of R rows costs (the adaptive rule's calibration)

    refserve/sampling/      the VERIFY step, beside the plain sampler (the sample stage,
                            below the backends: NumPy and control code only)
        warping.py            p and q: the sampler's own kept set and weights, normalised
        rejection_sampler.py  the accept / residual-resample step (a backend op's contract)
        verify.py             a verify row: warp p, draw uniforms in a documented order from
                              the sequence's generator, call the backend's rejection_sample

A draft token's whole life, from proposal to rollback, has one owner:
refserve/scheduler/drafts.py. How well speculation pays (acceptance rate, mean accepted
length, the expected tokens per target pass) is counted in refserve/metrics.py, and vLLM's
`speculative_config` dict is refserve/speculative_config.py. Where speculation enters one
engine step: LLMEngine.step's docstring (refserve/engine.py).
"""
