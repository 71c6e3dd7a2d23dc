"""`batching`: continuous vs static batching vs transformers' batched `generate`, on a
long-tailed, decode-heavy workload; plus one decode step taken apart at 16 and 32 running:
the forward, what runs outside it, the sampler, and the dense-matmul floor (the step's
weight products alone, each layer's own weights read from memory as the forward reads them).

The systems run on --backend (default auto: the tuned CPU backend without a GPU). Beside
them, unless --no-reference or --backend numpy, the same workload runs continuously on the
NumPy reference backend, and its decode step is taken apart at the largest running count:
what the plainly written reference costs next to the tuned backend."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from refserve.bench.common import ms, print_table, pyplot, save_figure, traced
from refserve.bench.workloads import Workload, make_workload
from refserve.config import BACKENDS
from refserve.sampling import SamplingParams
from refserve.spec_decode.cost_probe import dense_seconds

HELP = "continuous vs static batching vs transformers' generate"


def add_arguments(p) -> None:
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--mean-output", type=int, default=120)
    p.add_argument("--max-running", type=int, default=16, help="max_num_seqs / HF batch size")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--overhead-running", type=int, nargs="+", default=[16, 32],
                   help="running sequences at which one decode step is taken apart")
    p.add_argument("--overhead-steps", type=int, default=20)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--hf-threads", type=int, default=None,
                   help="torch threads of the transformers baseline (default: torch's own; "
                   "on a busy machine 2 threads can run several times slower than 1)")
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="the backend of the refserve systems (auto: cupy on a GPU, else cpu)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the run on the NumPy reference backend")


def apply_quick(args) -> None:
    # 4 requests, 2 seats: the fewest steps in which static still pads (45 vs 48 steps)
    args.num_requests, args.mean_output, args.max_running = 4, 24, 2
    args.overhead_running, args.overhead_steps = [2], 3
    args.hf_threads = 1


POSITIVE = ("num_requests", "mean_output", "max_running", "overhead_running", "overhead_steps",
            "max_num_batched_tokens")


def run_refserve(llm, workload: Workload, label: str) -> dict:
    engine = llm.llm_engine
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in workload.output_lens]
    before = engine.stats()
    t0 = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    s = llm.last_summary
    steps = after["num_steps"] - before["num_steps"]
    in_step = after["time_in_step"] - before["time_in_step"]
    in_fwd = after["time_in_forward"] - before["time_in_forward"]
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == workload.useful_tokens, (produced, workload.useful_tokens)
    return {
        "system": label, "elapsed_s": elapsed, "useful_tokens": produced,
        "tokens_per_s": produced / elapsed, "steps": steps,
        "slot_steps_used": s.slot_steps_used, "slot_steps_wasted": s.slot_steps_wasted,
        "ttft_p50_ms": ms(s.ttft_p50), "ttft_p99_ms": ms(s.ttft_p99),
        "tpot_p50_ms": ms(s.tpot_p50), "tpot_p99_ms": ms(s.tpot_p99),
        "preemptions": s.num_preemptions,
        # Slots the KV pool had handed out at its fullest: paged blocks follow the tokens,
        # the contiguous layout reserves max_model_len per sequence.
        "kv_slots_peak": s.kv_blocks_peak * engine.block_size,
        "outside_forward_ms_per_step": 1000 * (in_step - in_fwd) / max(steps, 1),
        "outside_forward_fraction": (in_step - in_fwd) / in_step if in_step else 0.0,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def run_transformers(model_dir: Path, workload: Workload, batch_size: int,
                     threads: int | None = None) -> dict:
    """transformers' batched generate: request-level batching as its users run it. Batches of
    `batch_size` in arrival order, left-padded, greedy, each batch decoding until its longest
    request is done (EOS disabled, as in the other systems). `threads`: torch's intra-op
    threads for the run (None: torch's default)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    if threads is not None:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    n = len(workload.prompts)
    outputs: list[list[int]] = [[] for _ in range(n)]
    t0 = time.perf_counter()
    steps = used = wasted = 0
    for start in tqdm(range(0, n, batch_size), desc="transformers", unit="batch"):
        idx = list(range(start, min(start + batch_size, n)))
        prompts = [workload.prompts[i] for i in idx]
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        new = max(workload.output_lens[i] for i in idx)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
        for row, i in enumerate(idx):
            outputs[i] = out[row, width:width + workload.output_lens[i]].tolist()
        steps += new
        used += sum(workload.output_lens[i] for i in idx)
        wasted += new * len(idx) - sum(workload.output_lens[i] for i in idx)
    elapsed = time.perf_counter() - t0
    return {"system": "transformers generate", "elapsed_s": elapsed,
            "useful_tokens": workload.useful_tokens,
            "tokens_per_s": workload.useful_tokens / elapsed, "steps": steps,
            "slot_steps_used": used, "slot_steps_wasted": wasted, "outputs": outputs}


def overhead_at(llm, running: int, steps: int, vocab_size: int) -> dict:
    """One decode step with `running` sequences, taken apart: the whole step, the model
    forward, the dense-matmul floor (the same matmuls on random weights of the model's
    shapes, nothing else), and the sampler at top_p 0.9 (non-greedy, the costly case)."""
    engine = llm.llm_engine
    wl = make_workload(running, seed=1, vocab_size=vocab_size, prompt_range=(32, 64))
    for p in wl.prompts:
        engine.add_request(None, p, SamplingParams(max_tokens=steps + 1, temperature=0.8,
                                                   top_p=0.9, seed=0, ignore_eos=True))
    # Prefill first, then time pure decode steps.
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.num_waiting:
        engine.step()
    sampler_time = [0.0]
    original = engine.sampler.sample

    def timed_sample(*a, **k):
        t0 = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            sampler_time[0] += time.perf_counter() - t0

    if len(engine.scheduler.running) != running:
        raise ValueError(f"overhead at {running} running: {len(engine.scheduler.running)} "
                         f"run at once; the engine needs max_num_seqs >= {running}")
    engine.sampler.sample = timed_sample
    s0, f0 = engine.time_in_step, engine.runner.time_in_forward
    try:
        for _ in range(steps):
            engine.step()
    finally:
        engine.sampler.sample = original
    in_step = engine.time_in_step - s0
    in_fwd = engine.runner.time_in_forward - f0
    while engine.has_unfinished_requests():
        engine.step()
    floor = dense_matmul_floor(engine.model, running)
    step_ms = 1000 * in_step / steps
    return {"backend": engine.backend.name, "running": running, "steps": steps,
            "step_ms": step_ms,
            "forward_ms": 1000 * in_fwd / steps,
            "outside_forward_ms": 1000 * (in_step - in_fwd) / steps,
            "outside_forward_fraction": (in_step - in_fwd) / in_step,
            "dense_matmul_floor_ms": floor, "step_over_floor": step_ms / floor,
            "sampling_top_p_ms": 1000 * sampler_time[0] / steps,
            "sampling_fraction": sampler_time[0] / in_step}


def dense_matmul_floor(model, rows: int, repeats: int = 5) -> float:
    """Milliseconds for one decode step's dense products alone at `rows` rows: per layer
    q/k/v, o, gate/up and down, plus the LM head, with the model's own weights and its
    backend's `linear` (spec_decode/cost_probe.dense_seconds). Every layer's weights are
    distinct, 538 MB for SmolLM2-135M, so they stream from memory as in the forward (one
    layer's 14 MB reused 30 times would sit in the 32 MB L3 and make the floor optimistic).
    The best of `repeats`: what a decode step costs if nothing but its products ran (on
    the compiled kernels a step's forward comes within a few percent of it)."""
    return 1000 * min(dense_seconds(model, [rows], repeats=repeats)[rows])


BATCH_COLS = [("system", "system", ""), ("tokens_per_s", "tok/s", ".1f"),
              ("elapsed_s", "seconds", ".1f"), ("steps", "steps", "d"),
              ("ms_per_step", "ms/step", ".1f"),
              ("slot_steps_used", "slot used", "d"), ("slot_steps_wasted", "slot wasted", "d"),
              ("ttft_p50_ms", "TTFT p50 ms", ".0f"), ("ttft_p99_ms", "TTFT p99 ms", ".0f"),
              ("tpot_p50_ms", "TPOT p50 ms", ".1f"), ("tpot_p99_ms", "TPOT p99 ms", ".1f"),
              ("outside_forward_ms_per_step", "non-fwd ms/step", ".2f"),
              ("kv_slots_peak", "KV slots peak", "d")]


def run(args) -> dict:
    from refserve.llm import LLM

    common = dict(model=args.model, max_num_seqs=args.max_running, progress=False,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    cont = traced(args, LLM(backend=args.backend, **common), "continuous")
    backend = cont.llm_engine.backend.name
    vocab = cont.llm_engine.model.config.vocab_size
    wl = make_workload(args.num_requests, args.seed, vocab, mean_output=args.mean_output)
    print(f"workload: {len(wl.prompts)} requests, prompts {min(map(len, wl.prompts))}-"
          f"{max(map(len, wl.prompts))} tokens, outputs {min(wl.output_lens)}-"
          f"{max(wl.output_lens)} (mean {np.mean(wl.output_lens):.0f}), greedy, ignore_eos, "
          f"max {args.max_running} running, backend {args.backend}→{backend}", flush=True)
    rows = [run_refserve(cont, wl, "refserve continuous")]
    static = traced(args, LLM(backend=args.backend, batching="static", **common), "static")
    rows.append(run_refserve(static, wl, "refserve static"))
    assert rows[1]["outputs"] == rows[0]["outputs"], "static and continuous outputs differ"
    del static
    with_reference = backend != "numpy" and not args.no_reference
    reference = None
    if with_reference:
        reference = traced(args, LLM(backend="numpy", **common), "continuous, reference")
        rows.append(run_refserve(reference, wl, "refserve numpy reference"))
        rows[-1]["same_outputs_as_refserve"] = sum(
            a == b for a, b in zip(rows[-1]["outputs"], rows[0]["outputs"]))
    if not args.no_hf:
        rows.append(run_transformers(cont.llm_engine.model_path, wl, args.max_running,
                                     args.hf_threads))
        rows[-1]["same_outputs_as_refserve"] = sum(
            a == b for a, b in zip(rows[-1]["outputs"], rows[0]["outputs"]))
    for r in rows:
        r["ms_per_step"] = 1000 * r["elapsed_s"] / max(r["steps"], 1)
    # The batching engines run at most --max-running sequences at once: a wider count gets
    # engines of its own.
    wide_config = {**common, "max_num_seqs": max(args.overhead_running)}
    fits = max(args.overhead_running) <= args.max_running
    wide = cont if fits else LLM(backend=args.backend, **wide_config)
    overheads = [overhead_at(wide, n, args.overhead_steps, vocab)
                 for n in sorted(args.overhead_running)]
    del wide, cont
    if with_reference:
        overheads.append(overhead_at(reference if fits else LLM(backend="numpy", **wide_config),
                                     max(args.overhead_running), args.overhead_steps, vocab))
    del reference
    result = {"rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows],
              "overheads": overheads,
              "overhead": max((o for o in overheads if o["backend"] == backend),
                              key=lambda o: o["running"])}
    print()
    print_table(result["rows"], BATCH_COLS)
    base = rows[0]["tokens_per_s"]
    for r in rows[1:]:
        print(f"continuous / {r['system']}: {base / r['tokens_per_s']:.2f}x useful tokens/s")
    for r in rows[2:]:
        print(f"{r['system']}: greedy outputs identical to refserve continuous's for "
              f"{r['same_outputs_as_refserve']}/{len(wl.prompts)} requests")
    for o in overheads:
        print(f"decode step at {o['running']} running, {o['backend']} backend: "
              f"{o['step_ms']:.1f} ms, forward "
              f"{o['forward_ms']:.1f} ms, outside the forward {o['outside_forward_ms']:.2f} ms "
              f"({o['outside_forward_fraction']:.1%}); dense-matmul floor (distinct weights) "
              f"{o['dense_matmul_floor_ms']:.1f} ms, step / floor = {o['step_over_floor']:.2f}x;"
              f" sampling at top_p 0.9 {o['sampling_top_p_ms']:.2f} ms "
              f"({o['sampling_fraction']:.1%} of the step)")
    return result


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    names = [r["system"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"refserve continuous": "tab:green", "refserve static": "tab:orange",
              "transformers generate": "tab:gray"}
    a.bar(names, [r["tokens_per_s"] for r in rows],
          color=[colors.get(name, "tab:blue") for name in names])
    a.set_ylabel("useful output tokens / s")
    a.set_title("Throughput")
    used = [r["slot_steps_used"] for r in rows]
    wasted = [r["slot_steps_wasted"] for r in rows]
    b.bar(names, used, label="used")
    b.bar(names, wasted, bottom=used, label="wasted (padding)")
    b.set_ylabel("slot-steps")
    b.set_title("Slot-steps: one batch seat for one step")
    b.legend(loc="upper left", fontsize=8)  # over the short continuous bar, clear of the rest
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=15)
    save_figure(fig, result, path)
