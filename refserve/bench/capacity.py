"""`capacity`: the capacity formula vs the sequences the engine really holds, per pool size.

Prediction (refserve/capacity.py):
    max concurrent sequences = floor(pool blocks / blocks for one sequence),
    blocks for one sequence  = ceil(tokens whose KV is kept / block_size)
A sequence of P prompt tokens and O output tokens keeps the KV of P + O - 1 tokens: the
last sampled token is returned, never computed.

Measurement: K > prediction identical requests (P, O, greedy, ignore_eos) arrive together.
The engine admits more than fit (their prompts are short), and as they grow it preempts
the newest until the rest fit. The sequences that ran start to finish without a single
preemption, finishing together in the first wave, are the concurrency the pool really
held at full length.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from refserve import capacity as capmath
from refserve.bench.common import print_table, pyplot, save_figure, traced
from refserve.bench.corpus import passage
from refserve.sampling import SamplingParams

HELP = "capacity formula vs concurrent sequences measured, at several pool sizes"


def add_arguments(p) -> None:
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--output-tokens", type=int, default=60)
    p.add_argument("--pool-blocks", type=int, nargs="+", default=[35, 70, 140])


def apply_quick(args) -> None:
    args.prompt_tokens, args.output_tokens, args.pool_blocks = 20, 24, [12, 24]


POSITIVE = ("prompt_tokens", "output_tokens", "pool_blocks")


def _measure(args, pool: int) -> dict:
    from refserve.engine import LLMEngine

    engine = LLMEngine(model=args.model, num_gpu_blocks_override=pool, max_num_seqs=1024,
                       enable_prefix_caching=False, progress=False,
                       max_model_len=args.prompt_tokens + args.output_tokens + 16)
    traced(args, engine, f"pool {pool} blocks")
    bs = engine.block_size
    kept = args.prompt_tokens + args.output_tokens - 1
    per_seq = capmath.blocks_for_tokens(kept, bs)
    predicted = capmath.max_concurrent_sequences(pool, kept, bs)
    if predicted < 1:
        raise ValueError(f"--pool-blocks {pool} cannot hold one sequence of {kept} tokens")
    prompt = engine.encode(passage(engine.tokenizer, args.prompt_tokens, args.seed)) \
        if engine.tokenizer is not None else list(range(10, 10 + args.prompt_tokens))
    prompt = prompt[:args.prompt_tokens]
    sent = predicted + 4
    ids = [engine.add_request(None, prompt, SamplingParams(
        max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)) for _ in range(sent)]
    first_wave = None
    bar = tqdm(total=args.output_tokens, desc=f"pool {pool} blocks", unit="step")
    peak_running = 0
    while first_wave is None:
        outs = engine.step()
        peak_running = max(peak_running, engine.scheduler.num_running)
        done = [o for o in outs if o.finished]
        if done:
            first_wave = [o for o in done if o.metrics.num_preemptions == 0]
        bar.update(1)
    bar.close()
    for rid in ids:
        engine.abort_request(rid)
    return {"pool_blocks": pool, "block_size": bs, "tokens_per_sequence": kept,
            "blocks_per_sequence": per_seq, "requests_sent": sent, "predicted": predicted,
            "measured": len(first_wave), "peak_running": peak_running,
            "preemptions": engine.stats()["num_preemptions"],
            "error": len(first_wave) - predicted}


def run(args) -> dict:
    rows = [_measure(args, pool) for pool in args.pool_blocks]
    print()
    print_table(rows, [("pool_blocks", "pool blocks", "d"), ("block_size", "block", "d"),
                       ("tokens_per_sequence", "tokens/seq", "d"),
                       ("blocks_per_sequence", "blocks/seq", "d"),
                       ("predicted", "predicted", "d"), ("measured", "measured", "d"),
                       ("error", "error", "+d"), ("peak_running", "peak admitted", "d"),
                       ("preemptions", "preemptions", "d")])
    worst = max(abs(r["error"]) for r in rows)
    print(f"prediction within {worst} sequence(s) of the measurement at every pool size")
    return {"rows": rows, "max_abs_error": worst}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    pools = [r["pool_blocks"] for r in rows]
    # When the two agree the lines coincide: measured is drawn thin and filled, predicted
    # on top as wide hollow squares, so both stay visible; each point is labelled too.
    ax.plot(pools, [r["measured"] for r in rows], "o-", color="tab:orange", ms=5, lw=1,
            zorder=2, label="measured (engine)")
    ax.plot(pools, [r["predicted"] for r in rows], "s--", color="tab:blue", ms=13, mfc="none",
            mew=1.8, lw=2.5, alpha=0.8, zorder=3, label="predicted (capacity math)")
    middle = (min(pools) + max(pools)) / 2
    for r in rows:
        right = r["pool_blocks"] > middle          # labels stay inside the axes
        ax.annotate(f"predicted {r['predicted']}, measured {r['measured']}",
                    (r["pool_blocks"], r["measured"]), textcoords="offset points",
                    xytext=(-10 if right else 10, -14), ha="right" if right else "left",
                    fontsize=7)
    worst = max(abs(r["measured"] - r["predicted"]) for r in rows)
    ax.set_title(f"largest |measured − predicted|: {worst} sequences", fontsize=9)
    ax.set_xlabel("KV pool (blocks)")
    ax.set_ylabel("concurrent sequences at full length")
    ax.margins(x=0.15, y=0.12)
    ax.legend(fontsize=8, loc="upper left")
    save_figure(fig, result, path)
