"""Where one scheduler step spends its time, at N running decodes (issue 18, section 4).

    PYTHONPATH=. python scripts/profile_scheduler.py                 # 256 and 1024 running
    PYTHONPATH=. python scripts/profile_scheduler.py --running 512 --context 4096

N sequences of `context` prompt tokens are prefilled, then every step is N decode rows:
`schedule()` then `update()` with one token each, the simulator's loop without its cost
model. Prints the median CPU time (time.thread_time, one BLAS thread) of each half per
step and per row, then cProfile's top functions with calls per row.
"""

from __future__ import annotations

import cProfile
import pstats
import time

import numpy as np
from threadpoolctl import threadpool_limits

from refserve.capacity import blocks_for_tokens
from refserve.entrypoints.cli_common import ArgumentParser, RawDescriptionHelpFormatter
from refserve.kv_cache import KVCacheManager
from refserve.sampling_params import SamplingParams
from refserve.scheduler import Scheduler
from refserve.sequence import Sequence


def decoding_scheduler(running: int, context: int, block_size: int = 16) -> Scheduler:
    # Each sequence holds its prompt's blocks, with room for 64 more to grow into.
    kv = KVCacheManager(running * (blocks_for_tokens(context, block_size) + 64), block_size)
    sched = Scheduler(running, max(8192, running), kv, 2 * context + 4096)
    rng = np.random.default_rng(0)
    for i in range(running):
        sched.add_sequence(Sequence(str(i), rng.integers(1000, 50000, context).tolist(),
                                    SamplingParams(max_tokens=10**6, ignore_eos=True)))
    while sched.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running):
        step(sched)
    return sched


def step(sched: Scheduler) -> tuple[float, float]:
    t0 = time.thread_time()
    out = sched.schedule()
    t1 = time.thread_time()
    sched.update(out, {row.seq.seq_id: [7] for row in out.scheduled if row.num_logits})
    return t1 - t0, time.thread_time() - t1


def main() -> None:
    p = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args()
    with threadpool_limits(1):
        for n in args.running:
            for ctx in args.context:
                sched = decoding_scheduler(n, ctx)
                for _ in range(3):
                    step(sched)
                times = np.array([step(sched) for _ in range(args.steps)])
                s, u = np.median(times, axis=0)
                print(f"\n{n} running, context {ctx}: schedule {s * 1e3:.2f} ms + update "
                      f"{u * 1e3:.2f} ms per step = {(s + u) / n * 1e6:.1f} us per row")
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(10):
                    step(sched)
                prof.disable()
                stats = pstats.Stats(prof).stats
                total = sum(v[2] for v in stats.values())
                top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:args.top]
                print("   self    cum  calls/row  function")
                for (path, line, name), (_, calls, self_t, cum_t, _) in top:
                    where = path.split("refserve/")[-1]
                    print(f"  {self_t / total:5.1%} {cum_t / total:6.1%}  {calls / 10 / n:8.1f}"
                          f"  {where}:{line}({name})")


if __name__ == "__main__":
    main()
