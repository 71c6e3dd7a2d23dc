"""Two checkouts of refserve side by side: the engine's step time at a few batch sizes.

    git worktree add --detach /tmp/base main
        (or: mkdir /tmp/base && git archive main | tar -x -C /tmp/base)
    python scripts/ab_step_time.py /tmp/base . [--backend auto] [--batch 1,8,32]
                                              [--steps 40] [--rounds 4] [--as-user]

Each round runs one short process per checkout, A and B in alternating order (A B, B A, ...)
so that slow drift of a shared machine falls on both. A process imports refserve from its
checkout (checked: it prints the file it imported), starts an engine on the embedded model,
and per batch size prefills `batch` requests of 32 prompt tokens, then times `--steps` plain
decode steps (`LLMEngine.step()`, greedy, EOS ignored). It prints the median ms per step; this
script prints, per batch size, the median over rounds of each checkout and B / A.
`--as-user` unsets OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE in the processes (what a user's
machine runs with; the development environment sets both). The machine's load (`uptime`) is
printed first: on a busy machine, compare only the ratio, and rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time
import refserve
from refserve import LLM, SamplingParams

backend, batches, steps = sys.argv[1], [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3])
llm = LLM(backend=backend, seed=0, progress=False)
engine = llm.llm_engine
result = {"file": refserve.__file__, "backend": engine.backend.name, "ms": {}}
for batch in batches:
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        prompt = [(17 * i + 5 * t) % 4000 + 100 for t in range(32)]
        engine.add_request(rid, prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.abort_request(ids)
    result["ms"][str(batch)] = 1000 * statistics.median(times)
print(json.dumps(result))
"""


def run(root: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root))
    if args.as_user:
        env.pop("OPENBLAS_CORETYPE", None)
        env.pop("OPENBLAS_L2_SIZE", None)
    out = subprocess.run([sys.executable, "-c", CHILD, args.backend, args.batch, str(args.steps)],
                         cwd=root, env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    imported = Path(result["file"]).resolve()
    if not imported.is_relative_to(root.resolve()):
        sys.exit(f"error: {root} imported refserve from {imported}; run from a venv where "
                 "PYTHONPATH wins over the installed package")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path, help="checkout A (e.g. main's worktree)")
    p.add_argument("b", type=Path, help="checkout B (e.g. this branch)")
    p.add_argument("--backend", default="auto", help="numpy, cpu or auto (default auto)")
    p.add_argument("--batch", default="1,8,32", help="batch sizes (default 1,8,32)")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per batch")
    p.add_argument("--rounds", type=int, default=4, help="A/B rounds (default 4)")
    p.add_argument("--as-user", action="store_true",
                   help="unset OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE in the processes")
    args = p.parse_args()
    for root in (args.a, args.b):
        if not (root / "refserve" / "__init__.py").is_file():
            sys.exit(f"error: {root} is not a refserve checkout (no refserve/__init__.py)")
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    ms: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    for r in range(args.rounds):
        order = [("A", args.a), ("B", args.b)]
        for name, root in order if r % 2 == 0 else order[::-1]:
            result = run(root, args)
            for batch, t in result["ms"].items():
                ms[name].setdefault(batch, []).append(t)
            print(f"round {r + 1} {name} ({result['backend']}): "
                  + ", ".join(f"batch {b} {t:.1f} ms" for b, t in result["ms"].items()),
                  flush=True)
    print(f"\nmedian ms per decode step over {args.rounds} rounds (A = {args.a}, B = {args.b})")
    for batch in ms["A"]:
        a, b = statistics.median(ms["A"][batch]), statistics.median(ms["B"][batch])
        print(f"  batch {batch:>3}: A {a:7.2f}  B {b:7.2f}  B/A {b / a:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
