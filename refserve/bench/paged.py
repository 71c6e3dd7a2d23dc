"""`paged`: paged vs contiguous KV cache on the same workload (the cost of the gather)."""

from __future__ import annotations

from pathlib import Path

from refserve.bench.batching import BATCH_COLS, run_refserve
from refserve.bench.common import print_table, pyplot, save_figure, traced
from refserve.bench.workloads import make_workload

HELP = "paged vs contiguous KV cache: wall time and the model forward"
MAX_LEN = 1024


def add_arguments(p) -> None:
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--mean-output", type=int, default=120)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)


def apply_quick(args) -> None:
    args.num_requests, args.mean_output, args.max_running = 8, 24, 4


POSITIVE = ("num_requests", "mean_output", "max_running", "max_num_batched_tokens")


def run(args) -> dict:
    from refserve.llm import LLM

    common = dict(model=args.model, max_num_seqs=args.max_running, progress=False,
                  max_model_len=MAX_LEN, max_num_batched_tokens=args.max_num_batched_tokens)
    paged = traced(args, LLM(**common), "paged")
    vocab = paged.llm_engine.model.config.vocab_size
    wl = make_workload(args.num_requests, args.seed, vocab, mean_output=args.mean_output)
    rows = [run_refserve(paged, wl, f"paged (block {paged.llm_engine.block_size})")]
    contiguous = traced(args, LLM(kv_cache_layout="contiguous", **common), "contiguous")
    rows.append(run_refserve(contiguous, wl, f"contiguous ({MAX_LEN} slots/seq)"))
    assert rows[0]["outputs"] == rows[1]["outputs"], "paged and contiguous outputs differ"
    for r, llm in zip(rows, (paged, contiguous)):
        r["forward_s"] = llm.llm_engine.runner.time_in_forward
    result = {"rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}
    result["wall_ratio"] = rows[0]["elapsed_s"] / rows[1]["elapsed_s"]
    result["forward_ratio"] = rows[0]["forward_s"] / rows[1]["forward_s"]
    print()
    print_table(result["rows"], BATCH_COLS)
    print(f"paged / contiguous wall time: {result['wall_ratio']:.3f}x; "
          f"model forward: {result['forward_ratio']:.3f}x")
    return result


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["system"] for r in rows]
    a.bar(names, [r["tokens_per_s"] for r in rows], color=["tab:green", "tab:gray"])
    a.set_ylabel("output tokens / s")
    a.set_title("Throughput")
    b.bar(names, [r["kv_slots_peak"] for r in rows], color=["tab:green", "tab:gray"])
    b.set_ylabel("KV slots reserved at peak")
    b.set_title("KV memory handed out")
    save_figure(fig, result, path)
