"""`roofline`: the machine's ceilings, measured, and where engine steps land under them.

Ceilings (measured here, best of several runs):
    peak FLOP/s     a large float32 matmul:  2 n^3 flops / time
    bandwidth       a large array copy:      2 x bytes (read + write) / time
Roofline: attainable FLOP/s = min(peak, bandwidth x arithmetic intensity), where intensity
= flops / bytes moved. A step left of the ridge (peak / bandwidth) is bandwidth-bound.

Per step, with T query tokens, S sampling rows and context lengths ctx_i (float32):
    flops = 2 T N_layers + 2 S V H + 4 L (n_heads head_dim) sum_i q_i ctx_i
            (weights' matmuls, the unembedding of sampled rows, attention QK^T and PV)
    bytes = 4 (N_layers + V H) + KV bytes/token x (sum_i ctx_i + T)
            (every weight read once; every cached K/V read once; the new ones written)
N_layers: parameters of the transformer layers; V H: the unembedding matrix. Timed: the
model forward only (runner.time_in_forward), so scheduling is not counted.

On the tuned CPU backend's compiled kernels, a row per kernel follows (linear, attention,
the fused elementwise steps) at 1, 5, 16 and 64 rows: bench/kernel_rooflines.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from refserve.bench.common import print_table, pyplot, save_figure
from refserve.bench.kernel_rooflines import best_seconds, kernel_rows
from refserve.sampling import SamplingParams

HELP = "measured peak FLOP/s and bandwidth; prefill and decode steps on the roofline"


def add_arguments(p) -> None:
    p.add_argument("--matmul-n", type=int, default=2048)
    p.add_argument("--copy-mib", type=int, default=512)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=256, help="prompt length of the decodes")
    p.add_argument("--decode-steps", type=int, default=8, help="timed decode steps")


def apply_quick(args) -> None:
    args.matmul_n, args.copy_mib, args.prefill_tokens = 1024, 128, 128
    args.decode_batches, args.context, args.decode_steps = [1, 8], 64, 3


POSITIVE = ("matmul_n", "copy_mib", "prefill_tokens", "decode_batches", "context",
            "decode_steps")


def measure_ceilings(matmul_n: int, copy_mib: int) -> dict:
    a = np.random.default_rng(0).standard_normal((matmul_n, matmul_n), dtype=np.float32)
    b = a.T.copy()
    t = best_seconds(lambda: a @ b, 5)
    src = np.ones(copy_mib * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    tc = best_seconds(lambda: np.copyto(dst, src), 5)
    return {"peak_flops": 2 * matmul_n**3 / t, "bandwidth_bytes_per_s": 2 * src.nbytes / tc,
            "matmul_n": matmul_n, "copy_bytes": src.nbytes}


def model_costs(c) -> dict:
    """Parameter counts and per-token KV bytes of a LlamaConfig (float32)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size \
        * c.intermediate_size
    return {"layer_params": c.num_hidden_layers * per_layer,
            "unembed_params": c.vocab_size * c.hidden_size,
            "kv_bytes_per_token": 2 * c.num_hidden_layers * kv * 4,
            "attn_width": q, "layers": c.num_hidden_layers}


def step_cost(costs: dict, q_lens: list[int], ctx_lens: list[int], sampled: int) -> tuple:
    tokens = sum(q_lens)
    flops = (2 * tokens * costs["layer_params"] + 2 * sampled * costs["unembed_params"]
             + 4 * costs["layers"] * costs["attn_width"]
             * sum(q * ctx for q, ctx in zip(q_lens, ctx_lens)))
    nbytes = (4 * (costs["layer_params"] + costs["unembed_params"])
              + costs["kv_bytes_per_token"] * (sum(ctx_lens) + tokens))
    return flops, nbytes


ACHIEVED = [("bound", "bound by", ""), ("achieved_gflops", "GFLOP/s", ".1f"),
            ("fraction_of_peak_flops", "of peak", ".0%"), ("achieved_gb_per_s", "GB/s", ".1f"),
            ("fraction_of_bandwidth", "of bandwidth", ".0%")]


def _timed_forward(engine, fn) -> float:
    f0 = engine.runner.time_in_forward
    fn()
    return engine.runner.time_in_forward - f0


def run(args) -> dict:
    from refserve.engine import LLMEngine

    print("measuring the ceilings (matmul, copy)...", flush=True)
    ceil = measure_ceilings(args.matmul_n, args.copy_mib)
    engine = LLMEngine(model=args.model, enable_prefix_caching=False, progress=False,
                       max_num_batched_tokens=max(8192, args.prefill_tokens))
    costs = model_costs(engine.model.config)
    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(args.seed)
    rows = []

    # One prefill step: the whole prompt in one forward, one sampled row.
    prompt = rng.integers(min(1000, vocab // 2), vocab, args.prefill_tokens).tolist()
    rid = engine.add_request(None, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    t = _timed_forward(engine, engine.step)
    engine.abort_request(rid)
    n = args.prefill_tokens
    flops, nbytes = step_cost(costs, [n], [n], 1)
    rows.append({"step": f"prefill {n} tokens", "tokens": n, "seconds": t, "flops": flops,
                 "bytes": nbytes})

    for batch in tqdm(args.decode_batches, desc="decode batches", unit="batch"):
        ids = [engine.add_request(None, rng.integers(min(1000, vocab // 2), vocab,
                                                     args.context).tolist(),
                                  SamplingParams(max_tokens=args.decode_steps + 2,
                                                 temperature=0.0, ignore_eos=True))
               for _ in range(batch)]
        while any(s.num_computed_tokens < s.num_prompt_tokens
                  for s in engine.scheduler.running) or engine.scheduler.num_waiting:
            engine.step()
        ctx = [s.num_computed_tokens + 1 for s in engine.scheduler.running]

        def decode_steps():
            for _ in range(args.decode_steps):
                engine.step()

        t = _timed_forward(engine, decode_steps) / args.decode_steps
        for rid in ids:
            engine.abort_request(rid)
        # context grows by one per step; the middle step stands for all of them
        mid = [c + args.decode_steps // 2 for c in ctx]
        flops, nbytes = step_cost(costs, [1] * batch, mid, batch)
        rows.append({"step": f"decode batch {batch}", "tokens": batch, "seconds": t,
                     "flops": flops, "bytes": nbytes})

    kernels = kernel_rows(engine.model, args.context,
                          rows=(1, 5) if args.quick else (1, 5, 16, 64))
    ridge = ceil["peak_flops"] / ceil["bandwidth_bytes_per_s"]
    for r in rows + kernels:
        r["intensity"] = r["flops"] / r["bytes"]
        r["achieved_gflops"] = r["flops"] / r["seconds"] / 1e9
        r["achieved_gb_per_s"] = r["bytes"] / r["seconds"] / 1e9
        r["fraction_of_peak_flops"] = r["flops"] / r["seconds"] / ceil["peak_flops"]
        r["fraction_of_bandwidth"] = r["bytes"] / r["seconds"] / ceil["bandwidth_bytes_per_s"]
        r["bound"] = "compute" if r["intensity"] > ridge else "bandwidth"
        r["ms"] = 1000 * r["seconds"]
    print(f"\npeak {ceil['peak_flops'] / 1e9:.1f} GFLOP/s (float32 {args.matmul_n}^3 matmul), "
          f"bandwidth {ceil['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s ({args.copy_mib} MiB "
          f"copy), ridge at {ridge:.1f} flop/byte")
    print_table(rows, [("step", "step", ""), ("ms", "ms", ".1f"),
                       ("intensity", "flop/byte", ".1f"), *ACHIEVED])
    if kernels:
        print(f"\nthe compiled kernels alone ({engine.backend.startup_note()}):")
        print_table(kernels, [("kernel", "kernel", ""), ("rows", "rows", "d"),
                              ("ms", "ms", ".2f"), *ACHIEVED])
    return {"ceilings": ceil, "ridge_flop_per_byte": ridge, "model": costs, "rows": rows,
            "kernels": kernels}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    ceil = result["ceilings"]
    peak, bw = ceil["peak_flops"], ceil["bandwidth_bytes_per_s"]
    rows = result["rows"]
    kernels = result.get("kernels") or []
    everything = rows + kernels
    xs = np.logspace(np.log10(min(r["intensity"] for r in everything) / 4),
                     np.log10(max(max(r["intensity"] for r in everything),
                                  result["ridge_flop_per_byte"]) * 4), 200)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(xs, np.minimum(peak, bw * xs) / 1e9, "k-", lw=1.5, label="roofline (measured)")
    for r in rows:
        ax.loglog(r["intensity"], r["achieved_gflops"], "o", ms=8, label=r["step"])
    for name in dict.fromkeys(k["kernel"] for k in kernels):      # one line per kernel
        mine = [k for k in kernels if k["kernel"] == name]
        ax.loglog([k["intensity"] for k in mine], [k["achieved_gflops"] for k in mine],
                  "x--", ms=6, lw=0.8,
                  label=f"{name} kernel, {', '.join(str(k['rows']) for k in mine)} rows")
    ax.set_xlabel("arithmetic intensity (flop / byte)")
    ax.set_ylabel("GFLOP/s")
    ax.legend(fontsize=8)
    save_figure(fig, result, path)
