"""The sample stage: from the step's logits rows to the tokens each row emits.

    sampler.py            a plain row: one token from its logits (`Sampler`): the
                          processors, greedy rows' argmax, the nucleus and the draw
                          (the backend's `sample`), one uniform from the row's generator
    warping.py            p and q: the distributions the accept test compares, the
                          sampler's own nucleus (`backend.sampling_weights`), normalised
    rejection_sampler.py  the accept / residual-resample step (accepted, recovered, bonus
                          token), NumPy; a backend's `rejection_sample` op is its contract
    verify.py             a speculative verify row: warp p, draw its uniforms in a stated
                          order from the sequence's generator, call `rejection_sample`

`LLMEngine.sample` (refserve/engine.py) is the stage: plain rows go to the Sampler, verify
rows to `verify`. Everything here is NumPy and control code that takes the backend as an
argument: the backends implement its ops below the model, and nothing here imports them.
So one package holds what decides a token, plain or speculative, as vLLM v1 does
(vllm/v1/sample/: sampler.py, rejection_sampler.py, ops/); the propose stage (proposers,
the speculator, the adaptive rule) is refserve/spec_decode/, whose docstring states the
notation (p, q, k, α; accepted, recovered, bonus token) both packages use.
"""

from refserve.sampling.sampler import (
    GREEDY_BELOW,
    Sampler,
    SamplingParams,
    draw_arguments,
    make_generator,
    nucleus_arguments,
)

__all__ = ["Sampler", "SamplingParams", "make_generator", "draw_arguments",
           "nucleus_arguments", "GREEDY_BELOW"]
