"""`preemption`: recompute vs swap preemption, against context length.

For each context length L: --num-requests requests of L distinct prompt tokens and
--max-tokens greedy output tokens, all queued at once, into a KV pool that holds the prompts
of k = --pool-fraction x --num-requests sequences (at least 2) plus half of what they grow
by: k are admitted, and as they decode they must preempt each other. The same requests run
twice, preemption_mode="recompute" then "swap" (swap_space GiB of host blocks). Prefix
caching is off, so a recompute victim really recomputes its whole context (WARMUP.md's
t_rec; with caching on it would hit whatever of it survived).

Per row: preemptions, tokens recomputed (computed tokens whose KV recompute dropped), bytes
moved over the "host link" (swap out + swap in; a memcpy on NumPy), TTFT / TPOT p99, output
throughput and wall time. Greedy outputs must be identical in both modes. The measured
crossover is the shortest L at which swap's wall time beats recompute's.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from refserve.bench.common import ms, percentiles, print_table, pyplot, save_figure, traced
from refserve.capacity import blocks_for_tokens
from refserve.sampling import SamplingParams

HELP = "recompute vs swap preemption against context length (a pool forced to preempt)"
MODES = ("recompute", "swap")


def add_arguments(p) -> None:
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 128, 256, 512],
                   help="prompt lengths L")
    p.add_argument("--num-requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-fraction", type=float, default=0.5,
                   help="the pool holds the prompts of this fraction of the requests")
    p.add_argument("--swap-space", type=float, default=1.0, help="GiB of host blocks")


def apply_quick(args) -> None:
    args.contexts, args.num_requests, args.max_tokens = [32, 64], 4, 10


POSITIVE = ("contexts", "num_requests", "max_tokens", "block_size", "pool_fraction",
            "swap_space")


def _run_one(args, mode: str, context: int, prompts: list[list[int]]) -> tuple[dict, list]:
    from refserve.engine import LLMEngine

    full = blocks_for_tokens(context + args.max_tokens, args.block_size)
    prompt = blocks_for_tokens(context, args.block_size)
    k = max(2, round(args.pool_fraction * args.num_requests))
    blocks = k * prompt + max(1, k * (full - prompt) // 2)
    engine = LLMEngine(model=args.model, progress=False, enable_prefix_caching=False,
                       preemption_mode=mode, swap_space=args.swap_space,
                       block_size=args.block_size, num_gpu_blocks_override=blocks,
                       max_model_len=full * args.block_size, max_num_seqs=args.num_requests)
    engine = traced(args, engine, f"{mode}, context {context}")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(None, [3, 3, 3], SamplingParams(max_tokens=1))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    before = engine.stats()
    t0 = time.perf_counter()
    ids = [engine.add_request(None, p, params) for p in prompts]
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    elapsed = time.perf_counter() - t0
    stats = engine.stats()
    outs = [done[rid] for rid in ids]
    ttft = percentiles([o.metrics.ttft for o in outs], (99,))
    tpot = percentiles([o.metrics.tpot for o in outs], (99,))
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"context": context, "mode": mode, "pool_blocks": blocks,
           "preemptions": stats["num_preemptions"] - before["num_preemptions"],
           "recomputed_tokens": stats["recomputed_tokens"] - before["recomputed_tokens"],
           "swap_bytes": stats["swap_bytes"] - before["swap_bytes"],
           "fallbacks": stats["swap_fallbacks_to_recompute"],
           "ttft_p99_ms": ms(ttft["p99"]), "tpot_p99_ms": ms(tpot["p99"]),
           "throughput_tok_s": output_tokens / elapsed, "elapsed_s": elapsed}
    return row, [o.outputs[0].token_ids for o in outs]


def run(args) -> dict:
    from refserve.models.loader import load_config, resolve_model_path

    vocab = load_config(resolve_model_path(args.model, False)).vocab_size
    low = min(1000, vocab // 2)
    rows, same = [], {}
    for context in args.contexts:
        rng = np.random.default_rng([args.seed, context])
        prompts = [rng.integers(low, vocab, size=context).tolist()
                   for _ in range(args.num_requests)]
        texts = {}
        for mode in MODES:
            row, texts[mode] = _run_one(args, mode, context, prompts)
            rows.append(row)
        same[context] = texts["recompute"] == texts["swap"]
    by = {(r["context"], r["mode"]): r for r in rows}
    faster = [c for c in args.contexts
              if by[(c, "swap")]["elapsed_s"] < by[(c, "recompute")]["elapsed_s"]]
    crossover = (None if not faster else
                 next((c for c in args.contexts if all(x in faster for x in args.contexts
                                                       if x >= c)), None))
    print()
    print_table(rows, [("context", "L", "d"), ("mode", "mode", ""), ("pool_blocks", "pool", "d"),
                       ("preemptions", "preempted", "d"),
                       ("recomputed_tokens", "recomputed tok", "d"),
                       ("swap_bytes", "bytes moved", "d"), ("fallbacks", "fallbacks", "d"),
                       ("ttft_p99_ms", "TTFT p99 ms", ".0f"),
                       ("tpot_p99_ms", "TPOT p99 ms", ".0f"),
                       ("throughput_tok_s", "out tok/s", ".1f"), ("elapsed_s", "seconds", ".1f")])
    if crossover is None:
        print("measured crossover: swap never beat recompute at these context lengths")
    else:
        print(f"measured crossover: swap beats recompute from L = {crossover} on "
              f"(of {args.contexts})")
    print("greedy outputs identical recompute vs swap: "
          + ", ".join(f"L={c} {s}" for c, s in same.items()))
    return {"rows": rows, "crossover_context": crossover,
            "same_outputs": {str(c): s for c, s in same.items()}}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    contexts = sorted({r["context"] for r in rows})
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.9))
    for mode, color in (("recompute", "tab:orange"), ("swap", "tab:blue")):
        sel = [next(r for r in rows if r["context"] == x and r["mode"] == mode)
               for x in contexts]
        a.plot(contexts, [r["elapsed_s"] for r in sel], "o-", color=color, label=mode)
        b.plot(contexts, [r["tpot_p99_ms"] for r in sel], "o-", color=color, label=mode)
    rec = [next(r for r in rows if r["context"] == x and r["mode"] == "recompute")
           for x in contexts]
    swp = [next(r for r in rows if r["context"] == x and r["mode"] == "swap") for x in contexts]
    at = np.arange(len(contexts))
    c.bar(at - 0.2, [r["recomputed_tokens"] for r in rec], 0.4, color="tab:orange",
          label="recompute: tokens recomputed")
    c2 = c.twinx()
    c2.bar(at + 0.2, [r["swap_bytes"] / 2**20 for r in swp], 0.4, color="tab:blue",
           label="swap: MiB moved (out + in)")
    c2.set_ylabel("MiB moved (swap)", fontsize=8)
    c.set_ylabel("tokens recomputed", fontsize=8)
    for ax, title in ((a, "wall time of the run (s)"), (b, "TPOT p99 (ms)"),
                      (c, "what each mode pays")):
        ax.set_xlabel("context length L (prompt tokens)", fontsize=8)
        ax.set_title(title, fontsize=10)
    c.set_xticks(at, [str(x) for x in contexts])
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    lines = c.get_legend_handles_labels()
    lines2 = c2.get_legend_handles_labels()
    c.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="upper left")
    save_figure(fig, result, path)
