"""`spec`: no speculation vs n-gram vs self-draft, on a quote-heavy and a creative workload.

Workloads (greedy, chat template, the same requests for every system):
  quote-heavy   "Repeat the following passage exactly" + a bundled passage: the answer
                copies its prompt, so prompt lookup (n-gram) drafts are mostly right.
  creative      "Write a short story about ...": little to copy; speculation must not cost
                much (the adaptive rule stops a request whose acceptance is too low).
Each at batch 1 (requests one after another) and batch B (all at once).

Systems: none; ngram (prompt lookup, k = --k); self-draft (the target's first
--draft-layers layers as the draft model, its own KV cache). Per cell: wall-clock seconds,
output tokens/s, speedup over none (same workload, same batch), acceptance rate, mean
accepted length, target passes per output token, and how many greedy outputs are token-
identical to none's (speculation must not change greedy output).

The systems run on --backend (default auto: the tuned CPU backend without a GPU; numpy: the
reference). Before the cells, the cost of a verify pass: a 5-row forward (1 + k with k = 4)
over a 1-row forward of the target, batch 1, 64 tokens of context, both medians of 7
interleaved wall-clock runs, with the products the model loaded with (the tuned backend:
refserve/backends/cpu_linear.py, weights packed in panels), as one gemv / sgemm each
(`REFSERVE_CPU_KERNELS=numpy`), and on the NumPy reference backend (x @ W.T, plain
attention); and the verify / plain pass ratio the adaptive rule measured at start-up, at
batch 1 and at batch 8.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from refserve.bench.common import print_table, pyplot, save_figure, traced
from refserve.bench.corpus import passage
from refserve.config import BACKENDS
from refserve.sampling import SamplingParams
from refserve.spec_decode import cost_probe

HELP = "speculative decoding: none vs n-gram vs self-draft, quote-heavy and creative"

STORY_TOPICS = ["a lighthouse keeper who finds a strange bottle", "a fox lost in a city",
                "a robot learning to paint", "two rivals stuck in an elevator",
                "a village where it never stops raining", "the last bookshop on the moon",
                "a chef who cannot taste", "a clockmaker's apprentice"]


def add_arguments(p) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="answer length")
    p.add_argument("--passage-tokens", type=int, default=120, help="quoted passage length")
    p.add_argument("--batch", type=int, default=8, help="the larger batch size")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--draft-layers", type=int, default=8, help="self-draft: target layers")
    p.add_argument("--batch1-requests", type=int, default=3,
                   help="batch 1: requests run one after another per workload")
    p.add_argument("--batch1-only", action="store_true", help="skip the batch-B runs")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="the backend of every system (auto: cupy on a GPU, else cpu)")
    p.add_argument("--verify-repeats", type=int, default=7,
                   help="interleaved repeats of the verify-pass cost measurement")


def apply_quick(args) -> None:
    args.max_tokens, args.passage_tokens, args.batch, args.draft_layers = 10, 32, 2, 4
    args.batch1_requests, args.verify_repeats = 1, 2


POSITIVE = ("max_tokens", "passage_tokens", "batch", "k", "draft_layers", "batch1_requests",
            "verify_repeats")


def _prompts(tok, kind: str, count: int, passage_tokens: int, seed: int) -> list[str]:
    prompts = []
    for i in range(count):
        if kind == "quote-heavy":
            text = passage(tok, passage_tokens, seed + i)
            msg = f"Repeat the following passage exactly, word for word:\n\n{text}"
        else:
            msg = f"Write a short story about {STORY_TOPICS[(seed + i) % len(STORY_TOPICS)]}."
        prompts.append(tok.apply_chat_template([{"role": "user", "content": msg}],
                                               tokenize=False, add_generation_prompt=True))
    return prompts


def _systems(args) -> dict[str, dict | None]:
    return {"none": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
            "self-draft": {"method": "draft_model", "num_speculative_tokens": args.k,
                           "model": "self", "num_draft_layers": args.draft_layers}}


def _run_interleaved(llms: dict, prompts, params, batch: int):
    """Every system generates every group of `batch` prompts; the systems take turns group
    by group, in an order rotated each group, so a slow spell of a shared machine (other
    processes) hits all systems alike. Returns {system: (outputs, seconds)}."""
    names = list(llms)
    outs = {name: [] for name in names}
    seconds = dict.fromkeys(names, 0.0)
    for g, i in enumerate(range(0, len(prompts), batch)):
        for name in names[g % len(names):] + names[:g % len(names)]:
            t0 = time.perf_counter()
            outs[name] += llms[name].generate(prompts[i:i + batch], params, use_tqdm=False)
            seconds[name] += time.perf_counter() - t0
    return {name: (outs[name], seconds[name]) for name in names}


def verify_pass_ratios(model, repeats: int = 7) -> dict | None:
    """5-row / 1-row forward seconds of `model` as loaded, on the tuned CPU backend's NumPy
    kernels (each product one OpenBLAS gemv / sgemm) and on the NumPy reference backend;
    None on a device backend (a host clock cannot time it)."""
    from refserve.backends import CpuBackend, NumpyBackend

    if model.xp is not np:
        return None
    plain = cost_probe.with_backend(model, CpuBackend(kernels="numpy"))
    # The NumPy kernels keep W [out, in] as loaded: the reference shares them.
    variants = {"loaded": model, "plain": plain,
                "reference": cost_probe.with_backend(plain, NumpyBackend())}
    names = list(variants)
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for rows in (1, 5):
                times.setdefault((name, rows), []).extend(
                    cost_probe.forward_seconds(variants[name], 1, rows, repeats=1))
    med = {key: float(np.median(t)) for key, t in times.items()}
    out = {f"{name}_one_row_ms": 1000 * med[(name, 1)] for name in names}
    out.update({name: med[(name, 5)] / med[(name, 1)] for name in names})
    out["plans"] = [repr(w) for w in cost_probe.dense_weights(model, 1)]
    return out


def run(args) -> dict:
    from refserve import LLM

    llms = {name: LLM(model=args.model, backend=args.backend, progress=False,
                      speculative_config=spec)
            for name, spec in _systems(args).items()}
    backend = llms["none"].llm_engine.backend.name
    for name, llm in llms.items():
        traced(args, llm, f"speculation {name}")
    tok = llms["none"].get_tokenizer()
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError("the spec scenario needs a model with a chat template")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for llm in llms.values():  # warm-up: first-call costs are not speculation's
        llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0),
                     use_tqdm=False)
    ratios = verify_pass_ratios(llms["none"].llm_engine.model, args.verify_repeats) or {}
    cost = llms["ngram"].llm_engine.speculator.adaptive.pass_cost
    ratios.update(adaptive_batch1=cost.ratio(1, args.k), adaptive_batch8=cost.ratio(8, args.k))
    if "loaded" in ratios:
        print(f"5-row / 1-row forward (batch 1): {ratios['loaded']:.2f}x on the {backend} "
              f"backend as loaded ({ratios['loaded_one_row_ms']:.1f} ms at 1 row), "
              f"{ratios['plain']:.2f}x as one gemv / sgemm per product "
              f"(REFSERVE_CPU_KERNELS=numpy, {ratios['plain_one_row_ms']:.1f} ms), "
              f"{ratios['reference']:.2f}x on the numpy reference "
              f"({ratios['reference_one_row_ms']:.1f} ms)", flush=True)
        for plan in ratios["plans"]:
            print(f"  {plan}")
    print(f"Adaptive rule's verify / plain pass at k = {args.k}: "
          f"{ratios['adaptive_batch1']:.2f}x at batch 1, {ratios['adaptive_batch8']:.2f}x at "
          "batch 8", flush=True)
    batches = [1] if args.batch1_only or args.batch == 1 else [1, args.batch]
    cells = [(kind, b) for kind in ("quote-heavy", "creative") for b in batches]
    rows = []
    bar = tqdm(total=len(cells), desc="spec", unit="cell")
    for kind, batch in cells:
        # batch 1: a few requests one at a time; batch B: B requests at once
        count = args.batch1_requests if batch == 1 else batch
        prompts = _prompts(tok, kind, count, args.passage_tokens, args.seed)
        reference = None
        for name, (outs, seconds) in _run_interleaved(llms, prompts, params, batch).items():
            s = llms[name].last_summary
            ids = [o.outputs[0].token_ids for o in outs]
            if reference is None:
                reference, base_seconds = ids, seconds
            out_tokens = sum(len(t) for t in ids)
            proposed = sum(o.metrics.num_spec_proposed for o in outs)
            accepted = sum(o.metrics.num_spec_accepted for o in outs)
            verify = sum(o.metrics.num_spec_verify_steps for o in outs)
            passes = sum(o.metrics.num_target_passes for o in outs)
            rows.append({
                "workload": kind, "batch": batch, "system": name, "requests": len(prompts),
                "output_tokens": out_tokens, "seconds": seconds,
                "tokens_per_s": out_tokens / seconds, "speedup": base_seconds / seconds,
                "proposed": proposed, "accepted": accepted,
                "acceptance_rate": accepted / proposed if proposed else None,
                "mean_accepted_length": (accepted + verify) / verify if verify else None,
                "target_passes_per_token": passes / out_tokens if out_tokens else None,
                "identical_outputs": sum(a == b for a, b in zip(ids, reference)),
                "summary": s.format_speculation() if s is not None else ""})
        bar.update(1)
    bar.close()
    print()
    print_table(rows, [("workload", "workload", ""), ("batch", "batch", "d"),
                       ("system", "system", ""), ("seconds", "seconds", ".2f"),
                       ("tokens_per_s", "tok/s", ".1f"), ("speedup", "speedup", ".2f"),
                       ("acceptance_rate", "accepted/proposed", ".1%"),
                       ("mean_accepted_length", "mean acc. len", ".2f"),
                       ("target_passes_per_token", "passes/token", ".2f"),
                       ("identical_outputs", "identical", "d"), ("requests", "of", "d")])
    for r in rows:
        if r["system"] != "none":
            print(f"{r['workload']}, batch {r['batch']}: {r['system']} {r['speedup']:.2f}x "
                  f"wall-clock vs no speculation, greedy outputs identical "
                  f"{r['identical_outputs']}/{r['requests']}")
    return {"rows": rows, "verify_pass": ratios}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    cells = sorted({(r["workload"], r["batch"]) for r in rows}, key=lambda c: (c[0], c[1]))
    systems = [s for s in ("none", "ngram", "self-draft") if any(r["system"] == s
                                                                   for r in rows)]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(systems)
    for j, system in enumerate(systems):
        values = [next(r["speedup"] for r in rows if (r["workload"], r["batch"]) == c
                       and r["system"] == system) for c in cells]
        ax.bar([i + (j - (len(systems) - 1) / 2) * width for i in range(len(cells))],
               values, width, label=system)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xticks(range(len(cells)), [f"{w}\nbatch {b}" for w, b in cells])
    ax.set_ylabel("wall-clock speedup vs none")
    ax.legend(fontsize=8)
    save_figure(fig, result, path)
