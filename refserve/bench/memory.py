"""`memory`: KV slots reserved vs used on one length trace.

After every engine step, over the sequences holding KV:
    used      slots holding a computed token (a prompt shared by n samples counts once)
    paged     blocks held x block_size, as the KV-cache manager reports them; the waste
              is only each sequence's last, partly filled block
    naive     max_model_len slots per live sequence: what a contiguous cache reserves
    no CoW    n = 4 only: every sample holds its own copy of the prompt's blocks
waste = 1 - used / reserved, over the whole run (sums over steps) and at the peak.

The paged and copy-on-write rows are what the engine's pool really held. The naive and
no-CoW rows are computed from the same sequences at the same steps by their definitions
(`python -m refserve.bench paged` runs the contiguous layout for real).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from refserve.bench.common import print_table, pyplot, save_figure, traced
from refserve.bench.workloads import make_workload
from refserve.capacity import blocks_for_tokens
from refserve.sampling import SamplingParams

HELP = "KV slots reserved vs used: paged vs naive; n = 4 with and without copy-on-write"


def add_arguments(p) -> None:
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--mean-output", type=int, default=128)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="what the naive cache reserves per sequence")
    p.add_argument("--prompt-range", type=int, nargs=2, default=[32, 256],
                   metavar=("MIN", "MAX"))


def apply_quick(args) -> None:
    args.num_requests, args.mean_output, args.max_running = 3, 12, 4
    args.prompt_range = [16, 64]


POSITIVE = ("num_requests", "mean_output", "max_running", "max_model_len", "prompt_range")


def _trace(engine, workload, n: int, desc: str) -> list[dict]:
    """Run the workload; one sample of the pool per step."""
    for prompt, out_len in zip(workload.prompts, workload.output_lens):
        engine.add_request(None, prompt, SamplingParams(n=n, max_tokens=out_len,
                                                        temperature=1.0, seed=0,
                                                        ignore_eos=True))
    bs, kv = engine.block_size, engine.kv_cache_manager
    samples = []
    bar = tqdm(total=len(workload.prompts), desc=desc, unit="req")
    while engine.has_unfinished_requests():
        for out in engine.step():
            bar.update(int(out.finished))
        by_request: dict[str, list] = {}
        for seq in engine.scheduler.running:
            by_request.setdefault(seq.request_id, []).append(seq)
        used = own = 0
        for seqs in by_request.values():
            prompt = seqs[0].num_prompt_tokens
            computed = [s.num_computed_tokens for s in seqs]
            # The prompt's KV is shared by all samples of a request (copy-on-write).
            shared = min(prompt, *computed) if len(seqs) > 1 else 0
            used += shared + sum(c - shared for c in computed)
            own += sum(blocks_for_tokens(c, bs) for c in computed) * bs
        live = sum(len(v) for v in by_request.values())
        samples.append({"used": used, "paged": (kv.num_held_blocks) * bs,
                        "naive": live * engine.max_model_len, "no_cow": own})
    bar.close()
    return samples


def _row(label: str, samples: list[dict], key: str) -> dict:
    used = np.array([s["used"] for s in samples], dtype=np.float64)
    reserved = np.array([s[key] for s in samples], dtype=np.float64)
    peak = int(np.argmax(reserved))
    return {"layout": label, "slots_used_peak": int(used[peak]),
            "slots_reserved_peak": int(reserved[peak]),
            "waste_at_peak": 1 - used[peak] / reserved[peak],
            "waste_over_run": 1 - used.sum() / reserved.sum()}


def run(args) -> dict:
    from refserve.engine import LLMEngine

    # n = 4 takes 4 seats per request: 4x the seats keeps the two traces' concurrency alike
    engine = LLMEngine(model=args.model, max_num_seqs=4 * args.max_running,
                       max_model_len=args.max_model_len, enable_prefix_caching=False,
                       progress=False)
    traced(args, engine, "memory")
    vocab = engine.model.config.vocab_size
    wl = make_workload(args.num_requests, args.seed, vocab, prompt_range=args.prompt_range,
                       mean_output=args.mean_output,
                       output_range=(8, min(512, args.max_model_len - 256)))
    print(f"trace: {args.num_requests} requests, prompts {min(map(len, wl.prompts))}-"
          f"{max(map(len, wl.prompts))} tokens, outputs {min(wl.output_lens)}-"
          f"{max(wl.output_lens)}; block_size {engine.block_size}, max_model_len "
          f"{engine.max_model_len}", flush=True)
    one = _trace(engine, wl, 1, "n = 1")
    four = _trace(engine, wl, 4, "n = 4")
    rows = [_row("paged, n=1", one, "paged"), _row("naive max_model_len, n=1", one, "naive"),
            _row("paged + copy-on-write, n=4", four, "paged"),
            _row("paged without CoW, n=4", four, "no_cow")]
    print()
    print_table(rows, [("layout", "layout", ""), ("slots_used_peak", "used at peak", "d"),
                       ("slots_reserved_peak", "reserved at peak", "d"),
                       ("waste_at_peak", "waste at peak", ".1%"),
                       ("waste_over_run", "waste over run", ".1%")])
    cow_saving = 1 - rows[2]["slots_reserved_peak"] / rows[3]["slots_reserved_peak"]
    print(f"paged waste {rows[0]['waste_over_run']:.1%} vs naive "
          f"{rows[1]['waste_over_run']:.1%}; copy-on-write saves {cow_saving:.1%} of the "
          "n = 4 peak")
    return {"rows": rows, "block_size": engine.block_size,
            "max_model_len": engine.max_model_len, "cow_peak_saving": cow_saving,
            "trace": {"n1": one, "n4": four}}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    # n = 1 takes two panels: the naive cache is ~15x the paged one, so on one linear axis
    # paged and used are squashed together near zero. A log axis shows all three; a linear
    # zoom on paged vs used shows what paging still wastes (the last block's empty slots).
    fig, (a, z, b) = plt.subplots(1, 3, figsize=(15, 3.9))
    one, four = result["trace"]["n1"], result["trace"]["n4"]
    for ax in (a, z):
        if ax is a:
            ax.plot([s["naive"] for s in one], label="naive (max_model_len each)",
                    color="tab:gray")
        ax.plot([s["paged"] for s in one], label="paged blocks", color="tab:green")
        ax.plot([s["used"] for s in one], label="used", color="black", lw=0.8)
    a.set_yscale("log")
    a.set_title("n = 1: KV slots per step (log scale)")
    z.set_title("n = 1: paged vs used (linear)")
    b.plot([s["no_cow"] for s in four], label="without copy-on-write", color="tab:orange")
    b.plot([s["paged"] for s in four], label="with copy-on-write", color="tab:green")
    b.plot([s["used"] for s in four], label="used", color="black", lw=0.8)
    b.set_title("n = 4 parallel samples: KV slots per step")
    for ax in (a, z, b):
        ax.set_xlabel("engine step")
        ax.set_ylabel("slots")
        ax.legend(fontsize=8)
    save_figure(fig, result, path)
