"""Where the time of decode steps over long shared contexts goes, per backend.

    python scripts/profile_long_context.py --backend cpu
    python scripts/profile_long_context.py --backend numpy

Sixteen requests share one 1,000-token prefix (prefix caching on, as by default) plus 16
tokens of their own. The engine is stepped until every request decodes; then 16 decode steps
run under cProfile. Prints ms per step, the time in the model forward, and the functions
that took the most time of their own.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import numpy as np

from refserve import LLM, SamplingParams
from refserve.config import BACKENDS
from refserve.entrypoints.cli_common import ArgumentParser


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cpu", choices=BACKENDS)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()

    llm = LLM(backend=args.backend, seed=0, progress=False, max_model_len=2048,
              max_num_seqs=args.requests)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 30000, args.prefix_tokens).tolist()
    for i in range(args.requests):
        own = rng.integers(100, 30000, 16).tolist()
        engine.add_request(f"r{i}", {"prompt_token_ids": prefix + own},
                           SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0))
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1
                                   for s in scheduler.running):
        engine.step()

    context = scheduler.running[0].num_tokens
    forward_before = engine.runner.time_in_forward
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    per_step = (time.perf_counter() - t0) / args.steps * 1000
    forward = (engine.runner.time_in_forward - forward_before) / args.steps * 1000
    print(f"backend {engine.backend.name}: {args.steps} decode steps of "
          f"{len(scheduler.running)} rows at about {context} tokens of context: "
          f"{per_step:.1f} ms per step, {forward:.1f} in the forward (under cProfile)")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(14)
    print(out.getvalue())


if __name__ == "__main__":
    main()
