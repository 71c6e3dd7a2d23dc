"""Speculative decoding in the engine (orchestration; the math is refserve/spec_decode/).

    speculator.py   the propose stage: who gets drafts and how many; the adaptive rule
                    learns from every verify step
    proposer.py     the proposer interface (what a new proposer provides)
    registry.py     every proposer by speculative_config method: the engine and the
                    simulator ask it
    ngram.py        prompt lookup: drafts copied from earlier in the context
    draft_model.py  the draft-model proposer: a smaller model, or the target's first N
                    layers ("self"), with its own paged KV cache
    verify.py       the verify step: warp p, draw uniforms in a documented order from the
                    sequence's generator, call the backend's rejection_sample

A draft token's life, from proposal to rollback, is told in refserve/scheduler/drafts.py.
"""
