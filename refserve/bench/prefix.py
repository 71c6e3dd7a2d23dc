"""`prefix`: prefix caching off / hash / radix, and fcfs vs lpm, on four branching workloads.

The workloads (bench/branching.py: few-shot, multi-turn chat, k branches from one stem, an
agent loop) are token ids made from the seed, so every configuration gets the same requests.
The KV pool is kept small (--pool-fraction of the workload's distinct prompt blocks, at least
one longest sequence), so the cache must evict and the policies can differ.

    policies    each workload's prompts in their natural order, each sent after the previous
                one was answered (TTFT is then prefill time, not queueing), under caching
                off, "hash" (vLLM's chain) and "radix" (SGLang's tree)
    scheduling  the same prompts in one seeded shuffled order, all queued at once with
                --max-num-seqs seats, radix caching, scheduling_policy fcfs vs lpm (longest
                cached prefix first): TTFT includes the wait

Per row: hit rate (cached / prompt tokens), prefill tokens computed (prompt - cached), TTFT
p50/p99, evictions. Greedy outputs must be identical across every configuration of a
workload (the cache and the order change what is computed, never what is generated).
"""

from __future__ import annotations

import time
from pathlib import Path

from refserve.bench.branching import WORKLOADS, make_branching, shuffled
from refserve.bench.common import ms, percentiles, print_table, pyplot, save_figure, traced
from refserve.capacity import blocks_for_tokens
from refserve.sampling import SamplingParams

HELP = "prefix caching off / hash / radix and fcfs vs lpm on four branching workloads"
POLICIES = (("off", False, "hash"), ("hash", True, "hash"), ("radix", True, "radix"))


def add_arguments(p) -> None:
    p.add_argument("--scale", type=int, default=64,
                   help="tokens per example / turn / branch / step (stems 2-3x)")
    p.add_argument("--max-tokens", type=int, default=4, help="answer length")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-fraction", type=float, default=0.5,
                   help="KV pool = this fraction of a workload's distinct prompt blocks")
    p.add_argument("--max-num-seqs", type=int, default=4, help="seats (scheduling part)")


def apply_quick(args) -> None:
    args.scale, args.max_tokens = 8, 1   # one step per request: the prefill is the subject


POSITIVE = ("scale", "max_tokens", "block_size", "pool_fraction", "max_num_seqs")


def pool_blocks(workload, args) -> int:
    """--pool-fraction of the distinct prompt blocks, but at least the longest sequence
    (prompt + answer) and one block more."""
    longest = max(len(p) for p in workload.prompts) + args.max_tokens
    one = blocks_for_tokens(longest, args.block_size)
    distinct = blocks_for_tokens(workload.distinct_tokens, args.block_size)
    return max(one + 1, int(args.pool_fraction * distinct)), longest


def _engine(args, workload, caching: bool, policy: str, scheduling: str = "fcfs",
            label: str = ""):
    from refserve.engine import LLMEngine

    blocks, longest = pool_blocks(workload, args)
    engine = LLMEngine(model=args.model, progress=False, enable_prefix_caching=caching,
                       prefix_caching_policy=policy, scheduling_policy=scheduling,
                       block_size=args.block_size, num_gpu_blocks_override=blocks,
                       max_model_len=blocks_for_tokens(longest, args.block_size)
                       * args.block_size, max_num_seqs=args.max_num_seqs)
    return traced(args, engine, f"{workload.name}: {label}")  # --trace: one track each


def _params(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)


def _drain(engine, ids: list[str]) -> dict:
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _warm(engine) -> None:
    """The first forward pays one-off costs; this request shares no prefix (token 3s)."""
    _drain(engine, [engine.add_request(None, [3, 3, 3], SamplingParams(max_tokens=1))])


def _row(workload, config: str, part: str, outs, engine, elapsed: float) -> dict:
    prompt = sum(o.metrics.num_prompt_tokens for o in outs)
    cached = sum(o.metrics.num_cached_tokens for o in outs)
    ttft = percentiles([o.metrics.ttft for o in outs], (50, 99))
    return {"workload": workload.name, "part": part, "config": config,
            "requests": len(outs), "prompt_tokens": prompt, "cached_tokens": cached,
            "prefill_tokens_computed": prompt - cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "evictions": engine.stats()["prefix_cache_evictions"],
            "pool_blocks": engine.num_blocks,
            "ttft_p50_ms": ms(ttft["p50"]), "ttft_p99_ms": ms(ttft["p99"]),
            "elapsed_s": elapsed}


def run(args) -> dict:
    from refserve.models.loader import load_config, resolve_model_path

    vocab = load_config(resolve_model_path(args.model, False)).vocab_size
    rows, outputs = [], {}
    for name in WORKLOADS:
        workload = make_branching(name, args.scale, args.seed, vocab)
        for config, caching, policy in POLICIES:
            engine = _engine(args, workload, caching, policy, label=config)
            _warm(engine)
            t0, outs = time.perf_counter(), []
            for prompt in workload.prompts:  # one at a time: later ones find earlier ones
                rid = engine.add_request(None, prompt, _params(args))
                outs.append(_drain(engine, [rid])[rid])
            rows.append(_row(workload, config, "policies", outs, engine,
                             time.perf_counter() - t0))
            outputs[(name, config)] = {tuple(p): o.outputs[0].token_ids
                                       for p, o in zip(workload.prompts, outs)}
        arrivals = shuffled(workload.prompts, args.seed)
        for scheduling in ("fcfs", "lpm"):
            engine = _engine(args, workload, True, "radix", scheduling,
                             label=f"radix + {scheduling}, shuffled arrivals")
            _warm(engine)
            t0 = time.perf_counter()
            ids = [engine.add_request(None, p, _params(args)) for p in arrivals]
            done = _drain(engine, ids)
            outs = [done[rid] for rid in ids]
            rows.append(_row(workload, f"radix + {scheduling}", "scheduling", outs, engine,
                             time.perf_counter() - t0))
            outputs[(name, scheduling)] = {tuple(p): o.outputs[0].token_ids
                                           for p, o in zip(arrivals, outs)}
    same = {name: all(outputs[(name, c)] == outputs[(name, "off")]
                      for c in ("hash", "radix", "fcfs", "lpm")) for name in WORKLOADS}
    print()
    print_table(rows, [("workload", "workload", ""), ("config", "config", ""),
                       ("requests", "req", "d"), ("prompt_tokens", "prompt tok", "d"),
                       ("prefill_tokens_computed", "prefill computed", "d"),
                       ("hit_rate", "hit rate", ".1%"), ("evictions", "evicted", "d"),
                       ("pool_blocks", "pool", "d"),
                       ("ttft_p50_ms", "TTFT p50 ms", ".0f"),
                       ("ttft_p99_ms", "TTFT p99 ms", ".0f"), ("elapsed_s", "seconds", ".1f")])
    print(f"greedy outputs identical across off / hash / radix / fcfs / lpm: "
          f"{', '.join(f'{n} {s}' for n, s in same.items())}")
    return {"rows": rows, "same_outputs": same, "scale": args.scale,
            "block_size": args.block_size, "pool_fraction": args.pool_fraction}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.8))
    x = range(len(WORKLOADS))
    series = (("off", "tab:gray"), ("hash", "tab:blue"), ("radix", "tab:green"),
              ("radix + fcfs", "tab:orange"), ("radix + lpm", "tab:red"))
    width = 0.16
    for i, (config, color) in enumerate(series):
        sel = [next(r for r in rows if r["workload"] == w and r["config"] == config)
               for w in WORKLOADS]
        at = [j + (i - 2) * width for j in x]
        axes[0].bar(at, [r["hit_rate"] * 100 for r in sel], width, label=config, color=color)
        axes[1].bar(at, [r["prefill_tokens_computed"] for r in sel], width, color=color)
        axes[2].bar(at, [r["ttft_p50_ms"] for r in sel], width, color=color)
    for ax, title in zip(axes, ("hit rate (% of prompt tokens)", "prefill tokens computed",
                                "TTFT p50 (ms)")):
        ax.set_xticks(list(x), WORKLOADS, fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=5, fontsize=8,
               title="off / hash / radix: sent one at a time; radix + fcfs / lpm: the same "
               "prompts shuffled and queued at once (TTFT includes the wait)", title_fontsize=8)
    save_figure(fig, result, path, bottom=0.14)
